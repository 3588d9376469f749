// The hot path (issue 12, issue 34): SpaceFace and ManagerFace, the native
// base classes of KVSpace and KVCacheManager. Their alloc / free (and the
// manager's alloc_nowait and `await alloc`) are the one implementation of
// those entry points: class methods, so a breakpoint or a mock on the class
// method fires, and the state they read (closed, a lowered limit waiting to
// be applied, the allocs granted at once) is stored here only; the Python
// subclass reads and writes these fields.
//
// A face takes the common case itself: a plain int n, ids as a canonical
// int64 array or a list of ints, and (the manager's) nobody queued, not
// closed, no limit waiting to be applied, no DEBUG tracing. Anything else
// goes to the subclass's slow path, one function of a table given when the
// face is built (each checked callable then, so a rename fails at start-up):
// it converts the arguments and answers the rare states, and a refusal is
// raised by a function of that table too, so the errors are the checked
// path's. The table holds the class's functions, never the instance: no
// reference cycle.
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

// A table entry: a callable, or a TypeError naming it (at build time).
nb::object checked_callable(const char* face, const char* name, nb::object fn) {
    if (!PyCallable_Check(fn.ptr()))
        throw nb::type_error((std::string(face) + ": " + name + " must be callable, got " +
                              nb::type_name(fn.type()).c_str()).c_str());
    return fn;
}

// KVSpace's base: KVSpace.alloc(n, *, promised=False) and KVSpace.free(blocks).
struct SpaceFace {
    nb::object space_obj;      // the native Space (kept alive)
    Space* space = nullptr;
    nb::object slow_alloc;     // (kvspace, n, promised) -> ids: converts n, then calls SpaceFace.alloc
    nb::object slow_free;      // (kvspace, blocks) -> None: converts the ids, then calls SpaceFace.free
    nb::object alloc_refused;  // (failure, n) -> raises the kvpool error
    nb::object free_refused;   // (failure) -> raises the kvpool error
};

nb::object space_alloc(nb::pointer_and_handle<SpaceFace> self, nb::handle n, nb::handle promised) {
    SpaceFace& f = *self.p;
    int64_t v = 0;
    const bool plain_flag = promised.ptr() == Py_False || promised.ptr() == Py_True;
    if (!plain_flag || !plain_int(n.ptr(), &v)) return f.slow_alloc(self.h, n, promised);
    nb::object r = kvpool::bind::alloc_ids(*f.space, v, promised.ptr() == Py_True);
    if (is_ids(r)) return r;
    f.alloc_refused(r, v);
    throw nb::type_error("alloc_refused returned instead of raising");
}

void space_free(nb::pointer_and_handle<SpaceFace> self, nb::handle blocks) {
    SpaceFace& f = *self.p;
    if (!free_fast(*f.space, blocks, f.free_refused)) f.slow_free(self.h, blocks);
}

// kvpool.tracing's level, its one owner: the faces read it as a field.
struct TraceLevel {
    int64_t level = 30;  // logging.WARNING
};

// KVCacheManager's base: alloc_nowait(n, *, priority=0), free(blocks) and
// `await alloc(n, *, timeout=None, priority=0)`.
struct ManagerFace {
    nb::object space_obj;      // the native Space (kept alive)
    Space* space = nullptr;
    nb::object slow_alloc;     // (manager, n, priority) -> ids: alloc_nowait's slow path
    nb::object slow_free;      // (manager, blocks) -> None: free's slow path
    nb::object slow_await;     // (manager, n, timeout, priority, first try) -> coroutine: await alloc past its first try
    nb::object alloc_refused;  // (manager, failure, n) -> counts, logs, raises
    nb::object try_refused;    // (manager, failure, n) -> raises (await alloc: a refusal other than a shortage)
    nb::object free_refused;   // (failure) -> raises
    nb::object waiters;        // the wait queue's priorities (its owner's list): empty while nobody waits
    nb::object trace_state;    // kvpool.tracing.state (a TraceLevel): held so `level` stays valid
    const TraceLevel* level = nullptr;
    int64_t debug_level = 0;
    int64_t usable = 0;        // blocks an alloc may ask for
    bool closed = false;       // the manager is closed
    bool deferred = false;     // a lowered limit waits to be applied
    int64_t at_once = 0;       // allocs granted at once (by the face and the slow paths)

    // Nothing the slow path would do besides the one native call.
    bool plain_state() const {
        return !closed && PyList_GET_SIZE(waiters.ptr()) == 0 && level->level > debug_level;
    }

