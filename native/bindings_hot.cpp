// The hot path's Python faces (issue 12): KVSpace.alloc / free and
// KVCacheManager.alloc_nowait / free, each bound on the instance as one
// native call with no Python frame. A face takes the common case itself: a
// plain int n, ids as a canonical int64 array or a list of ints, and (the
// manager's) nobody queued, not closed, no limit waiting to be applied, no
// DEBUG tracing. Anything else goes to its owner's Python method (the class's
// own alloc / free: the checked path, unchanged), so every odd argument and
// every rare state is answered exactly as before. A refused alloc or free is
// raised by a Python hook too, so the errors are the checked path's.
//
// No reference cycle: a face holds its owner through a weak reference, the
// native Space, plain Python containers and module-level functions.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>
#include <vector>

#define PY_ARRAY_UNIQUE_SYMBOL kvpool_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

#include "bindings.hpp"
#include "space.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using kvpool::Space;

namespace {

// A Python int within int64 (not a bool, not a subclass).
bool plain_int(PyObject* o, int64_t* v) {
    if (!PyLong_CheckExact(o)) return false;
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow != 0) return false;
    *v = static_cast<int64_t>(x);
    return true;
}

// The Python object a face belongs to (its weak reference's target).
nb::object owner_of(const nb::object& ref, const char* what) {
    nb::object o = ref();
    if (o.is_none()) throw nb::type_error((std::string("the ") + what + " this method was bound to is gone").c_str());
    return o;
}

// The ids of a free when they are in a form the core reads directly (false:
// the owner's checked path converts them).
bool fast_ids(nb::handle blocks, const int64_t** data, int64_t* n, std::vector<int64_t>& scratch) {
    PyObject* o = blocks.ptr();
    if (!PyArray_CheckExact(o) && !PyList_CheckExact(o)) return false;
    try {
        *data = kvpool::bind::id_buffer(blocks, n, scratch);
    } catch (const nb::builtin_exception&) {  // a TypeError: not a form read directly
        return false;
    }
    return true;
}

bool is_ids(const nb::object& r) { return PyArray_CheckExact(r.ptr()); }

// A free both faces run: the ids read natively and freed in one native call
// (a refusal raised through `refused`), or false without touching anything
// when they are not in a form the core reads directly.
bool free_fast(Space& s, nb::handle blocks, const nb::object& refused) {
    thread_local std::vector<int64_t> scratch;
    const int64_t* data = nullptr;
    int64_t n = 0;
    if (!fast_ids(blocks, &data, &n, scratch)) return false;
    nb::object r = kvpool::bind::free_ids(s, data, n, /*want_available=*/false);
    if (r.is_none()) return true;
    refused(r);
    throw nb::type_error("free_refused returned instead of raising");
}

// A Space's Python object and the Space itself.
struct Bound {
    nb::object obj;
    Space* space = nullptr;
    explicit Bound(nb::handle s) : obj(nb::borrow(s)), space(nb::cast<Space*>(s)) {}
};

// KVSpace.alloc(n, *, promised=False) and KVSpace.free(blocks).
struct SpaceHotPath {
    Bound space;
    nb::object owner;         // weakref to the KVSpace
    nb::object checked_alloc; // KVSpace.alloc (the class's: the checked path)
    nb::object checked_free;  // KVSpace.free
    nb::object alloc_refused; // (failure, n) -> raises the kvpool error
    nb::object free_refused;  // (failure) -> raises the kvpool error

    nb::object alloc(nb::handle n, nb::handle promised) {
        int64_t v = 0;
        const bool plain_flag = promised.ptr() == Py_False || promised.ptr() == Py_True;
        if (!plain_flag || !plain_int(n.ptr(), &v))
            return checked_alloc(owner_of(owner, "KVSpace"), n, "promised"_a = promised);
        nb::object r = kvpool::bind::alloc_ids(*space.space, v, promised.ptr() == Py_True);
        if (is_ids(r)) return r;
        alloc_refused(r, v);
        throw nb::type_error("alloc_refused returned instead of raising");
    }

