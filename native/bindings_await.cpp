// `await manager.alloc(n)` with no Python frame (issue 12): AllocCall, a
// native coroutine. KVCacheManager.alloc is ManagerFace.alloc (bindings_hot.cpp,
// the manager's native base), and it returns one of these. Its first send is
// await alloc's first try (the face's try_alloc): granted at once, it returns
// the ids in that same send, so no schedule point lies between the grant and
// the return and no cancellation of any library can lose them (issue 10, D1).
// Anything else (a shortage, an unusual state, a timeout or a priority)
// builds the checked coroutine, KVCacheManager._alloc_checked, and every
// send, throw and close from then on is that coroutine's, exactly as if a
// Python `async def alloc` awaited it. Nothing is taken before the first
// send: a call never awaited, closed, or thrown into first holds nothing (and
// one never awaited warns as a coroutine does).
//
// It is a coroutine by collections.abc.Coroutine (__await__, send, throw,
// close), so asyncio.create_task and trio's nurseries take it, and it has
// am_send, so `await` and asyncio's Task drive it without a StopIteration.
// It behaves as CPython's coroutine objects do where a caller can tell:
// re-entry raises "coroutine already executing", reuse "cannot reuse already
// awaited coroutine", a StopIteration thrown in before the start becomes a
// RuntimeError (PEP 479), and throw's arguments are checked before anything
// changes. It holds its manager (as a coroutine's frame holds self) and is
// always visible to the garbage collector.
#include <nanobind/nanobind.h>

#include <structmember.h>

#include <cstddef>
#include <exception>

#include "bindings.hpp"

namespace nb = nanobind;

