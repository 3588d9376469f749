// The only files that know about Python (this one, which defines the module,
// bindings_space.cpp, bindings_hot.cpp and bindings_mirror.cpp). The native
// core never calls back into Python; only the hot path's faces
// (bindings_hot.cpp) call their owner's Python methods, on the caller's
// thread with the GIL held, for what is not their common case.
// The colder calls answer an Outcome (bindings.hpp): a code and a message,
// and the call's own values by name; kvpool/_core.py turns codes into the
// kvpool.errors hierarchy.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#define PY_ARRAY_UNIQUE_SYMBOL kvpool_ARRAY_API
#include <numpy/arrayobject.h>

#include "backend.hpp"
#include "bindings.hpp"
#include "geometry.hpp"
#include "budget.hpp"
#include "ledger.hpp"
#include "space.hpp"
#include "sizes.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using kvpool::Code;
using kvpool::Ledger;
using kvpool::Status;
using kvpool::bind::IdArray;
using kvpool::bind::new_id_array;
using kvpool::bind::Outcome;

namespace kvpool::bind {
// numpy's C API is loaded on the first space, not at import: the operator
// commands (`kvpool pools`, `top`, `limit`) read the ledger only, and
// importing numpy was most of their start-up (~90 ms of ~180, issue 32).
// Every path that uses the C API (PyArray_*) runs on a space or its faces,
// and every space is made by create_space, which calls this first.
void ensure_numpy() {
    if (PyArray_API == nullptr && _import_array() < 0) throw nb::python_error();
}
}  // namespace kvpool::bind

