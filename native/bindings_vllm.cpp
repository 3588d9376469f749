// The vLLM plugin's hot path (issue 12): the native half of its free block
// queue (adapters/vllm/block_pool.py: _SpaceFreeQueue subclasses it) and the
// two BlockPool methods vLLM calls per request, bound on the plugin's pool
// instance as native methods so a round trip enters no plugin Python frame:
//
//   get_num_free_blocks  what the space can deliver now plus the evictable
//                        blocks, capped by vLLM's own count (a lender: 0)
//   get_new_blocks       vLLM's own BlockPool.get_new_blocks over the space,
//                        its free-count check reading the virtual count
//   popleft_n            the space's best-fit ids answered as vLLM's blocks
//   prepend_n            freed blocks back to the space in one native call
//   append_n             cached blocks held as evictable (vLLM calls it on
//                        every free, most often with none)
//
// Each takes the common case itself and hands anything else to the plugin's
// Python (a shortage, a lender's grant, blocks a reuse watcher waits on, an
// allocation beyond the last count) through the callbacks it was built with:
// one table of callables, each checked when the queue is built, so the core
// names no method of the plugin (a rename fails at start-up, not at the
// first shortage).
// The counters vLLM and the plugin share live here, so both read one copy.
//
// The queue holds the plugin's pool (its hooks) and the pool holds the queue:
// the cycle is visible to Python's collector (tp_traverse / tp_clear).
#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>
#include <utility>

#include "bindings.hpp"
#include "space.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using kvpool::Space;

namespace {

struct VllmFreeQueue {
    nb::object space_obj;   // the native Space
    Space* space = nullptr;
    nb::object blocks;      // vLLM's block objects, indexed by block id (a list)
    nb::object evictable;   // held blocks at ref 0, oldest first (a dict)
    nb::object watchers;    // vLLM's reuse watchers (a dict, never rebound)
    nb::object pool;        // the plugin's KVPoolBlockPool: its hooks
    nb::object checked_get_new;  // KVPoolBlockPool.get_new_blocks (the class's)
    nb::object vllm_get_new;     // vLLM's BlockPool.get_new_blocks
    nb::object free_refused;     // (failure) -> raises the kvpool error
    nb::object take_short;       // (n, covered, alloc answer) -> blocks: popleft_n off its common case
    nb::object report_waiting;   // (waiting) -> None: tell the pool's ledger
    nb::object keep_readable;    // (blocks) -> the blocks no reuse watcher waits on
    nb::str block_id;            // the block objects' int id attribute

    int64_t total = 0;            // every block but vLLM's null block
    int64_t num_free_blocks = 0;  // vLLM's figure: both ends of the queue, virtual
    int64_t promised = 0;         // blocks the last free count told vLLM it could have
    int64_t lend_refusals = 0;    // free counts answered 0 while lending
    int64_t reported_waiting = 0; // what the pool's ledger was last told
    bool lending = false;         // the budget's verdict as last read
    bool virtual_count = false;   // inside vLLM's get_new_blocks: its check reads the virtual count

    // get_num_free_blocks.
    int64_t count_free() {
        if (virtual_count) return num_free_blocks;
        if (lending) {
            // A lender does not grow, not even into its own cache.
            ++lend_refusals;
            promised = 0;
            return 0;
        }
        int64_t free = kvpool::bind::available_now(*space) + PyDict_GET_SIZE(evictable.ptr());
        if (free > num_free_blocks) free = num_free_blocks;
        promised = free;  // vLLM allocates right after this answer, trusting it
        return free;
    }

    // popleft_n: granted (and not lending) stays here; otherwise the plugin's
    // _take_short answers (a lender's grant re-reads the budget; a refusal
    // evicts, counts or waits).
    nb::object popleft_n(int64_t n) {
        const bool covered = n <= promised;
        nb::object got = kvpool::bind::alloc_items(*space, n, blocks, covered);
        if (PyList_CheckExact(got.ptr()) && !lending)
            promised = covered ? promised - n : 0;
        else
            got = take_short(n, covered, got);
        num_free_blocks -= n;
        return got;
    }

    nb::object popleft() {
        nb::object got = popleft_n(1);
        PyObject* item = PySequence_GetItem(got.ptr(), 0);
        if (item == nullptr) throw nb::python_error();
        return nb::steal(item);
    }

    // prepend_n: blocks at ref 0 with no cache hash go back to the space;
    // those a reuse watcher waits on stay readable (the Python side).
    void prepend_n(nb::handle given) {
        nb::object list = nb::borrow(given);
        if (!PyList_CheckExact(list.ptr())) list = nb::steal(PySequence_List(given.ptr()));
        if (!list.is_valid()) throw nb::python_error();
        if (PyDict_GET_SIZE(watchers.ptr()) != 0) list = keep_readable(list);
        const Py_ssize_t n = PyList_Size(list.ptr());
        if (n < 0) throw nb::python_error();
        if (n > 0) {
            nb::object r = kvpool::bind::free_items(*space, list, block_id, /*want_available=*/false);
            if (!r.is_none()) {
                free_refused(r);
                throw nb::type_error("free_refused returned instead of raising");
            }
            num_free_blocks += n;
        }
        note_if_idle();
    }