namespace {

using kvpool::bind::AllocFaceOps;

struct AllocCall {
    PyObject_HEAD
    PyObject* face;      // the face's Python object (keeps `self` alive)
    void* self;          // the face
    const AllocFaceOps* ops;
    PyObject* owner;     // the manager
    PyObject* n;
    PyObject* timeout;
    PyObject* priority;
    PyObject* inner;     // the checked coroutine, once taken
    PyObject* weakrefs;
    int state;           // Fresh, Delegating or Done
    bool running;        // inside a call into Python on its behalf
};

enum : int { Fresh = 0, Delegating = 1, Done = 2 };

PyTypeObject* alloc_call_type = nullptr;

AllocCall* as_call(PyObject* o) { return reinterpret_cast<AllocCall*>(o); }

int traverse(PyObject* o, visitproc visit, void* arg) {
    AllocCall* c = as_call(o);
    Py_VISIT(Py_TYPE(o));
    Py_VISIT(c->face);
    Py_VISIT(c->owner);
    Py_VISIT(c->n);
    Py_VISIT(c->timeout);
    Py_VISIT(c->priority);
    Py_VISIT(c->inner);
    return 0;
}

int clear(PyObject* o) {
    AllocCall* c = as_call(o);
    Py_CLEAR(c->face);
    Py_CLEAR(c->owner);
    Py_CLEAR(c->n);
    Py_CLEAR(c->timeout);
    Py_CLEAR(c->priority);
    Py_CLEAR(c->inner);
    c->self = nullptr;
    c->state = Done;
    return 0;
}

// A coroutine never awaited warns (RuntimeWarning), as CPython's do.
void finalize(PyObject* o) {
    if (as_call(o)->state != Fresh) return;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (PyErr_WarnEx(PyExc_RuntimeWarning, "coroutine 'KVCacheManager.alloc' was never awaited", 1) < 0)
        PyErr_WriteUnraisable(o);
    PyErr_Restore(t, v, tb);
}

void dealloc(PyObject* o) {
    // Only one never sent can warn (and the finalizer costs a call).
    if (as_call(o)->state == Fresh && PyObject_CallFinalizerFromDealloc(o) < 0) return;  // resurrected
    PyTypeObject* tp = Py_TYPE(o);
    PyObject_GC_UnTrack(o);
    if (as_call(o)->weakrefs != nullptr) PyObject_ClearWeakRefs(o);
    clear(o);
    PyObject_GC_Del(o);
    Py_DECREF(tp);
}

bool enter(AllocCall* c) {
    if (!c->running) return true;
    PyErr_SetString(PyExc_ValueError, "coroutine already executing");
    return false;
}

// Marks the call running for a scope (a nested send, throw or close refuses).
struct Running {
    AllocCall* c;
    explicit Running(AllocCall* c) : c(c) { c->running = true; }
    ~Running() { c->running = false; }
};

// Done (granted, raised, closed, or its checked coroutine finished): it lets
// go of everything at once, as a finished coroutine drops its frame.
void retire(AllocCall* c) { clear(reinterpret_cast<PyObject*>(c)); }

// One call into the checked coroutine (a send, throw or close): made with it
// held and the call marked running; retired when `over(result)` says the
// coroutine is done.
template <class R, class Call, class Over>
R drive(AllocCall* c, Call&& call, Over&& over) {
    PyObject* driven = Py_NewRef(c->inner);
    R r;
    {
        Running run(c);
        r = call(driven);
    }
    if (over(r)) retire(c);
    Py_DECREF(driven);
    return r;
}

PySendResult forward_send(AllocCall* c, PyObject* arg, PyObject** result) {
    return drive<PySendResult>(
        c, [&](PyObject* inner) { return PyIter_Send(inner, arg, result); },
        [](PySendResult r) { return r != PYGEN_NEXT; });
}

// Runs a C++ call that may throw, as a Python error (false: error set).
template <class F>
bool guarded(F&& f) {
    try {
        f();
        return true;
    } catch (nb::python_error& e) {
        e.restore();
    } catch (const nb::builtin_exception& e) {  // a TypeError the face raised (a table entry that returned)
        PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
    }
    return false;
}

// The first send: the first try, then (not granted) the checked coroutine.
PySendResult start(AllocCall* c, PyObject** result) {
    nb::object first, coro;
    bool granted = false;
    {
        Running r(c);
        const bool ok = guarded([&] {
            first = c->ops->first_try(c->self, nb::handle(c->owner), nb::handle(c->n), nb::handle(c->timeout),
                                      nb::handle(c->priority), &granted);
            if (!granted)
                coro = c->ops->checked(c->self, nb::handle(c->owner), nb::handle(c->n), nb::handle(c->timeout),
                                       nb::handle(c->priority), first);
        });
        if (!ok) {
            retire(c);
            return PYGEN_ERROR;
        }
    }
    if (granted) {
        retire(c);
        *result = first.release().ptr();
        return PYGEN_RETURN;
    }
    c->inner = coro.release().ptr();
    c->state = Delegating;
    return forward_send(c, Py_None, result);
}

PySendResult am_send(PyObject* o, PyObject* arg, PyObject** result) {
    AllocCall* c = as_call(o);
    *result = nullptr;
    if (c->state == Done) {
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
        return PYGEN_ERROR;
    }
    if (!enter(c)) return PYGEN_ERROR;
    if (c->state == Fresh) {
        if (arg != Py_None) {  // it stays unstarted, as a coroutine does
            PyErr_SetString(PyExc_TypeError, "can't send non-None value to a just-started coroutine");
            return PYGEN_ERROR;
        }
        return start(c, result);
    }
    return forward_send(c, arg, result);
}

// A send's result as a Python method returns it: the value yielded, or
// StopIteration(value) raised for the value returned.
PyObject* as_method_result(PySendResult r, PyObject* result) {
    if (r == PYGEN_NEXT) return result;
    if (r == PYGEN_ERROR) return nullptr;
    PyObject* stop = PyObject_CallOneArg(PyExc_StopIteration, result);
    Py_DECREF(result);
    if (stop == nullptr) return nullptr;
    PyErr_SetObject(PyExc_StopIteration, stop);
    Py_DECREF(stop);
    return nullptr;
}

PyObject* send(PyObject* o, PyObject* arg) {
    PyObject* result = nullptr;
    const PySendResult r = am_send(o, arg, &result);  // (before result is read)
    return as_method_result(r, result);
}

PyObject* iternext(PyObject* o) { return send(o, Py_None); }

// throw()'s arguments checked and normalized as CPython's coroutines check
// them; false (TypeError set) if they are not an exception.
bool throw_args(PyObject* const* args, Py_ssize_t nargs, PyObject** t, PyObject** v, PyObject** tb) {
    if (nargs < 1 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "throw expected at least 1 argument and at most 3, got %zd", nargs);
        return false;
    }
    PyObject* typ = args[0];
    PyObject* val = nargs > 1 ? args[1] : nullptr;
    PyObject* trace = nargs > 2 ? args[2] : nullptr;
    if (trace == Py_None) trace = nullptr;
    if (trace != nullptr && !PyTraceBack_Check(trace)) {
        PyErr_SetString(PyExc_TypeError, "throw() third argument must be a traceback object");
        return false;
    }
    if (PyExceptionClass_Check(typ)) {
        *t = Py_NewRef(typ);
        *v = Py_XNewRef(val);
        *tb = Py_XNewRef(trace);
        PyErr_NormalizeException(t, v, tb);
        if (*tb != nullptr && *v != nullptr) PyException_SetTraceback(*v, *tb);
        return true;
    }
    if (PyExceptionInstance_Check(typ)) {
        if (val != nullptr && val != Py_None) {
            PyErr_SetString(PyExc_TypeError, "instance exception may not have a separate value");
            return false;
        }
        *v = Py_NewRef(typ);
        *t = Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(typ)));
        *tb = trace != nullptr ? Py_NewRef(trace) : PyException_GetTraceback(typ);
        return true;
    }
    PyErr_Format(PyExc_TypeError, "exceptions must be classes or instances deriving from BaseException, not %s",
                 Py_TYPE(typ)->tp_name);
    return false;
}