NB_MODULE(_native, m) {
    m.doc() = "kvpool native core (private: use the kvpool package)";
    // Spaces legitimately outlive interpreter shutdown (module globals);
    // their destructor releases memory, so the shutdown report is noise.
    nb::set_leak_warnings(false);

    m.attr("CODE_OK") = static_cast<int>(Code::Ok);
    m.attr("CODE_SHORTAGE") = static_cast<int>(Code::Shortage);
    m.attr("CODE_INVALID") = static_cast<int>(Code::Invalid);
    m.attr("CODE_BACKEND") = static_cast<int>(Code::Backend);
    m.attr("CODE_CLOSED") = static_cast<int>(Code::Closed);
    m.attr("CODE_LEDGER") = static_cast<int>(Code::Ledger);
    m.attr("CODE_UNSATISFIABLE") = static_cast<int>(Code::Unsatisfiable);

    nb::class_<kvpool::BudgetFigures>(m, "BudgetFigures", "A tenant's budget: limit, guarantee, claims, lending.")
        .def_ro("pooled", &kvpool::BudgetFigures::pooled)
        .def_ro("limit_bytes", &kvpool::BudgetFigures::limit_bytes)
        .def_ro("limit_revision", &kvpool::BudgetFigures::limit_revision)
        .def_ro("guarantee_bytes", &kvpool::BudgetFigures::guarantee_bytes)
        .def_ro("guarantee_setting", &kvpool::BudgetFigures::guarantee_setting)
        .def_ro("guarantee_revision", &kvpool::BudgetFigures::guarantee_revision)
        .def_ro("claimed_bytes", &kvpool::BudgetFigures::claimed_bytes)
        .def_ro("borrowed_bytes", &kvpool::BudgetFigures::borrowed_bytes)
        .def_ro("want_bytes", &kvpool::BudgetFigures::want_bytes)
        .def_ro("lending", &kvpool::BudgetFigures::lending)
        .def_ro("restoring", &kvpool::BudgetFigures::restoring)
        .def_ro("headroom_bytes", &kvpool::BudgetFigures::headroom_bytes)
        .def_ro("keep_free_bytes", &kvpool::BudgetFigures::keep_free_bytes)
        .def_ro("freeing_bytes", &kvpool::BudgetFigures::freeing_bytes)
        .def_ro("preempt_bytes", &kvpool::BudgetFigures::preempt_bytes)
        .def_ro("preempts", &kvpool::BudgetFigures::preempts)
        .def_ro("preemptions_asked", &kvpool::BudgetFigures::preemptions_asked)
        .def_ro("requests_preempted", &kvpool::BudgetFigures::requests_preempted)
        .def_ro("tokens_recomputed", &kvpool::BudgetFigures::tokens_recomputed)
        .def_ro("reclaimed_by_completion_bytes", &kvpool::BudgetFigures::reclaimed_by_completion_bytes)
        .def_ro("reclaimed_by_preemption_bytes", &kvpool::BudgetFigures::reclaimed_by_preemption_bytes)
        .def_ro("reclaimed_by_eviction_bytes", &kvpool::BudgetFigures::reclaimed_by_eviction_bytes)
        .def_ro("pool_capacity", &kvpool::BudgetFigures::pool_capacity);

    nb::class_<kvpool::SpaceStats>(m, "SpaceStats", "A consistent snapshot of one space (taken under its lock).")
        .def_ro("num_blocks", &kvpool::SpaceStats::num_blocks)
        .def_ro("capacity", &kvpool::SpaceStats::capacity)
        .def_ro("num_pages", &kvpool::SpaceStats::num_pages)
        .def_ro("used_blocks", &kvpool::SpaceStats::used_blocks)
        .def_ro("available", &kvpool::SpaceStats::available)
        .def_ro("pages_free", &kvpool::SpaceStats::pages_free)
        .def_ro("pages_committing", &kvpool::SpaceStats::pages_committing)
        .def_ro("pages_reserve", &kvpool::SpaceStats::pages_reserve)
        .def_ro("pages_active", &kvpool::SpaceStats::pages_active)
        .def_ro("pages_releasing", &kvpool::SpaceStats::pages_releasing)
        .def_ro("room_blocks", &kvpool::SpaceStats::room_blocks,
                "free blocks on active pages: what an alloc fills without committing a page")
        .def_ro("committed_bytes", &kvpool::SpaceStats::committed_bytes)
        .def_ro("page_commit_bytes", &kvpool::SpaceStats::page_commit_bytes)
        .def_ro("limit_pages", &kvpool::SpaceStats::limit_pages)
        .def_ro("limit_deferred", &kvpool::SpaceStats::limit_deferred)
        .def_ro("max_blocks", &kvpool::SpaceStats::max_blocks)
        .def_ro("allocs", &kvpool::SpaceStats::allocs)
        .def_ro("frees", &kvpool::SpaceStats::frees)
        .def_ro("shortages", &kvpool::SpaceStats::shortages)
        .def_ro("commits", &kvpool::SpaceStats::commits)
        .def_ro("releases", &kvpool::SpaceStats::releases)
        .def_ro("inline_commits", &kvpool::SpaceStats::inline_commits)
        .def_ro("inline_releases", &kvpool::SpaceStats::inline_releases)
        .def_ro("commit_failures", &kvpool::SpaceStats::commit_failures)
        .def_ro("release_failures", &kvpool::SpaceStats::release_failures)
        .def_ro("last_error", &kvpool::SpaceStats::last_error)
        .def_ro("budget", &kvpool::SpaceStats::budget)
        .def_ro("backend", &kvpool::SpaceStats::backend);

    nb::enum_<kvpool::LastExit>(m, "LastExit", "How a pool's last tenant to go went.")
        .value("NONE", kvpool::LastExit::None, "no tenant has gone yet")
        .value("LEFT", kvpool::LastExit::Left, "it left cleanly (closed its space)")
        .value("DIED", kvpool::LastExit::Died, "it died without leaving and was reaped");

    nb::class_<kvpool::TenantRow>(m, "TenantRow", "One live tenant as a ledger snapshot read it.")
        .def_ro("slot", &kvpool::TenantRow::slot)
        .def_ro("pid", &kvpool::TenantRow::pid)
        .def_ro("visible", &kvpool::TenantRow::visible)
        .def_ro("name", &kvpool::TenantRow::name)
        .def_ro("claimed", &kvpool::TenantRow::claimed)
        .def_ro("pending", &kvpool::TenantRow::pending)
        .def_ro("want", &kvpool::TenantRow::want)
        .def_ro("wait_ticket", &kvpool::TenantRow::wait_ticket)
        .def_ro("waiting", &kvpool::TenantRow::waiting)
        .def_ro("limit_state", &kvpool::TenantRow::limit_state)
        .def_ro("lending", &kvpool::TenantRow::lending)
        .def_ro("restoring", &kvpool::TenantRow::restoring)
        .def_ro("reserve_pages", &kvpool::TenantRow::reserve_pages)
        .def_ro("headroom", &kvpool::TenantRow::headroom)
        .def_ro("keep_free", &kvpool::TenantRow::keep_free)
        .def_ro("allocs", &kvpool::TenantRow::allocs)
        .def_ro("shortages", &kvpool::TenantRow::shortages)
        .def_ro("freeing", &kvpool::TenantRow::freeing)
        .def_ro("preempt_bytes", &kvpool::TenantRow::preempt_bytes)
        .def_ro("preempts", &kvpool::TenantRow::preempts)
        .def_ro("preempt_asked", &kvpool::TenantRow::preempt_asked)
        .def_ro("preempted", &kvpool::TenantRow::preempted)
        .def_ro("recomputed_tokens", &kvpool::TenantRow::recomputed_tokens)
        .def_ro("reclaimed_completion", &kvpool::TenantRow::reclaimed_completion)
        .def_ro("reclaimed_preemption", &kvpool::TenantRow::reclaimed_preemption)
        .def_ro("reclaimed_eviction", &kvpool::TenantRow::reclaimed_eviction)
        .def_ro("limit", &kvpool::TenantRow::limit)
        .def_ro("limit_revision", &kvpool::TenantRow::limit_revision)
        .def_ro("guarantee", &kvpool::TenantRow::guarantee)
        .def_ro("guarantee_revision", &kvpool::TenantRow::guarantee_revision);

    nb::class_<kvpool::LedgerSnapshot>(m, "LedgerSnapshot",
                                       "Every live tenant read in one pass; the total is the sum of these rows.")
        .def_ro("capacity", &kvpool::LedgerSnapshot::capacity)
        .def_ro("generation", &kvpool::LedgerSnapshot::generation)
        .def_ro("last_exit", &kvpool::LedgerSnapshot::last_exit)
        .def_ro("rows", &kvpool::LedgerSnapshot::rows)
        .def_prop_ro("claimed_total", &kvpool::LedgerSnapshot::claimed_total)
        .def("guarantee_of", &kvpool::LedgerSnapshot::guarantee_of, "row"_a,
             "A tenant's guarantee in force: explicit, or the equal default share.");

    nb::class_<Outcome>(m, "Outcome", "A call's status: code (a CODE_* constant; CODE_OK when it worked) and message.")
        .def_ro("code", &Outcome::code)
        .def_ro("message", &Outcome::message);
    nb::class_<kvpool::bind::Trimmed, Outcome>(m, "Trimmed", "Space.trim's outcome: the idle pages it released.")
        .def_ro("released", &kvpool::bind::Trimmed::released);
    nb::enum_<kvpool::LimitResult>(m, "LimitResult", "How a revisioned limit or guarantee was taken.")
        .value("APPLIED", kvpool::LimitResult::Applied, "set under its revision")
        .value("STALE", kvpool::LimitResult::Stale, "older than the revision in force: ignored")
        .value("CONFLICT", kvpool::LimitResult::Conflict, "the revision in force with another value: ignored")
        .value("SAME", kvpool::LimitResult::Same, "the revision and value in force already");
    nb::class_<kvpool::bind::SettingOutcome, Outcome>(m, "SettingOutcome",
                                                      "A limit's or guarantee's outcome: how it was taken.")
        .def_ro("result", &kvpool::bind::SettingOutcome::result);
    nb::class_<kvpool::bind::DeviceMemory, Outcome>(m, "DeviceMemory", "A CUDA device's free and total bytes.")
        .def_ro("free_bytes", &kvpool::bind::DeviceMemory::free_bytes)
        .def_ro("total_bytes", &kvpool::bind::DeviceMemory::total_bytes);
    // The arrays own their buffers (new_id_array's capsule), so a field hands
    // out a view of them, not a copy (reference_internal is refused for an
    // array with an owner).
    nb::class_<kvpool::bind::PageOccupancy, Outcome>(m, "PageOccupancy",
                                                     "Per asked page: its used blocks and its state.")
        .def_ro("used", &kvpool::bind::PageOccupancy::used, nb::rv_policy::reference)
        .def_ro("states", &kvpool::bind::PageOccupancy::states, nb::rv_policy::reference);
    nb::class_<kvpool::bind::Opened, Outcome>(m, "Opened", "What an open made (a Ledger, a RankMemory); None on failure.")
        .def_ro("value", &kvpool::bind::Opened::value);
    nb::class_<kvpool::bind::PageRanges>(m, "PageRanges", "Per page p of a geometry, its blocks [first[p], last[p]).")
        .def_ro("first", &kvpool::bind::PageRanges::first, nb::rv_policy::reference)
        .def_ro("last", &kvpool::bind::PageRanges::last, nb::rv_policy::reference);

    m.def("format_size", &kvpool::format_size, "bytes"_a,
          "Bytes as people read them: binary units, one decimal ('128.0 MiB', '1.0 PiB'); under 1 KiB 'N B'.");
    m.def("format_size_exact", &kvpool::format_size_exact, "bytes"_a,
          "format_size, with the exact count where that rounds: '11.8 MiB (12345678 bytes)'.");
    m.def("cpu_granularity", &kvpool::cpu_granularity, "Smallest page size step of the CPU backend.");
    m.def("cuda_unavailable_reason", &kvpool::cuda_unavailable_reason, nb::call_guard<nb::gil_scoped_release>(),
          "Why the CUDA backend cannot be used here (empty when it can).");
    m.def(
        "cuda_mem_info",
        [](int device) {
            int64_t f = 0, t = 0;
            Status st;
            {
                nb::gil_scoped_release nogil;
                st = kvpool::cuda_mem_info(device, &f, &t);
            }
            kvpool::bind::DeviceMemory r{Outcome(std::move(st))};
            r.free_bytes = f;
            r.total_bytes = t;
            return r;
        },
        "device"_a, "A CUDA device's free and total bytes (cuMemGetInfo).");

    m.def(
        "page_ranges",
        [](int64_t page_bytes, int64_t block_bytes, int64_t num_blocks) {
            const int64_t np = kvpool::num_pages_for(page_bytes, block_bytes, num_blocks);
            int64_t *first, *last;
            kvpool::bind::PageRanges ranges{new_id_array(static_cast<size_t>(np), &first),
                                            new_id_array(static_cast<size_t>(np), &last)};
            for (int64_t p = 0; p < np; ++p) {
                auto r = kvpool::page_block_range(page_bytes, block_bytes, num_blocks, p);
                first[p] = r.first;
                last[p] = r.last;
            }
            return ranges;
        },
        "page_bytes"_a, "block_bytes"_a, "num_blocks"_a,
        "Per-page block ranges [first, last) of a geometry (the one formula).");

    nb::class_<Ledger>(m, "Ledger")
        .def_prop_ro("name", &Ledger::name)
        .def_prop_ro("capacity", &Ledger::capacity)
        .def_prop_ro("generation", &Ledger::generation)
        .def("snapshot", [](const Ledger& l) { return l.snapshot(true); }, nb::call_guard<nb::gil_scoped_release>(),
             "Every live tenant in one pass (lock-free; never waits for another process).")
        .def(
            "set_setting",
            [](Ledger& l, const std::string& tenant, bool guarantee, int64_t bytes, int64_t revision) {
                kvpool::LimitResult r = kvpool::LimitResult::Stale;
                Status st;
                {
                    nb::gil_scoped_release nogil;
                    int slot = -1;
                    st = l.find_tenant(tenant, &slot);
                    if (st.is_ok())
                        st = guarantee ? l.set_guarantee(slot, bytes, revision, &r) : l.set_limit(slot, bytes, revision, &r);
                }
                kvpool::bind::SettingOutcome out{Outcome(std::move(st))};
                out.result = r;
                return out;
            },
            "tenant"_a, "guarantee"_a, "bytes"_a, "revision"_a,
            "Set a tenant's limit (guarantee=False) or guarantee; revision < 0 = next.")
        .def("reap", &Ledger::reap, nb::call_guard<nb::gil_scoped_release>(),
             "Reap dead tenants of this PID namespace; returns how many.")
        .def("inject_stop_mid_claim", &Ledger::inject_stop_mid_claim,
             "Test hook: the next claim of this process stops it (SIGSTOP) with its claim pending.");

    m.def(
        "open_ledger",
        [](const std::string& name, int64_t capacity, bool create) {
            Status st;
            std::shared_ptr<Ledger> l;
            {
                nb::gil_scoped_release nogil;
                l = Ledger::open(name, capacity, create, &st);
            }
            kvpool::bind::Opened out{Outcome(std::move(st))};
            out.value = l ? nb::cast(l) : nb::none();
            return out;
        },
        "name"_a, "capacity"_a, "create"_a, "Open (or create) a pool ledger: its value a Ledger, or None.");


    kvpool::bind::bind_space(m);
    kvpool::bind::bind_mirror(m);
    kvpool::bind::bind_hot_path(m);
    kvpool::bind::bind_vllm(m);
}
