// The RankMemory binding (mirror.hpp): a rank's side of a mirrored space.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <memory>

#include "bindings.hpp"
#include "mirror.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using kvpool::RankMemory;
using kvpool::RankStats;
using kvpool::Status;

void kvpool::bind::bind_mirror(nb::module_& m) {
    m.attr("MAX_RANKS") = kvpool::kMaxRanks;
    nb::class_<RankStats>(m, "RankStats", "One rank of a mirrored space, as its own process sees it.")
        .def_ro("rank", &RankStats::rank)
        .def_ro("first_region", &RankStats::first_region)
        .def_ro("num_regions", &RankStats::num_regions)
        .def_ro("region_bytes", &RankStats::region_bytes)
        .def_ro("page_bytes", &RankStats::page_bytes)
        .def_ro("num_pages", &RankStats::num_pages)
        .def_ro("committed_pages", &RankStats::committed_pages)
        .def_ro("allocated_bytes", &RankStats::allocated_bytes)
        .def_ro("commits", &RankStats::commits)
        .def_ro("releases", &RankStats::releases)
        .def_ro("failures", &RankStats::failures)
        .def_ro("generation", &RankStats::generation)
        .def_ro("device", &RankStats::device)
        .def_ro("last_error", &RankStats::last_error);

    nb::class_<RankMemory>(m, "RankMemory")
        .def(
            "memory",
            [](RankMemory& r) {
                if (r.closed() || !r.base()) throw nb::value_error("rank memory closed");
                return nb::ndarray<uint8_t, nb::ndim<1>>(r.base(), {static_cast<size_t>(r.bytes())}, nb::handle(), {},
                                                         nb::dtype<uint8_t>(), r.device_type(), r.device_id());
            },
            nb::rv_policy::reference_internal, "This rank's regions, back to back, as a DLPack-capable byte array.")
        .def("stats", &RankMemory::stats, nb::call_guard<nb::gil_scoped_release>())
        .def("sync", &RankMemory::sync, "timeout_s"_a, nb::call_guard<nb::gil_scoped_release>(),
             "Wait until this rank matches the leader's map; False on timeout.")
        .def_prop_ro("closed", &RankMemory::closed)
        .def("close", &RankMemory::close, nb::call_guard<nb::gil_scoped_release>());

    m.def(
        "attach_rank",
        [](int pid, int fd, uint64_t nonce, int rank, const std::string& device) {
            Status st;
            std::unique_ptr<RankMemory> rm;
            {
                nb::gil_scoped_release nogil;
                rm = RankMemory::attach(pid, fd, nonce, rank, device, &st);
            }
            kvpool::bind::Opened out{kvpool::bind::Outcome(std::move(st))};
            out.value = rm ? nb::cast(std::move(rm)) : nb::none();
            return out;
        },
        "pid"_a, "fd"_a, "nonce"_a, "rank"_a, "device"_a,
        "Attach to a mirrored space's channel as `rank`: its value a RankMemory, or None.");
}