    void free(nb::handle blocks) {
        if (!free_fast(*space.space, blocks, free_refused)) checked_free(owner_of(owner, "KVSpace"), blocks);
    }
};

// kvpool.tracing's level, its one owner: the faces read it as a field.
struct TraceLevel {
    int64_t level = 30;  // logging.WARNING
};

// KVCacheManager.alloc_nowait(n, *, priority=0) and KVCacheManager.free(blocks).
struct ManagerHotPath {
    Bound space;
    nb::object owner;          // weakref to the manager
    nb::object checked_alloc;  // KVCacheManager.alloc_nowait (the class's)
    nb::object checked_free;   // KVCacheManager.free
    nb::object alloc_refused;  // (manager, failure, n) -> counts, logs, raises
    nb::object try_refused;    // (manager, failure, n) -> raises (await alloc: a refusal other than a shortage)
    nb::object free_refused;   // (failure) -> raises
    nb::object checked_await;  // KVCacheManager._alloc_checked: (manager, n, timeout, priority, first try) -> coroutine
    nb::object waiters;        // the wait queue's priorities: a list, empty while nobody waits
    nb::object trace_state;    // kvpool.tracing.state (a TraceLevel): held so `level` stays valid
    const TraceLevel* level = nullptr;
    int64_t debug_level = 0;
    int64_t usable = 0;        // blocks an alloc may ask for
    bool closed = false;       // set by the manager: closed
    bool deferred = false;     // set by the manager: a lowered limit waits to be applied
    int64_t at_once = 0;       // allocs this face granted

    // Nothing the checked path would do besides the one native call.
    bool plain_state() const {
        return !closed && PyList_GET_SIZE(waiters.ptr()) == 0 && level->level > debug_level;
    }

    nb::object alloc_nowait(nb::handle n, nb::handle priority) {
        int64_t v = 0, p = -1;
        if (plain_state() && plain_int(priority.ptr(), &p) && p == 0 && plain_int(n.ptr(), &v) && v > 0 &&
            v <= usable) {
            nb::object r = kvpool::bind::alloc_ids(*space.space, v, false);
            if (is_ids(r)) {
                ++at_once;
                return r;
            }
            alloc_refused(owner_of(owner, "KVCacheManager"), r, v);
            throw nb::type_error("alloc_refused returned instead of raising");
        }
        return checked_alloc(owner_of(owner, "KVCacheManager"), n, "priority"_a = priority);
    }

    // await alloc's first try: the ids (granted at once), a Failure (a
    // shortage: the caller queues) or None (anything unusual: the caller's
    // checked path); any other refusal is raised.
    nb::object try_alloc(nb::handle n) {
        int64_t v = 0;
        if (!plain_state() || !plain_int(n.ptr(), &v) || v <= 0 || v > usable) return nb::none();
        nb::object r = kvpool::bind::alloc_ids(*space.space, v, false);
        if (is_ids(r)) {
            ++at_once;
            return r;
        }
        if (nb::cast<const kvpool::bind::Failure&>(r).code == static_cast<int>(kvpool::Code::Shortage)) return r;
        try_refused(owner_of(owner, "KVCacheManager"), r, v);
        throw nb::type_error("try_refused returned instead of raising");
    }

    void free(nb::handle blocks) {
        if (deferred || !plain_state() || !free_fast(*space.space, blocks, free_refused))
            checked_free(owner_of(owner, "KVCacheManager"), blocks);
    }
};