    // append_n: cached (or unpinned) blocks at ref 0, held, most recent last
    // (vLLM calls it on every free, most often with no block).
    void append_n(nb::handle given) {
        nb::object list = nb::borrow(given);
        if (!PyList_CheckExact(list.ptr())) list = nb::steal(PySequence_List(given.ptr()));
        if (!list.is_valid()) throw nb::python_error();
        const Py_ssize_t n = PyList_GET_SIZE(list.ptr());
        if (n == 0) return;
        for (Py_ssize_t i = 0; i < n; ++i) {
            PyObject* b = PyList_GET_ITEM(list.ptr(), i);
            nb::object id = nb::steal(PyObject_GetAttr(b, block_id.ptr()));
            if (!id.is_valid() || PyDict_SetItem(evictable.ptr(), id.ptr(), b) != 0) throw nb::python_error();
            ++num_free_blocks;  // counted block by block: a failure leaves the count matching the dict
        }
        note_if_idle();
    }

    void append(nb::handle block) {
        nb::object one = nb::steal(PyList_New(1));
        if (!one.is_valid()) throw nb::python_error();
        Py_INCREF(block.ptr());
        PyList_SET_ITEM(one.ptr(), 0, block.ptr());
        append_n(one);
    }

    // Nothing in use any more: an offline engine may never call again, so it
    // must not leave "waiting" behind in the ledger.
    void note_if_idle() {
        if (num_free_blocks == total && reported_waiting != 0) report_waiting(0);
    }

    // get_new_blocks: within the last count (or vLLM's own count while not
    // lending), vLLM's own method runs with its check reading the virtual
    // count; anything else takes the plugin's slow path (checked_get_new).
    nb::object get_new_blocks(nb::handle num_blocks) {
        int overflow = 0;
        long long n = 0;
        if (PyLong_CheckExact(num_blocks.ptr())) n = PyLong_AsLongLongAndOverflow(num_blocks.ptr(), &overflow);
        if (!PyLong_CheckExact(num_blocks.ptr()) || overflow != 0 ||
            (n > promised && (lending || n > num_free_blocks)))
            return checked_get_new(pool, num_blocks);
        if (n <= 0) return nb::steal(PyList_New(0));
        const bool before = virtual_count;
        virtual_count = true;
        nb::object r;
        try {
            r = vllm_get_new(pool, num_blocks);
        } catch (...) {
            virtual_count = before;
            throw;
        }
        virtual_count = before;
        return r;
    }
};

int queue_traverse(PyObject* self, visitproc visit, void* arg) {
    if (!nb::inst_ready(self)) return 0;
    auto* q = nb::inst_ptr<VllmFreeQueue>(self);
    for (nb::handle h : {nb::handle(q->space_obj), nb::handle(q->blocks), nb::handle(q->evictable),
                         nb::handle(q->watchers), nb::handle(q->pool), nb::handle(q->checked_get_new),
                         nb::handle(q->vllm_get_new), nb::handle(q->free_refused), nb::handle(q->take_short),
                         nb::handle(q->report_waiting), nb::handle(q->keep_readable)})
        Py_VISIT(h.ptr());
    Py_VISIT(Py_TYPE(self));
    return 0;
}

int queue_clear(PyObject* self) {
    if (!nb::inst_ready(self)) return 0;
    auto* q = nb::inst_ptr<VllmFreeQueue>(self);
    // The Space pointer stays valid while space_obj lives; cleared together,
    // and the queue is unusable after (only the collector clears it).
    q->pool.reset();
    q->checked_get_new.reset();
    q->vllm_get_new.reset();
    q->free_refused.reset();
    q->take_short.reset();
    q->report_waiting.reset();
    q->keep_readable.reset();
    q->watchers.reset();
    q->evictable.reset();
    q->blocks.reset();
    return 0;
}

PyType_Slot queue_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(queue_traverse)},
                             {Py_tp_clear, reinterpret_cast<void*>(queue_clear)},
                             {0, nullptr}};

}  // namespace

