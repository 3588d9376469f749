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
    PyObject* target = PyWeakref_GetObject(ref.ptr());  // borrowed; None once it is gone
    if (target == nullptr) throw nb::python_error();
    nb::object o = nb::borrow(target);
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

// The manager face's side of an AllocCall (bindings_await.cpp).
nb::object alloc_first_try(void* face, nb::handle n, nb::handle timeout, nb::handle priority, bool* granted) {
    auto* hot = static_cast<ManagerHotPath*>(face);
    int64_t p = -1;
    nb::object first = timeout.is_none() && plain_int(priority.ptr(), &p) && p == 0 ? hot->try_alloc(n) : nb::none();
    *granted = is_ids(first);
    return first;
}

nb::object alloc_checked(void* face, nb::handle owner, nb::handle n, nb::handle timeout, nb::handle priority,
                         nb::handle first) {
    return static_cast<ManagerHotPath*>(face)->checked_await(owner, n, timeout, priority, first);
}

const kvpool::bind::AllocFaceOps alloc_face_ops{alloc_first_try, alloc_checked};

nb::object manager_alloc(nb::pointer_and_handle<ManagerHotPath> self, nb::handle n, nb::handle timeout,
                           nb::handle priority) {
    nb::object owner = owner_of(self.p->owner, "KVCacheManager");
    return kvpool::bind::make_alloc_call(self.h, self.p, &alloc_face_ops, owner, n, timeout, priority);
}

}  // namespace

void kvpool::bind::bind_hot_path(nb::module_& m) {
    nb::class_<TraceLevel>(m, "TraceLevel", "kvpool.tracing's level (its one owner): the hot path reads it natively.")
        .def(nb::init<>())
        .def_rw("level", &TraceLevel::level, "Events below this level are not emitted (logging's numbers).");
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
        .def("alloc", &manager_alloc, "n"_a, nb::kw_only(), "timeout"_a = nb::none(), "priority"_a = 0,
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