// `await manager.alloc(n)` with no Python frame (issue 12): the manager binds
// ManagerHotPath.alloc on the instance, and it returns an AllocCall, a native
// coroutine. Its first send is await alloc's first try (try_alloc): granted at
// once, it returns the ids right there, so no schedule point lies between the
// grant and the return and no cancellation of any library can lose them (issue
// 10, D1). Anything else (a shortage, an unusual state, a timeout or priority)
// builds the checked coroutine, KVCacheManager._alloc_checked, and every send,
// throw and close from then on is that coroutine's. Nothing is taken before the
// first send: a call never awaited, closed or thrown into first holds nothing.
//
// It is a coroutine by collections.abc.Coroutine (__await__, send, throw,
// close), so asyncio.create_task and trio's start_soon take it, and it has
// am_send, so `await` and asyncio's Task drive it without raising StopIteration.
struct AllocCall {
    PyObject_HEAD
    PyObject* face;      // the ManagerHotPath (strong)
    ManagerHotPath* hot;
    PyObject* n;
    PyObject* timeout;
    PyObject* priority;
    PyObject* inner;     // the checked coroutine, once taken
    int state;           // Fresh, Delegating or Done
};

enum : int { Fresh = 0, Delegating = 1, Done = 2 };

PyTypeObject* alloc_call_type = nullptr;

int alloc_call_traverse(PyObject* o, visitproc visit, void* arg) {
    auto* c = reinterpret_cast<AllocCall*>(o);
    Py_VISIT(Py_TYPE(o));
    Py_VISIT(c->face);
    Py_VISIT(c->n);
    Py_VISIT(c->timeout);
    Py_VISIT(c->priority);
    Py_VISIT(c->inner);
    return 0;
}

int alloc_call_clear(PyObject* o) {
    auto* c = reinterpret_cast<AllocCall*>(o);
    Py_CLEAR(c->face);
    Py_CLEAR(c->n);
    Py_CLEAR(c->timeout);
    Py_CLEAR(c->priority);
    Py_CLEAR(c->inner);
    c->hot = nullptr;
    c->state = Done;
    return 0;
}

void alloc_call_dealloc(PyObject* o) {
    PyTypeObject* tp = Py_TYPE(o);
    if (PyObject_GC_IsTracked(o)) PyObject_GC_UnTrack(o);
    alloc_call_clear(o);
    PyObject_GC_Del(o);
    Py_DECREF(tp);
}

void finish(AllocCall* c) {
    c->state = Done;
    Py_CLEAR(c->inner);
}

// The first send: try_alloc, then (not granted) the checked coroutine.
PySendResult alloc_call_start(AllocCall* c, PyObject* arg, PyObject** result) {
    *result = nullptr;
    if (arg != Py_None) {
        c->state = Done;
        PyErr_SetString(PyExc_TypeError, "can't send non-None value to a just-started coroutine");
        return PYGEN_ERROR;
    }
    nb::object first;
    int64_t p = -1;
    try {
        if (c->timeout == Py_None && plain_int(c->priority, &p) && p == 0) {
            first = c->hot->try_alloc(nb::handle(c->n));
            if (is_ids(first)) {
                c->state = Done;
                *result = first.release().ptr();
                return PYGEN_RETURN;
            }
        } else {
            first = nb::none();
        }
        nb::object owner = owner_of(c->hot->owner, "KVCacheManager");
        nb::object coro = c->hot->checked_await(owner, nb::handle(c->n), nb::handle(c->timeout),
                                                nb::handle(c->priority), first);
        c->inner = coro.release().ptr();
    } catch (nb::python_error& e) {
        c->state = Done;
        e.restore();
        return PYGEN_ERROR;
    } catch (const nb::builtin_exception& e) {  // owner_of: the manager is gone
        c->state = Done;
        PyErr_SetString(PyExc_TypeError, e.what());
        return PYGEN_ERROR;
    } catch (const std::exception& e) {
        c->state = Done;
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return PYGEN_ERROR;
    }
    c->state = Delegating;
    PyObject_GC_Track(reinterpret_cast<PyObject*>(c));  // it may now sit in a cycle through a waiting task
    const PySendResult r = PyIter_Send(c->inner, Py_None, result);
    if (r != PYGEN_NEXT) finish(c);
    return r;
}