void kvpool::bind::bind_vllm(nb::module_& m) {
    nb::class_<VllmFreeQueue>(m, "VllmFreeQueue",
                              "The native half of the vLLM plugin's free block queue and its pool's hot path "
                              "(adapters/vllm/block_pool.py).",
                              nb::type_slots(queue_slots))
        .def(
            "__init__",
            [](VllmFreeQueue* t, nb::handle space, nb::list blocks, nb::dict evictable, nb::dict watchers,
               nb::object pool, nb::object checked_get_new, nb::object vllm_get_new, nb::object free_refused,
               nb::object take_short, nb::object report_waiting, nb::object keep_readable, nb::str id_attr,
               int64_t total) {
                Space* s = nb::cast<Space*>(space);
                if (static_cast<int64_t>(PyList_GET_SIZE(blocks.ptr())) < s->config().num_blocks)
                    throw nb::value_error("VllmFreeQueue: blocks must have an entry for every block of the space");
                const std::pair<const char*, nb::handle> callbacks[] = {
                    {"checked_get_new", checked_get_new}, {"vllm_get_new", vllm_get_new},
                    {"free_refused", free_refused},       {"take_short", take_short},
                    {"report_waiting", report_waiting},   {"keep_readable", keep_readable}};
                for (const auto& [name, fn] : callbacks)
                    if (!PyCallable_Check(fn.ptr()))
                        throw nb::type_error((std::string("VllmFreeQueue: ") + name + " must be callable, got " +
                                              nb::type_name(fn.type()).c_str()).c_str());
                new (t) VllmFreeQueue{};
                t->space_obj = nb::borrow(space);
                t->space = s;
                t->blocks = std::move(blocks);
                t->evictable = std::move(evictable);
                t->watchers = std::move(watchers);
                t->pool = std::move(pool);
                t->checked_get_new = std::move(checked_get_new);
                t->vllm_get_new = std::move(vllm_get_new);
                t->free_refused = std::move(free_refused);
                t->take_short = std::move(take_short);
                t->report_waiting = std::move(report_waiting);
                t->keep_readable = std::move(keep_readable);
                t->block_id = std::move(id_attr);
                t->total = total;
                t->num_free_blocks = total;
            },
            "space"_a, "blocks"_a, "evictable"_a, "watchers"_a, "pool"_a, "checked_get_new"_a, "vllm_get_new"_a,
            "free_refused"_a, "take_short"_a, "report_waiting"_a, "keep_readable"_a, "id_attr"_a, "total"_a,
            nb::sig("def __init__(self, space: Space, blocks: list[typing.Any], evictable: dict[int, typing.Any], "
                    "watchers: dict[int, typing.Any], pool: typing.Any, "
                    "checked_get_new: typing.Callable[[typing.Any, int], list[typing.Any]], "
                    "vllm_get_new: typing.Callable[[typing.Any, int], list[typing.Any]], "
                    "free_refused: typing.Callable[[Failure], typing.NoReturn], "
                    "take_short: typing.Callable[[int, bool, list[typing.Any] | Failure], list[typing.Any]], "
                    "report_waiting: typing.Callable[[int], None], "
                    "keep_readable: typing.Callable[[list[typing.Any]], list[typing.Any]], id_attr: str, "
                    "total: int) -> None"))
        .def("popleft_n", &VllmFreeQueue::popleft_n, "n"_a, nb::sig("def popleft_n(self, n: int) -> list[typing.Any]"),
             "vLLM's get_new_blocks(n): the space's ids answered as vLLM's block objects.")
        .def("popleft", &VllmFreeQueue::popleft, nb::sig("def popleft(self) -> typing.Any"), "popleft_n(1)[0].")
        .def("prepend_n", &VllmFreeQueue::prepend_n, "blocks"_a,
             nb::sig("def prepend_n(self, blocks: list[typing.Any]) -> None"),
             "Blocks at ref 0 with no cache hash: back to the space in one native call.")
        .def("append_n", &VllmFreeQueue::append_n, "blocks"_a,
             nb::sig("def append_n(self, blocks: list[typing.Any]) -> None"),
             "Cached (or unpinned) blocks at ref 0: held as evictable, most recent last.")
        .def("append", &VllmFreeQueue::append, "block"_a, nb::sig("def append(self, block: typing.Any) -> None"),
             "append_n([block]).")
        .def("get_num_free_blocks", &VllmFreeQueue::count_free,
             "The plugin's free count (bound on its BlockPool instance).")
        .def("get_new_blocks", &VllmFreeQueue::get_new_blocks, "num_blocks"_a,
             nb::sig("def get_new_blocks(self, num_blocks: int) -> list[typing.Any]"),
             "The plugin's get_new_blocks (bound on its BlockPool instance).")
        .def("note_if_idle", &VllmFreeQueue::note_if_idle,
             "With every block free, tell the pool this engine waits for nothing.")
        .def_rw("num_free_blocks", &VllmFreeQueue::num_free_blocks, "vLLM's own free count (virtual).")
        .def_rw("promised", &VllmFreeQueue::promised, "Blocks the last free count told vLLM it could have.")
        .def_rw("lending", &VllmFreeQueue::lending, "The budget's lending verdict as the plugin last read it.")
        .def_rw("virtual_count", &VllmFreeQueue::virtual_count,
                "The free count answers vLLM's virtual figure (inside vLLM's own checks).")
        .def_rw("lend_refusals", &VllmFreeQueue::lend_refusals, "Free counts answered 0 in this lending episode.")
        .def_rw("reported_waiting", &VllmFreeQueue::reported_waiting, "What the pool's ledger was last told.")
        .def_ro("total", &VllmFreeQueue::total, "Every block but vLLM's null block.")
        .def_prop_ro("evictable", [](VllmFreeQueue& q) { return q.evictable; },
                     nb::sig("def evictable(self) -> dict[int, typing.Any]"),
                     "Held blocks with ref_cnt 0, oldest first (dict order = LRU).");
}