    // await alloc's first try: the ids (granted at once), a Failure (a
    // shortage: the caller queues) or None (anything unusual: the slow
    // path); any other refusal is raised.
    nb::object try_alloc(nb::handle self, nb::handle n) {
        int64_t v = 0;
        if (!plain_state() || !plain_int(n.ptr(), &v) || v <= 0 || v > usable) return nb::none();
        nb::object r = kvpool::bind::alloc_ids(*space, v, false);
        if (is_ids(r)) {
            ++at_once;
            return r;
        }
        if (nb::cast<const kvpool::bind::Failure&>(r).code == static_cast<int>(kvpool::Code::Shortage)) return r;
        try_refused(self, r, v);
        throw nb::type_error("try_refused returned instead of raising");
    }
};

nb::object manager_alloc_nowait(nb::pointer_and_handle<ManagerFace> self, nb::handle n, nb::handle priority) {
    ManagerFace& f = *self.p;
    int64_t v = 0, p = -1;
    if (f.plain_state() && plain_int(priority.ptr(), &p) && p == 0 && plain_int(n.ptr(), &v) && v > 0 &&
        v <= f.usable) {
        nb::object r = kvpool::bind::alloc_ids(*f.space, v, false);
        if (is_ids(r)) {
            ++f.at_once;
            return r;
        }
        f.alloc_refused(self.h, r, v);
        throw nb::type_error("alloc_refused returned instead of raising");
    }
    return f.slow_alloc(self.h, n, priority);
}

void manager_free(nb::pointer_and_handle<ManagerFace> self, nb::handle blocks) {
    ManagerFace& f = *self.p;
    if (f.deferred || !f.plain_state() || !free_fast(*f.space, blocks, f.free_refused)) f.slow_free(self.h, blocks);
}

// The manager face's side of an AllocCall (bindings_await.cpp). The face's
// Python object is the manager itself (the AllocCall's owner).
nb::object alloc_first_try(void* face, nb::handle owner, nb::handle n, nb::handle timeout, nb::handle priority,
                           bool* granted) {
    auto* f = static_cast<ManagerFace*>(face);
    int64_t p = -1;
    nb::object first = timeout.is_none() && plain_int(priority.ptr(), &p) && p == 0 ? f->try_alloc(owner, n) : nb::none();
    *granted = is_ids(first);
    return first;
}

nb::object alloc_checked(void* face, nb::handle owner, nb::handle n, nb::handle timeout, nb::handle priority,
                         nb::handle first) {
    return static_cast<ManagerFace*>(face)->slow_await(owner, n, timeout, priority, first);
}

const kvpool::bind::AllocFaceOps alloc_face_ops{alloc_first_try, alloc_checked};

nb::object manager_alloc(nb::pointer_and_handle<ManagerFace> self, nb::handle n, nb::handle timeout,
                         nb::handle priority) {
    return kvpool::bind::make_alloc_call(self.h, self.p, &alloc_face_ops, self.h, n, timeout, priority);
}

}  // namespace

