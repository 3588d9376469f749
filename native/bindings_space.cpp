// The Space class and create_space: a space's methods by concept (alloc and
// free in every form, what a tenant sets, what it reports, its memory and
// lifecycle). The ids' conversions they call are bindings_ids.cpp's. Every
// call that can wait (on the space mutex or a syscall) releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>

// numpy's C API table is defined in bindings.cpp (_import_array there).
#define PY_ARRAY_UNIQUE_SYMBOL kvpool_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

#include "backend.hpp"
#include "bindings.hpp"
#include "budget.hpp"
#include "geometry.hpp"
#include "ledger.hpp"
#include "mirror.hpp"
#include "space.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using kvpool::Code;
using kvpool::Ledger;
using kvpool::Space;
using kvpool::Status;
using kvpool::bind::IdArray;
using kvpool::bind::new_id_array;
using kvpool::bind::Failure;
using kvpool::bind::Outcome;
using kvpool::bind::SettingOutcome;
using kvpool::bind::alloc_ids;
using kvpool::bind::free_ids;
using kvpool::bind::id_buffer;

namespace {

using IdInput = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

}  // namespace

using kvpool::bind::acquire;
using kvpool::bind::alloc_items;
using kvpool::bind::available_now;
using kvpool::bind::free_items;

namespace {

// Space: alloc and free in every form (the faces and the plugins call these), available.
void bind_space_alloc(nb::class_<Space>& cls) {
    cls
        .def("alloc", [](Space& s, int64_t n) { return alloc_ids(s, n, false); }, "n"_a,
             nb::sig("def alloc(self, n: int) -> numpy.typing.NDArray[numpy.int64] | Failure"),
             "All-or-nothing: n block ids (int64 array), or a Failure (nothing changed).")
        .def("alloc_items", &alloc_items, "n"_a, "items"_a, "promised"_a = false,
             nb::sig("def alloc_items(self, n: int, items: list[typing.Any], promised: bool = False) -> list[typing.Any] | Failure"),
             "alloc (alloc_promised if promised) answered as [items[id] for each id]; items: a list with an "
             "entry per block.")
        .def("acquire", &acquire, "n"_a, "items"_a = nb::none(), "promised"_a = false, "stall"_a = 30.0,
             "timeout"_a = std::numeric_limits<double>::infinity(),
             nb::sig("def acquire(self, n: int, items: list[typing.Any] | None = None, promised: bool = False, "
                     "stall: float = 30.0, timeout: float = float('inf')) -> "
                     "numpy.typing.NDArray[numpy.int64] | list[typing.Any] | Failure"),
             "alloc, waiting (GIL released) while the pool makes progress: a Failure only for a request never "
             "grantable, a closed space, or a pool stalled for `stall` s (or after `timeout` s).")
        .def("free_items", [](Space& s, nb::handle items, nb::handle attr) { return free_items(s, items, attr, true); },
             "items"_a, "attr"_a,
            nb::sig("def free_items(self, items: list[typing.Any], attr: str) -> int | Failure"),
            "free of [getattr(item, attr) for item in items] (the ids read natively); as free.")
        .def("alloc_promised", [](Space& s, int64_t n) { return alloc_ids(s, n, true); }, "n"_a,
             nb::sig("def alloc_promised(self, n: int) -> numpy.typing.NDArray[numpy.int64] | Failure"),
             "alloc granted as an earlier available() said, even if this tenant lends now (its limit and the\n"
             "pool's free bytes still apply).")
        .def(
            "free",
            [](Space& s, nb::handle ids) -> nb::object {
                int64_t n = 0;
                thread_local std::vector<int64_t> scratch;
                const int64_t* data = id_buffer(ids, &n, scratch);
                return free_ids(s, data, n);
            },
            "ids"_a, nb::sig("def free(self, ids: numpy.typing.NDArray[numpy.int64] | list[int]) -> int | Failure"),
            "Validates the whole batch first: blocks available after it, or a Failure naming the bad ids "
            "(nothing freed). TypeError unless ids is a 1-D C-contiguous int64 numpy array or a list of ints.")
        .def(
            "available", &available_now,
            "Blocks a following alloc can deliver (waits for the space's mutex only without the GIL).");
}

// Space: what a tenant sets and publishes (trim, limit, guarantee, headroom, reserve, freeing, preempted frees).
void bind_space_settings(nb::class_<Space>& cls) {
    cls
        .def(
            "trim",
            [](Space& s) {
                int64_t released = 0;
                Status st;
                {
                    nb::gil_scoped_release nogil;
                    st = s.trim(&released);
                }
                kvpool::bind::Trimmed out{Outcome(std::move(st))};
                out.released = released;
                return out;
            },
            "Release every idle committed page: how many it released.")
        .def(
            "set_limit",
            [](Space& s, int64_t bytes, int64_t revision) {
                kvpool::LimitResult r = kvpool::LimitResult::Applied;
                Status st;
                {
                    nb::gil_scoped_release nogil;
                    st = s.set_limit(bytes, revision, &r);
                }
                SettingOutcome out{Outcome(std::move(st))};
                out.result = r;
                return out;
            },
            "limit_bytes"_a, "revision"_a,
            "Set and apply this tenant's one limit (-1: none); in a pool under `revision` (-1: next).")
        .def(
            "set_reserve",
            [](Space& s, int64_t lo, int64_t hi) {
                Status st;
                {
                    nb::gil_scoped_release nogil;
                    st = s.set_reserve(lo, hi);
                }
                return Outcome(std::move(st));
            },
            "min_pages"_a, "max_pages"_a)
        .def(
            "page_occupancy",
            [](Space& s, IdInput pages) {
                const size_t n = pages.shape(0);
                int64_t *used, *state;
                IdArray u = new_id_array(n, &used);
                IdArray t = new_id_array(n, &state);
                Status st;
                {
                    nb::gil_scoped_release nogil;
                    st = s.page_occupancy(pages.data(), static_cast<int64_t>(n), used, state);
                }
                kvpool::bind::PageOccupancy out{Outcome(std::move(st))};
                out.used = std::move(u);
                out.states = std::move(t);
                return out;
            },
            "pages"_a, "The used blocks and state of each page in `pages`.");
}

// Space: what it reports (stats, budget, page occupancy).
void bind_space_figures(nb::class_<Space>& cls) {
    cls
        .def("stats", &Space::stats, nb::call_guard<nb::gil_scoped_release>())
        .def("budget", &Space::budget, nb::call_guard<nb::gil_scoped_release>(),
             "The tenant's budget figures (refreshed from the pool).")
        .def("max_blocks", &Space::max_blocks, nb::call_guard<nb::gil_scoped_release>(),
             "The most blocks this tenant can ever hold (admission bound).")
        .def(
            "set_guarantee",
            [](Space& s, int64_t bytes, int64_t revision) {
                kvpool::LimitResult r = kvpool::LimitResult::Applied;
                Status st;
                {
                    nb::gil_scoped_release nogil;
                    st = s.set_guarantee(bytes, revision, &r);
                }
                SettingOutcome out{Outcome(std::move(st))};
                out.result = r;
                return out;
            },
            "guarantee_bytes"_a, "revision"_a,
            "Set this tenant's guarantee (-1: the default share) under `revision` (-1: next).")
        .def(
            "set_headroom",
            [](Space& s, int64_t bytes) {
                Status st;
                {
                    nb::gil_scoped_release nogil;
                    st = s.set_headroom(bytes);
                }
                return Outcome(std::move(st));
            },
            "headroom_bytes"_a,
            "Bytes of this tenant's unused guarantee borrowers must leave free.")
        .def(
            "publish_freeing",
            [](Space& s, int64_t bytes) {
                Status st;
                {
                    nb::gil_scoped_release nogil;
                    st = s.publish_freeing(bytes);
                }
                return Outcome(std::move(st));
            },
            "freeing_bytes"_a,
            "Bytes this tenant's running requests free within the reclaim bound (budget.hpp, rule 6).")
        .def(
            "set_preempts",
            [](Space& s, bool preempts) {
                Status st;
                {
                    nb::gil_scoped_release nogil;
                    st = s.set_preempts(preempts);
                }
                return Outcome(std::move(st));
            },
            "preempts"_a,
            "Whether this tenant's engine acts on the preempt verdict (false: by completion only; budget.hpp, rule 6).")
        .def(
            "free_preempted",
            [](Space& s, IdInput ids, int64_t requests, int64_t tokens) -> nb::object {
                if (requests < 1 || tokens < 0)
                    return nb::cast(Failure{static_cast<int>(Code::Invalid),
                                            "free_preempted: requests must be >= 1 and tokens >= 0, got " +
                                                std::to_string(requests) + " and " + std::to_string(tokens),
                                            0, 0, {}});
                std::vector<int64_t> bad;
                Status st;
                {
                    // Blocking path: the core validates and frees its own copy of the ids.
                    nb::gil_scoped_release nogil;
                    st = s.free(ids.data(), static_cast<int64_t>(ids.shape(0)), &bad, nullptr, nullptr, false,
                                nullptr, requests, tokens);
                }
                if (st.is_ok()) return nb::none();
                return nb::cast(Failure{static_cast<int>(st.code), std::move(st.message), 0, 0, std::move(bad)});
            },
            "ids"_a, "requests"_a, "tokens"_a,
            "Free the blocks of `requests` preempted requests with `tokens` to recompute, counted as "
            "reclaimed by preemption (budget.hpp, rule 6): None, or a Failure (nothing freed).")
        .def(
            "free_evicted",
            [](Space& s, IdInput ids) -> nb::object {
                std::vector<int64_t> bad;
                Status st;
                {
                    // Blocking path: the core validates and frees its own copy of the ids.
                    nb::gil_scoped_release nogil;
                    st = s.free(ids.data(), static_cast<int64_t>(ids.shape(0)), &bad, nullptr, nullptr, false,
                                nullptr, 0, 0, true);
                }
                if (st.is_ok()) return nb::none();
                return nb::cast(Failure{static_cast<int>(st.code), std::move(st.message), 0, 0, std::move(bad)});
            },
            "ids"_a,
            "Free cached blocks the engine drops (a prefix cache's), counted while lending as reclaimed by "
            "eviction (budget.hpp, rule 6): None, or a Failure (nothing freed).");
}

// Space: its memory (regions, fds) and lifecycle (settle, close).
void bind_space_memory(nb::class_<Space>& cls) {
    cls
        .def_prop_ro("inherited", &Space::inherited, "Inherited across fork(): inert in this process.")
        .def("settle", &Space::settle, "timeout_s"_a, nb::call_guard<nb::gil_scoped_release>(),
             "Wait until the reserve thread is idle; False on timeout.")
        .def(
            "inject_fault",
            [](Space& s, int kind, int64_t nth, int err) {
                s.inject_fault(static_cast<kvpool::FaultKind>(kind), nth, err);
            },
            "kind"_a, "nth"_a, "errno"_a, nb::call_guard<nb::gil_scoped_release>(),
            "Test-only: fail the nth next commit (0) or release (1).")
        .def("allocated_bytes", &Space::allocated_bytes, nb::call_guard<nb::gil_scoped_release>(),
             "Bytes the backend really holds (memfd st_blocks on CPU).")
        .def(
            "region",
            [](Space& s, int64_t r) {
                const auto& cfg = s.config();
                if (r < 0 || r >= cfg.num_regions) throw nb::index_error("region out of range");
                if (!s.region_base(r)) throw nb::value_error("this space holds no memory itself (mirrored: its ranks do)");
                const size_t n = static_cast<size_t>(s.num_pages() * cfg.page_bytes);
                // reference_internal: the array keeps the Space object alive.
                return nb::ndarray<uint8_t, nb::ndim<1>>(s.region_base(r), {n}, nb::handle(), {},
                                                         nb::dtype<uint8_t>(), s.device_type(), s.device_id());
            },
            "region"_a, nb::rv_policy::reference_internal, "Region memory as a DLPack-capable byte array.")
        .def(
            "memory",
            [](Space& s) {
                // Regions are laid out back to back (both backends): one array
                // over all of them, for engines that address one flat buffer.
                const auto& cfg = s.config();
                if (!s.region_base(0)) throw nb::value_error("this space holds no memory itself (mirrored: its ranks do)");
                const size_t n = static_cast<size_t>(cfg.num_regions * s.num_pages() * cfg.page_bytes);
                return nb::ndarray<uint8_t, nb::ndim<1>>(s.region_base(0), {n}, nb::handle(), {},
                                                         nb::dtype<uint8_t>(), s.device_type(), s.device_id());
            },
            nb::rv_policy::reference_internal, "All regions, back to back, as one DLPack-capable byte array.")
        .def_prop_ro("share_fd", &Space::share_fd, "The memfd another process can map (-1: none).")
        .def_prop_ro("mirror_fd", &Space::mirror_fd, "A mirrored space's channel the ranks attach to (-1: none).")
        .def_prop_ro("mirror_nonce", &Space::mirror_nonce, "The channel's random identity (0: none).")
        .def("report_waiting", &Space::report_waiting, "waiting"_a, nb::call_guard<nb::gil_scoped_release>())
        .def_prop_ro("eventfd", &Space::eventfd)
        .def_prop_ro("last_alloc_commits", &Space::last_alloc_commits,
                     "Pages the last alloc committed inline (for debug traces).")
        .def_prop_ro("last_free_releases", &Space::last_free_releases,
                     "Pages the last free released inline (for debug traces).")
        .def_prop_ro("closed", &Space::closed)
        .def("close", &Space::close, nb::call_guard<nb::gil_scoped_release>());
}

// create_space: a Space from checked arguments, registered in its pool if it has one.
void bind_create_space(nb::module_& m) {
    m.def(
        "create_space",
        [](int64_t num_regions, int64_t page_bytes, int64_t block_bytes, int64_t num_blocks, bool null_block,
           int64_t reserve_min, int64_t reserve_max, bool reserve_thread, double idle_release_s, int64_t limit_bytes,
           int64_t guarantee_bytes, int64_t headroom_bytes, const std::string& device,
           std::shared_ptr<Ledger> ledger, const std::string& tenant, const std::vector<int64_t>& rank_regions,
           double rank_timeout_s) {
            kvpool::bind::ensure_numpy();
            Status st;
            std::unique_ptr<Space> space;
            {
                nb::gil_scoped_release nogil;
                kvpool::SpaceConfig cfg;
                cfg.num_regions = num_regions;
                cfg.page_bytes = page_bytes;
                cfg.block_bytes = block_bytes;
                cfg.num_blocks = num_blocks;
                cfg.null_block = null_block;
                cfg.reserve_min = reserve_min;
                cfg.reserve_max = reserve_max;
                cfg.reserve_thread = reserve_thread;
                cfg.idle_release_s = idle_release_s;
                cfg.headroom_bytes = headroom_bytes;
                // One limit per tenant: in a pool it lives in the ledger
                // (revision 0), where `kvpool top` shows it; without one, in
                // the private budget.
                cfg.limit_bytes = ledger ? -1 : limit_bytes;
                kvpool::BackendConfig bc{num_regions, kvpool::num_pages_for(page_bytes, block_bytes, num_blocks) * page_bytes,
                                         page_bytes};
                std::unique_ptr<kvpool::Backend> backend;
                if (!rank_regions.empty()) {
                    // Mirrored (mirror.hpp): the ranks' processes hold the memory.
                    kvpool::MirrorConfig mc;
                    mc.region_bytes = bc.region_bytes;
                    mc.page_bytes = page_bytes;
                    mc.rank_regions = rank_regions;
                    mc.device_type = device == "cpu" ? 1 : 2;
                    mc.timeout_s = rank_timeout_s;
                    int64_t total = 0;
                    for (int64_t r : rank_regions) total += r > 0 ? r : 0;
                    if (total != num_regions)
                        st = Status::make(Code::Invalid, "rank_regions add up to " + std::to_string(total) +
                                                             " regions, the space has " + std::to_string(num_regions));
                    else if (device != "cpu" && device.rfind("cuda", 0) != 0)
                        st = Status::make(Code::Invalid, "unknown device '" + device + "'");
                    else
                        backend = kvpool::make_mirror_backend(mc, &st);
                } else if (device == "cpu") {
                    backend = kvpool::make_cpu_backend(bc, &st);
                } else if (device.rfind("cuda:", 0) == 0) {
                    backend = kvpool::make_cuda_backend(bc, std::atoi(device.c_str() + 5), &st);
                } else {
                    st = Status::make(Code::Invalid, "unknown device '" + device + "'");
                }
                int slot = -1;
                if (backend && ledger) {
                    st = ledger->register_tenant(tenant, limit_bytes, guarantee_bytes, &slot);
                    // The pool refused the tenant (a name taken, no slot):
                    // a LedgerError; a guarantee that cannot fit stays
                    // Invalid (a ValueError, as Pool.set_guarantee raises).
                    if (!st.is_ok() && !(st.code == Code::Invalid && st.message.rfind("guarantee_bytes=", 0) == 0))
                        st.code = Code::Ledger;
                }
                // Space::create owns the slot from here: on failure it has
                // unregistered it already. Never unregister it again here:
                // with the GIL released another thread may hold it by now.
                if (backend && st.is_ok()) space = Space::create(cfg, std::move(backend), ledger, slot, &st);
            }
            kvpool::bind::Opened out{kvpool::bind::Outcome(std::move(st))};
            out.value = space ? nb::cast(std::move(space)) : nb::none();
            return out;
        },
        "num_regions"_a, "page_bytes"_a, "block_bytes"_a, "num_blocks"_a, "null_block"_a, "reserve_min"_a,
        "reserve_max"_a, "reserve_thread"_a, "idle_release_s"_a, "limit_bytes"_a, "guarantee_bytes"_a,
        "headroom_bytes"_a, "device"_a, "ledger"_a.none(), "tenant"_a, "rank_regions"_a = std::vector<int64_t>{},
        "rank_timeout_s"_a = 5.0,
        "Create a KV space, as a tenant of `ledger` if given: (code, message, Space | None). With rank_regions, "
        "a mirrored space whose ranks' processes hold the memory (RankMemory).");
}

}  // namespace

void kvpool::bind::bind_space(nb::module_& m) {
    nb::class_<Failure>(m, "Failure", "A failed alloc or free: nothing changed.")
        .def_ro("code", &Failure::code)
        .def_ro("message", &Failure::message)
        .def_ro("available", &Failure::available)
        .def_ro("max_blocks", &Failure::max_blocks)
        .def_ro("bad_ids", &Failure::bad_ids);

    nb::class_<Space> cls(m, "Space");
    bind_space_alloc(cls);
    bind_space_settings(cls);
    bind_space_figures(cls);
    bind_space_memory(cls);
    bind_create_space(m);
}