PySendResult alloc_call_send(PyObject* o, PyObject* arg, PyObject** result) {
    auto* c = reinterpret_cast<AllocCall*>(o);
    switch (c->state) {
        case Fresh: return alloc_call_start(c, arg, result);
        case Delegating: {
            const PySendResult r = PyIter_Send(c->inner, arg, result);
            if (r != PYGEN_NEXT) finish(c);
            return r;
        }
        default:
            *result = nullptr;
            PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
            return PYGEN_ERROR;
    }
}

// A send's result as a Python call returns it: the value yielded, or
// StopIteration(value) raised for the value returned.
PyObject* as_call(PySendResult r, PyObject* result) {
    if (r == PYGEN_NEXT) return result;
    if (r == PYGEN_ERROR) return nullptr;
    PyObject* stop = PyObject_CallOneArg(PyExc_StopIteration, result);
    Py_DECREF(result);
    if (stop == nullptr) return nullptr;
    PyErr_SetObject(PyExc_StopIteration, stop);
    Py_DECREF(stop);
    return nullptr;
}

PyObject* alloc_call_send_method(PyObject* o, PyObject* arg) {
    PyObject* result = nullptr;
    const PySendResult r = alloc_call_send(o, arg, &result);  // (before result is read)
    return as_call(r, result);
}

PyObject* alloc_call_iternext(PyObject* o) { return alloc_call_send_method(o, Py_None); }

// throw(exc) / throw(type[, value[, traceback]]): the checked coroutine's
// once taken; before that nothing is held, so the exception is raised as a
// coroutine that never started raises it.
PyObject* alloc_call_throw(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
    auto* c = reinterpret_cast<AllocCall*>(o);
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "throw expected 1 to 3 arguments");
        return nullptr;
    }
    if (c->state == Delegating) {
        PyObject* inner = c->inner;
        Py_INCREF(inner);
        PyObject* meth = PyObject_GetAttrString(inner, "throw");
        PyObject* r = meth == nullptr ? nullptr : PyObject_Vectorcall(meth, args, static_cast<size_t>(nargs), nullptr);
        Py_XDECREF(meth);
        Py_DECREF(inner);
        if (r == nullptr) finish(c);
        return r;
    }
    c->state = Done;
    PyObject* typ = args[0];
    PyObject* val = nargs > 1 ? args[1] : Py_None;
    PyObject* tb = nargs > 2 ? args[2] : Py_None;
    if (PyExceptionInstance_Check(typ)) {
        if (val != Py_None) {
            PyErr_SetString(PyExc_TypeError, "instance exception may not have a separate value");
            return nullptr;
        }
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(typ)), typ);
    } else if (PyExceptionClass_Check(typ)) {
        PyErr_SetObject(typ, val);
    } else {
        PyErr_Format(PyExc_TypeError, "exceptions must be classes or instances deriving from BaseException, not %s",
                     Py_TYPE(typ)->tp_name);
        return nullptr;
    }
    if (tb != Py_None) {
        PyObject *t = nullptr, *v = nullptr, *old = nullptr;
        PyErr_Fetch(&t, &v, &old);
        PyErr_NormalizeException(&t, &v, &old);
        Py_XDECREF(old);
        if (v != nullptr) PyException_SetTraceback(v, tb);
        PyErr_Restore(t, v, Py_NewRef(tb));
    }
    return nullptr;
}

PyObject* alloc_call_close(PyObject* o, PyObject*) {
    auto* c = reinterpret_cast<AllocCall*>(o);
    if (c->state == Delegating) {
        PyObject* inner = c->inner;
        Py_INCREF(inner);
        PyObject* r = PyObject_CallMethod(inner, "close", nullptr);
        Py_DECREF(inner);
        finish(c);
        return r;
    }
    c->state = Done;
    Py_RETURN_NONE;
}

PyObject* alloc_call_await(PyObject* o) { return Py_NewRef(o); }