void kvpool::bind::bind_hot_path(nb::module_& m) {
    nb::class_<TraceLevel>(m, "TraceLevel", "kvpool.tracing's level (its one owner): the hot path reads it natively.")
        .def(nb::init<>())
        .def_rw("level", &TraceLevel::level, "Events below this level are not emitted (logging's numbers).");

    nb::class_<SpaceFace>(m, "SpaceFace",
                          "KVSpace's native base: alloc and free, one native call each (kvpool.space).")
        .def(
            "__init__",
            [](SpaceFace* t, nb::handle space, nb::object slow_alloc, nb::object slow_free, nb::object alloc_refused,
               nb::object free_refused) {
                const char* face = "SpaceFace";
                new (t) SpaceFace{nb::borrow(space), nb::cast<Space*>(space),
                                  checked_callable(face, "slow_alloc", std::move(slow_alloc)),
                                  checked_callable(face, "slow_free", std::move(slow_free)),
                                  checked_callable(face, "alloc_refused", std::move(alloc_refused)),
                                  checked_callable(face, "free_refused", std::move(free_refused))};
            },
            "space"_a, nb::kw_only(), "slow_alloc"_a.none(), "slow_free"_a.none(), "alloc_refused"_a.none(),
            "free_refused"_a.none(),
            nb::sig("def __init__(self, space: Space, *, slow_alloc: typing.Callable[..., typing.Any], "
                    "slow_free: typing.Callable[..., None], "
                    "alloc_refused: typing.Callable[[Failure, int], typing.NoReturn], "
                    "free_refused: typing.Callable[[Failure], typing.NoReturn]) -> None"))
        .def("alloc", &space_alloc, "n"_a, nb::kw_only(), "promised"_a = false,
             nb::sig("def alloc(self, n: int, *, promised: bool = False) -> numpy.typing.NDArray[numpy.int64]"),
             "Allocate ``n`` blocks, all or nothing.\n\n"
             "Raises :class:`PoolExhausted` (with ``requested``/``available``) when\n"
             "they are not there; nothing changes then.\n\n"
             "``promised=True``: the caller read ``available() >= n`` while this\n"
             "tenant was not lending and has already told its engine the blocks are\n"
             "there; a tenant below its guarantee (another process) may have started\n"
             "waiting since. The alloc is then granted as that count said: the\n"
             "lending verdict and the waiters' claims on free memory do not refuse\n"
             "it, the limit and the pool's free bytes still do. Use it only right\n"
             "after such a count (the vLLM plugin's ``get_new_blocks`` after its\n"
             "``get_num_free_blocks``); the next count reads the new verdict.")
        .def("free", &space_free, "blocks"_a,
             nb::sig("def free(self, blocks: typing.Any) -> None"),
             "Free a batch of ids. Any bad id raises :class:`InvalidBlocks` and frees nothing.");

    nb::class_<ManagerFace>(m, "ManagerFace",
                            "KVCacheManager's native base: alloc_nowait, free and await alloc (kvpool.manager).")
        .def(
            "__init__",
            [](ManagerFace* t, nb::handle space, nb::object slow_alloc, nb::object slow_free, nb::object slow_await,
               nb::object alloc_refused, nb::object try_refused, nb::object free_refused, nb::list waiters,
               nb::object trace_state, int64_t debug_level, int64_t usable) {
                const char* face = "ManagerFace";
                new (t) ManagerFace{nb::borrow(space),
                                    nb::cast<Space*>(space),
                                    checked_callable(face, "slow_alloc", std::move(slow_alloc)),
                                    checked_callable(face, "slow_free", std::move(slow_free)),
                                    checked_callable(face, "slow_await", std::move(slow_await)),
                                    checked_callable(face, "alloc_refused", std::move(alloc_refused)),
                                    checked_callable(face, "try_refused", std::move(try_refused)),
                                    checked_callable(face, "free_refused", std::move(free_refused)),
                                    std::move(waiters),
                                    trace_state,
                                    nb::cast<const TraceLevel*>(trace_state),
                                    debug_level,
                                    usable};
            },
            "space"_a, nb::kw_only(), "slow_alloc"_a.none(), "slow_free"_a.none(), "slow_await"_a.none(),
            "alloc_refused"_a.none(), "try_refused"_a.none(), "free_refused"_a.none(), "waiters"_a, "trace_state"_a, "debug_level"_a, "usable"_a,
            nb::sig("def __init__(self, space: Space, *, slow_alloc: typing.Callable[..., typing.Any], "
                    "slow_free: typing.Callable[..., None], "
                    "slow_await: typing.Callable[..., collections.abc.Awaitable[typing.Any]], "
                    "alloc_refused: typing.Callable[[typing.Any, Failure, int], typing.NoReturn], "
                    "try_refused: typing.Callable[[typing.Any, Failure, int], typing.NoReturn], "
                    "free_refused: typing.Callable[[Failure], typing.NoReturn], waiters: list[typing.Any], "
                    "trace_state: TraceLevel, debug_level: int, usable: int) -> None"))
        .def("alloc_nowait", &manager_alloc_nowait, "n"_a, nb::kw_only(), "priority"_a = 0,
             nb::sig("def alloc_nowait(self, n: int, *, priority: int = 0) -> numpy.typing.NDArray[numpy.int64]"),
             "n block ids now, or :class:`PoolExhausted` (never queues, never barges).")
        .def("alloc", &manager_alloc, "n"_a, nb::kw_only(), "timeout"_a = nb::none(), "priority"_a = 0,
             nb::sig("def alloc(self, n: int, *, timeout: float | None = None, priority: int = 0) -> "
                     "collections.abc.Coroutine[typing.Any, typing.Any, numpy.typing.NDArray[numpy.int64]]"),
             "Wait until n blocks can be granted, then return their ids.\n\n"
             "FIFO within a priority class (lower number first). ``timeout``\n"
             "raises :class:`TimeoutError` holding nothing; closing the manager\n"
             "raises :class:`PoolClosed`. Cancellation never leaks a block.\n\n"
             "A coroutine (``kvpool._native.AllocCall``): granted at once, its first\n"
             "send returns the ids, with no schedule point between the grant and\n"
             "the return; otherwise it runs the manager's queued wait.")
        .def("free", &manager_free, "blocks"_a,
             nb::sig("def free(self, blocks: typing.Any) -> None"),
             "Give blocks back; waiters are served before any new arrival.")
        .def_rw("_closed", &ManagerFace::closed, "The manager is closed (its one store).")
        .def_rw("_limit_deferred", &ManagerFace::deferred,
                "A lowered limit waits to be applied (its one store): every free takes the slow path, which "
                "re-judges it.")
        .def_rw("_granted_at_once", &ManagerFace::at_once, "Allocs granted at once (its one count).");
}