// throw(exc) / throw(type[, value[, traceback]]): the checked coroutine's
// once taken (it checks the arguments itself); before that nothing is held,
// and the exception is raised as by a coroutine that never started.
PyObject* throw_(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
    AllocCall* c = as_call(o);
    if (c->state == Delegating) {
        if (!enter(c)) return nullptr;
        return drive<PyObject*>(
            c,
            [&](PyObject* inner) -> PyObject* {
                PyObject* meth = PyObject_GetAttrString(inner, "throw");
                PyObject* r = meth == nullptr ? nullptr
                                              : PyObject_Vectorcall(meth, args, static_cast<size_t>(nargs), nullptr);
                Py_XDECREF(meth);
                return r;
            },
            [](PyObject* r) { return r == nullptr; });  // the exception left the checked coroutine: it is done
    }
    PyObject *t = nullptr, *v = nullptr, *tb = nullptr;
    if (!throw_args(args, nargs, &t, &v, &tb)) return nullptr;
    if (c->state == Done) {
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
        return nullptr;
    }
    if (!enter(c)) {
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
        return nullptr;
    }
    retire(c);
    if (PyErr_GivenExceptionMatches(t, PyExc_StopIteration)) {  // PEP 479
        PyObject* msg = PyUnicode_FromString("coroutine raised StopIteration");
        PyObject* err = msg == nullptr ? nullptr : PyObject_CallOneArg(PyExc_RuntimeError, msg);
        Py_XDECREF(msg);
        Py_XDECREF(t);
        Py_XDECREF(tb);
        if (err == nullptr) {
            Py_XDECREF(v);
            return nullptr;
        }
        PyException_SetContext(err, Py_XNewRef(v));
        PyException_SetCause(err, v);  // steals v
        PyErr_Restore(Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(err))), err, nullptr);
        return nullptr;
    }
    PyErr_Restore(t, v, tb);  // no implicit chaining onto the caller's exception
    return nullptr;
}