PyMethodDef alloc_call_methods[] = {
    {"send", alloc_call_send_method, METH_O, "Send a value into the call (None first)."},
    {"throw", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(alloc_call_throw)), METH_FASTCALL,
     "Raise an exception in the call: the checked coroutine's once taken, else at its start (nothing is held)."},
    {"close", alloc_call_close, METH_NOARGS, "Close the call (the checked coroutine's close once taken)."},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot alloc_call_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(alloc_call_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(alloc_call_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(alloc_call_clear)},
    {Py_tp_iternext, reinterpret_cast<void*>(alloc_call_iternext)},
    {Py_tp_methods, alloc_call_methods},
    {Py_am_await, reinterpret_cast<void*>(alloc_call_await)},
    {Py_am_send, reinterpret_cast<void*>(alloc_call_send)},
    {Py_tp_doc, const_cast<char*>("`await manager.alloc(n)`: a native coroutine. Its first send grants at once "
                                  "(returning the ids with no schedule point) or hands over to the checked "
                                  "coroutine, KVCacheManager._alloc_checked; nothing is held before that send.")},
    {0, nullptr},
};

PyType_Spec alloc_call_spec = {"kvpool._native.AllocCall", sizeof(AllocCall), 0,
                               Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, alloc_call_slots};

nb::object make_alloc_call(nb::pointer_and_handle<ManagerHotPath> self, nb::handle n, nb::handle timeout,
                           nb::handle priority) {
    auto* c = PyObject_GC_New(AllocCall, alloc_call_type);
    if (c == nullptr) throw nb::python_error();  // (a heap type: PyObject_GC_New took its reference)
    c->face = Py_NewRef(self.h.ptr());
    c->hot = self.p;
    c->n = Py_NewRef(n.ptr());
    c->timeout = Py_NewRef(timeout.ptr());
    c->priority = Py_NewRef(priority.ptr());
    c->inner = nullptr;
    c->state = Fresh;
    return nb::steal(reinterpret_cast<PyObject*>(c));
}

}  // namespace

