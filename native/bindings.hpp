// What the binding files share: the module's id arrays, the colder calls'
// result types (Outcome and its kinds) and each file's entry point.
// bindings.cpp defines the module (figures, ledger, results, helpers);
// bindings_space.cpp binds a Space and create_space; bindings_ids.cpp converts the ids of its hot path.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ledger.hpp"
#include "status.hpp"

namespace kvpool {
class Space;
}

namespace kvpool::bind {

using IdArray = nanobind::ndarray<nanobind::numpy, int64_t, nanobind::ndim<1>>;

// Loads numpy's C API once (bindings.cpp); called before the first space.
void ensure_numpy();

// A fresh int64 numpy array whose buffer the array itself owns.
inline IdArray new_id_array(size_t n, int64_t** data) {
    int64_t* buf = new int64_t[n > 0 ? n : 1];
    nanobind::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<int64_t*>(p); });
    *data = buf;
    return IdArray(buf, {n}, owner);
}

// A failed alloc or free, as Python sees it (kvpool/_core.raise_failure).
struct Failure {
    int code = 0;
    std::string message;
    int64_t available = 0;   // blocks available after the failed call
    int64_t max_blocks = 0;  // an Unsatisfiable alloc: the most this tenant can ever hold
    std::vector<int64_t> bad_ids;  // a refused free: the offending ids
};

// What a colder call answers (bindings.cpp binds them): its status, and on
// a subclass the call's own named values, each read by name in Python
// (kvpool/_core.raise_status turns a code into the kvpool.errors hierarchy).
struct Outcome {
    int code = 0;
    std::string message;
    Outcome() = default;
    explicit Outcome(Status st) : code(static_cast<int>(st.code)), message(std::move(st.message)) {}
};
// Space.trim: the idle pages it released.
struct Trimmed : Outcome {
    int64_t released = 0;
};
// A revisioned setting (a limit or a guarantee): how the budget took it.
struct SettingOutcome : Outcome {
    LimitResult result = LimitResult::Applied;
};
// cuda_mem_info: cuMemGetInfo's figures.
struct DeviceMemory : Outcome {
    int64_t free_bytes = 0;
    int64_t total_bytes = 0;
};
// Space.page_occupancy: per asked page, its used blocks and state.
struct PageOccupancy : Outcome {
    IdArray used;
    IdArray states;
};
// open_ledger, attach_rank: what was opened (a Ledger, a RankMemory), None
// on failure.
struct Opened : Outcome {
    nanobind::object value;
};
// page_ranges: the blocks [first[p], last[p]) of each page p.
struct PageRanges {
    IdArray first;
    IdArray last;
};

// The hot path as every face runs it (bindings_ids.cpp). alloc_ids: n ids
// (an int64 numpy array) or a Failure; free_ids: the blocks available after
// it (an int; None unless want_available: a pooled tenant's figure scans the
// ledger, and the hot faces do not read it) or a Failure; id_buffer: the ids
// of a free (a canonical int64 array read in place, or a list of ints copied
// into scratch), TypeError for anything else.
nanobind::object alloc_ids(Space& s, int64_t n, bool promised);
nanobind::object free_ids(Space& s, const int64_t* data, int64_t n, bool want_available = true);
const int64_t* id_buffer(nanobind::handle ids, int64_t* n, std::vector<int64_t>& scratch);
// The vLLM plugin's forms: alloc_items answers [items[id] for each id] (a
// list) or a Failure; free_items frees [getattr(item, attr) ...] (ids read
// natively) as free_ids; available_now is Space.available().
nanobind::object alloc_items(Space& s, int64_t n, nanobind::handle items, bool promised);
nanobind::object free_items(Space& s, nanobind::handle items, nanobind::handle attr, bool want_available = true);
int64_t available_now(Space& s);
// Space.acquire: n ids (or items) after waiting while the pool makes
// progress (native/acquire.cpp), or a Failure (bindings_ids.cpp).
nanobind::object acquire(Space& s, int64_t n, nanobind::handle items, bool promised, double stall, double timeout);

// What an AllocCall (bindings_await.cpp: `await manager.alloc(n)`, a native
// coroutine) asks of the manager's face that made it (bindings_hot.cpp).
struct AllocFaceOps {
    // await alloc's first try: the ids (*granted), else what the checked
    // coroutine takes first: a Failure (a shortage: it queues) or None (it
    // checks everything). Throws (nb::python_error) any other refusal.
    nanobind::object (*first_try)(void* face, nanobind::handle owner, nanobind::handle n, nanobind::handle timeout,
                                  nanobind::handle priority, bool* granted);
    // The checked coroutine: KVCacheManager._alloc_checked(owner, n, timeout, priority, first).
    nanobind::object (*checked)(void* face, nanobind::handle owner, nanobind::handle n, nanobind::handle timeout,
                                nanobind::handle priority, nanobind::handle first);
};
// A new AllocCall of `face` (whose Python object is face_obj) for its owner.
nanobind::object make_alloc_call(nanobind::handle face_obj, void* face, const AllocFaceOps* ops,
                                 nanobind::handle owner, nanobind::handle n, nanobind::handle timeout,
                                 nanobind::handle priority);

// Failure, Space and create_space (bindings_space.cpp); needs Ledger bound first.
void bind_space(nanobind::module_& m);
// RankStats, RankMemory and attach_rank (bindings_mirror.cpp).
void bind_mirror(nanobind::module_& m);
// SpaceFace and ManagerFace (bindings_hot.cpp): the native bases of KVSpace
// and KVCacheManager, their alloc / free the one implementation; needs Space bound first.
void bind_hot_path(nanobind::module_& m);
// VllmFreeQueue (bindings_vllm.cpp): the vLLM plugin's free block queue and
// block pool hot path; needs Space bound first.
void bind_vllm(nanobind::module_& m);

}  // namespace kvpool::bind