PyObject* close(PyObject* o, PyObject*) {
    AllocCall* c = as_call(o);
    if (c->state != Delegating) {
        retire(c);
        Py_RETURN_NONE;
    }
    if (!enter(c)) return nullptr;
    return drive<PyObject*>(
        c, [](PyObject* inner) { return PyObject_CallMethod(inner, "close", nullptr); },
        [](PyObject*) { return true; });
}

PyObject* await_(PyObject* o) { return Py_NewRef(o); }

PyObject* get_name(PyObject*, void*) { return PyUnicode_FromString("alloc"); }
PyObject* get_qualname(PyObject*, void*) { return PyUnicode_FromString("KVCacheManager.alloc"); }
PyObject* get_running(PyObject* o, void*) { return PyBool_FromLong(as_call(o)->running); }
PyObject* get_await(PyObject* o, void*) {
    AllocCall* c = as_call(o);
    return Py_NewRef(c->state == Delegating && c->inner != nullptr ? c->inner : Py_None);
}
// No cr_frame: it has no frame of its own, and a framework that finds none
// (trio: hasattr(coro, "cr_frame") in older releases) wraps it in one.

PyGetSetDef getset[] = {
    {"__name__", get_name, nullptr, nullptr, nullptr},
    {"__qualname__", get_qualname, nullptr, nullptr, nullptr},
    {"cr_running", get_running, nullptr, "Inside a send, throw or close.", nullptr},
    {"cr_await", get_await, nullptr, "The checked coroutine it forwards to, once taken (else None).", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyMemberDef members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(AllocCall, weakrefs), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyMethodDef methods[] = {
    {"send", send, METH_O, "Send a value into the call (None first)."},
    {"throw", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(throw_)), METH_FASTCALL,
     "Raise an exception in the call: the checked coroutine's once taken, else at its start (nothing is held)."},
    {"close", close, METH_NOARGS, "Close the call (the checked coroutine's close once taken)."},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(dealloc)},
    {Py_tp_finalize, reinterpret_cast<void*>(finalize)},
    {Py_tp_traverse, reinterpret_cast<void*>(traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(clear)},
    {Py_tp_iternext, reinterpret_cast<void*>(iternext)},
    {Py_tp_methods, methods},
    {Py_tp_getset, getset},
    {Py_tp_members, members},
    {Py_am_await, reinterpret_cast<void*>(await_)},
    {Py_am_send, reinterpret_cast<void*>(am_send)},
    {Py_tp_doc, const_cast<char*>("`await manager.alloc(n)`: a native coroutine. Its first send grants at once "
                                  "(returning the ids with no schedule point) or hands over to the checked "
                                  "coroutine, KVCacheManager._alloc_checked; nothing is held before that send.")},
    {0, nullptr},
};

PyType_Spec spec = {"kvpool._native.AllocCall", sizeof(AllocCall), 0,
                    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION, slots};

}  // namespace

nb::object kvpool::bind::make_alloc_call(nb::handle face_obj, void* face, const AllocFaceOps* ops, nb::handle owner,
                                         nb::handle n, nb::handle timeout, nb::handle priority) {
    if (alloc_call_type == nullptr) {
        alloc_call_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&spec));
        if (alloc_call_type == nullptr) throw nb::python_error();
    }
    AllocCall* c = PyObject_GC_New(AllocCall, alloc_call_type);  // (a heap type: it took the type's reference)
    if (c == nullptr) throw nb::python_error();
    c->face = Py_NewRef(face_obj.ptr());
    c->self = face;
    c->ops = ops;
    c->owner = Py_NewRef(owner.ptr());
    c->n = Py_NewRef(n.ptr());
    c->timeout = Py_NewRef(timeout.ptr());
    c->priority = Py_NewRef(priority.ptr());
    c->inner = nullptr;
    c->weakrefs = nullptr;
    c->state = Fresh;
    c->running = false;
    PyObject_GC_Track(reinterpret_cast<PyObject*>(c));
    return nb::steal(reinterpret_cast<PyObject*>(c));
}