void kvpool::bind::bind_hot_path(nb::module_& m) {
    nb::class_<TraceLevel>(m, "TraceLevel", "kvpool.tracing's level (its one owner): the hot path reads it natively.")
        .def(nb::init<>())
        .def_rw("level", &TraceLevel::level, "Events below this level are not emitted (logging's numbers).");
    alloc_call_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&alloc_call_spec));
    if (alloc_call_type == nullptr) throw nb::python_error();
    // Not a module attribute: nothing constructs one but ManagerHotPath.alloc,
    // and the stub types it as the Coroutine it is.
    nb::class_<SpaceHotPath>(m, "SpaceHotPath",
                             "KVSpace.alloc / free as one native call each (kvpool.space binds them on the instance).")
        .def(
            "__init__",
            [](SpaceHotPath* t, nb::handle space, nb::object owner, nb::object checked_alloc, nb::object checked_free,
               nb::object alloc_refused, nb::object free_refused) {
                new (t) SpaceHotPath{Bound(space), std::move(owner), std::move(checked_alloc),
                                     std::move(checked_free), std::move(alloc_refused), std::move(free_refused)};
            },
            "space"_a, "owner"_a, "checked_alloc"_a, "checked_free"_a, "alloc_refused"_a, "free_refused"_a,
            nb::sig("def __init__(self, space: Space, owner: weakref.ReferenceType[typing.Any], "
                    "checked_alloc: typing.Callable[..., typing.Any], checked_free: typing.Callable[..., typing.Any], "
                    "alloc_refused: typing.Callable[[Failure, int], typing.NoReturn], "
                    "free_refused: typing.Callable[[Failure], typing.NoReturn]) -> None"))
        .def("alloc", &SpaceHotPath::alloc, "n"_a, nb::kw_only(), "promised"_a = false,
             nb::sig("def alloc(self, n: int, *, promised: bool = False) -> numpy.typing.NDArray[numpy.int64]"),
             "KVSpace.alloc: n block ids, or the kvpool error.")
        .def("free", &SpaceHotPath::free, "blocks"_a,
             nb::sig("def free(self, blocks: typing.Any) -> None"), "KVSpace.free: every id or none, or the kvpool error.");

    nb::class_<ManagerHotPath>(m, "ManagerHotPath",
                               "KVCacheManager.alloc_nowait / free as one native call each while nothing is unusual "
                               "(kvpool.manager binds them on the instance).")
        .def(
            "__init__",
            [](ManagerHotPath* t, nb::handle space, nb::object owner, nb::object checked_alloc,
               nb::object checked_free, nb::object alloc_refused, nb::object try_refused, nb::object free_refused,
               nb::object checked_await, nb::list waiters,
               nb::object trace_state, int64_t debug_level, int64_t usable) {
                new (t) ManagerHotPath{Bound(space),
                                       std::move(owner),
                                       std::move(checked_alloc),
                                       std::move(checked_free),
                                       std::move(alloc_refused),
                                       std::move(try_refused),
                                       std::move(free_refused),
                                       std::move(checked_await),
                                       std::move(waiters),
                                       trace_state,
                                       nb::cast<const TraceLevel*>(trace_state),
                                       debug_level,
                                       usable};
            },
            "space"_a, "owner"_a, "checked_alloc"_a, "checked_free"_a, "alloc_refused"_a, "try_refused"_a,
            "free_refused"_a, "checked_await"_a, "waiters"_a, "trace_state"_a, "debug_level"_a, "usable"_a,
            nb::sig("def __init__(self, space: Space, owner: weakref.ReferenceType[typing.Any], "
                    "checked_alloc: typing.Callable[..., typing.Any], checked_free: typing.Callable[..., typing.Any], "
                    "alloc_refused: typing.Callable[[typing.Any, Failure, int], typing.NoReturn], "
                    "try_refused: typing.Callable[[typing.Any, Failure, int], typing.NoReturn], "
                    "free_refused: typing.Callable[[Failure], typing.NoReturn], "
                    "checked_await: typing.Callable[..., collections.abc.Awaitable[typing.Any]], waiters: list[typing.Any], "
                    "trace_state: TraceLevel, debug_level: int, usable: int) -> None"))
        .def("alloc_nowait", &ManagerHotPath::alloc_nowait, "n"_a, nb::kw_only(), "priority"_a = 0,
             nb::sig("def alloc_nowait(self, n: int, *, priority: int = 0) -> numpy.typing.NDArray[numpy.int64]"),
             "KVCacheManager.alloc_nowait: n block ids, or the kvpool error.")
        .def("try_alloc", &ManagerHotPath::try_alloc, "n"_a,
             nb::sig("def try_alloc(self, n: typing.Any) -> numpy.typing.NDArray[numpy.int64] | Failure | None"),
             "await alloc's first try: ids, a Failure (a shortage: queue) or None (take the checked path).")
        .def("alloc", &make_alloc_call, "n"_a, nb::kw_only(), "timeout"_a = nb::none(), "priority"_a = 0,
             nb::sig("def alloc(self, n: int, *, timeout: float | None = None, priority: int = 0) -> "
                     "collections.abc.Coroutine[typing.Any, typing.Any, numpy.typing.NDArray[numpy.int64]]"),
             "await KVCacheManager.alloc: an AllocCall (granted at once on its first send, else the checked "
             "coroutine).")
        .def("free", &ManagerHotPath::free, "blocks"_a, nb::sig("def free(self, blocks: typing.Any) -> None"),
             "KVCacheManager.free.")
        .def_rw("closed", &ManagerHotPath::closed, "The manager is closed: every call takes the checked path.")
        .def_rw("deferred", &ManagerHotPath::deferred,
                "A lowered limit waits to be applied: every free takes the checked path (it re-judges it).")
        .def_ro("at_once", &ManagerHotPath::at_once, "Allocs this face granted.");
}
