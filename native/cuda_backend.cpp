// CUDA backend: the driver's virtual-memory API, loaded at run time
// (cuda_driver.hpp: the entry points, context helpers, the offset probe and
// the shared zero granule). Compiled from cuda.h only (KVPOOL_HAVE_CUDA_H).
// $KVPOOL_LIBCUDA overrides the library path (the tests load
// tests/fake_cuda/fake_libcuda.c, which enforces the rules below the way the
// real driver does).
//
//   VA (one reservation):  [ region 0 | region 1 | ... ]   region = num_pages x P
//   slice (r, p):          page p of region r, P bytes: either its page's
//                          memory (read-write), or at each of its granules the
//                          device's one zero granule (read-only), or -- only
//                          after a failed driver call -- nothing at some
//                          granules (repaired on the next commit or close)
//   commit page p:         one cuMemCreate of P per region, each mapped at
//                          offset 0 -- or, where the start-up probe proved
//                          offsets work, one allocation of R x P mapped in R
//                          slices at offsets r x P
//
// The driver's rules, and why each is followed here (issue 15):
//  - cuMemMap's offset "currently must be zero" (cuda.h's parameter note;
//    its prose says otherwise). Every working VMM user (vLLM's cumem
//    allocator, PyTorch's expandable segments, kvcached) maps at offset 0, so
//    that is the default; a probe (one two-granule allocation mapped at two
//    VAs with offsets 0 and one granule, distinct bytes written through each
//    and read back) may prove offsets safe per device, which saves R-1
//    cuMemCreate calls per commit. describe() names the choice.
//  - The driver works on the calling thread's current context. The reserve
//    thread, the pool watcher, close() from another thread and GIL-released
//    Python threads all call in here, so every entry point pushes this
//    space's (primary) context and pops it on the way out: the caller's own
//    current context is untouched. The retained primary context is released
//    when the backend is destroyed.
//  - cuMemMap only maps unmapped VA and cuMemUnmap cannot unmap a sub-range
//    or a range with holes: the slice table above is the truth about what is
//    mapped where, so every unmap covers exactly one whole mapping and no map
//    lands on mapped VA, whatever failed before.
//  - Memory kernels may still read must not be unmapped: release() and
//    close() synchronize the context first (a fence; PyTorch synchronizes
//    before cuMemUnmap for the same reason). Without it the symptom is error
//    700, which kills the process's CUDA context.
//  - Fresh cuMemCreate memory is not promised to be zero, so the zero
//    granule (one per device, shared by every space of the process) is
//    zero-filled when created, and every committed page is zero-filled (on a
//    private stream, waited for) before it is handed out: padding reads zeros
//    and KV data never crosses tenants (ARCHITECTURE.md invariant 6).
//  - cuMemSetAccess takes any fully mapped range: open() maps the zero
//    granule everywhere and sets access once over the whole reservation.
//
// Every driver error is a value: out of memory anywhere in a commit
// (cuMemCreate, cuMemMap, cuMemSetAccess) is a shortage, anything else a
// Backend status carrying the driver's own message. Failures after a
// release's point of no return (cuMemRelease, re-mapping the zero page) do not
// undo the release: the memory is counted in allocated_bytes() until close()
// frees it, a granule left unmapped is mapped on reuse, and last_error()
// says what happened.
#include "backend.hpp"
#include "cuda_driver.hpp"

#ifdef KVPOOL_HAVE_CUDA_H
#include <atomic>
#include <mutex>
#include <string>
#include <vector>

namespace kvpool {
namespace {

using cuda_detail::acquire_zero_page;
using cuda_detail::CtxScope;
using cuda_detail::device_prop;
using cuda_detail::Driver;
using cuda_detail::driver;
using cuda_detail::is_oom;
using cuda_detail::offsets_proven_safe;
using cuda_detail::PrimaryCtx;
using cuda_detail::release_zero_page;

class CudaBackend final : public Backend {
public:
    CudaBackend(const BackendConfig& cfg, int device)
        : cfg_(cfg), device_(device), npages_(cfg.region_bytes / cfg.page_bytes) {}
    ~CudaBackend() override {
        if (abandoned_) return;  // forked child: the parent owns every driver object
        close();
        teardown();
    }

    Status open() {
        Driver& d = driver();
        if (!d.error.empty()) return Status::make(Code::Backend, d.error);
        Status st = ctx_.retain(device_);
        if (!st.is_ok()) return st;
        CtxScope scope(ctx_.ctx);
        if (scope.result() != CUDA_SUCCESS) return fail(d.text("cuCtxPushCurrent", scope.result()));
        CUresult r;
        int vmm = 0;
        if ((r = d.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, ctx_.dev)) !=
            CUDA_SUCCESS)
            return fail(d.text("cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)", r));
        if (!vmm)
            return fail("cuda:" + std::to_string(device_) +
                        " does not support the virtual memory management API (cuMemCreate/cuMemMap)");
        prop_ = device_prop(device_);
        size_t gran = 0;
        if ((r = d.cuMemGetAllocationGranularity(&gran, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) != CUDA_SUCCESS)
            return fail(d.text("cuMemGetAllocationGranularity", r));
        if (gran == 0 || cfg_.page_bytes % static_cast<int64_t>(gran) != 0) {
            const int64_t g = gran == 0 ? 1 : static_cast<int64_t>(gran);
            return Status::make(Code::Invalid, "page_bytes (" + std::to_string(cfg_.page_bytes) +
                                                   ") is not a multiple of the CUDA granularity (" +
                                                   std::to_string(gran) + "); use page_bytes=" +
                                                   std::to_string((cfg_.page_bytes + g - 1) / g * g));
        }
        gran_ = gran;
        kg_ = page() / gran_;
        std::string why;
        sliced_ = cfg_.num_regions > 1 && offsets_proven_safe(device_, gran_, &why);
        describe_ = "cuda:" + std::to_string(device_) + ": " +
                    (sliced_ ? "one allocation per page mapped in " + std::to_string(cfg_.num_regions) +
                                   " slices (" + why + ")"
                             : "one allocation per region per page at offset 0" +
                                   (why.empty() ? std::string() : " (" + why + ")"));
        if ((r = d.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
            stream_ = nullptr;
            return fail(d.text("cuStreamCreate", r));
        }
        st = acquire_zero_page(device_, gran_, prop_, stream_, &zero_);
        if (!st.is_ok()) return fail(st.message, st.code == Code::Shortage ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS);
        if ((r = d.cuMemAddressReserve(&base_, total(), gran_, 0, 0)) != CUDA_SUCCESS) {
            base_ = 0;
            return fail(d.text("cuMemAddressReserve", r));
        }
        data_.assign(static_cast<size_t>(cfg_.num_regions * npages_), 0);
        zmapped_.assign(total() / gran_, 0);
        handles_.assign(static_cast<size_t>(npages_ * per_page()), 0);
        // The zero granule at every granule, then one cuMemSetAccess over the
        // whole (now fully mapped) reservation.
        for (size_t g = 0; g < zmapped_.size(); ++g) {
            if ((r = d.cuMemMap(base_ + g * gran_, gran_, 0, zero_, 0)) != CUDA_SUCCESS)
                return fail(d.text("cuMemMap(zero page)", r), r);
            zmapped_[g] = 1;
        }
        if ((r = set_access(base_, total(), CU_MEM_ACCESS_FLAGS_PROT_READ)) != CUDA_SUCCESS)
            return fail(d.text("cuMemSetAccess(reservation, read-only)", r), r);
        return Status::ok();
    }

    Status commit(int64_t page_id) override {
        Driver& d = driver();
        if (closed_) return Status::make(Code::Closed, "space is closed");
        CtxScope scope(ctx_.ctx);
        if (scope.result() != CUDA_SUCCESS) return Status::make(Code::Backend, d.text("cuCtxPushCurrent", scope.result()));
        const size_t P = page();
        const int64_t nh = per_page();
        CUmemGenericAllocationHandle* h = &handles_[static_cast<size_t>(page_id * nh)];
        // 1. Allocate: nothing is mapped yet, so a failure only releases.
        for (int64_t k = 0; k < nh; ++k) {
            const CUresult r = d.cuMemCreate(&h[k], sliced_ ? P * static_cast<size_t>(cfg_.num_regions) : P, &prop_, 0);
            if (r != CUDA_SUCCESS) {
                h[k] = 0;
                release_handles(page_id);
                return Status::make(is_oom(r) ? Code::Shortage : Code::Backend, d.text("cuMemCreate", r));
            }
        }
        // 2. Map every region's slice read-write and queue its zero fill.
        for (int64_t reg = 0; reg < cfg_.num_regions; ++reg) {
            const CUdeviceptr va = slice_va(reg, page_id);
            CUresult r = unmap_slice(reg, page_id);
            std::string what = "cuMemUnmap(zero page)";
            if (r == CUDA_SUCCESS) {
                what = "cuMemMap";
                r = d.cuMemMap(va, P, sliced_ ? P * static_cast<size_t>(reg) : 0, handle(reg, page_id), 0);
                if (r == CUDA_SUCCESS) {
                    data(reg, page_id) = 1;
                    what = "cuMemSetAccess";
                    r = set_access(va, P, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
                }
                if (r == CUDA_SUCCESS) {
                    what = "cuMemsetD8Async";
                    r = d.cuMemsetD8Async(va, 0, P, stream_);
                }
            }
            if (r != CUDA_SUCCESS) {
                abort_commit(page_id);
                return Status::make(is_oom(r) ? Code::Shortage : Code::Backend,
                                    d.text(what + "(page " + std::to_string(page_id) + ")", r));
            }
        }
        // 3. Fresh memory is not promised to be zero: wait for the fills
        // before anyone can see the page (only our private stream).
        const CUresult r = d.cuStreamSynchronize(stream_);
        if (r != CUDA_SUCCESS) {
            abort_commit(page_id);
            return Status::make(Code::Backend, d.text("cuStreamSynchronize(zero fill)", r));
        }
        committed_.fetch_add(static_cast<int64_t>(P) * cfg_.num_regions, std::memory_order_relaxed);
        return Status::ok();
    }

    Status release(int64_t page_id) override {
        Driver& d = driver();
        if (closed_) return Status::make(Code::Closed, "space is closed");
        CtxScope scope(ctx_.ctx);
        if (scope.result() != CUDA_SUCCESS) return Status::make(Code::Backend, d.text("cuCtxPushCurrent", scope.result()));
        // Fence: kernels queued before this call may still read the page.
        CUresult r = d.cuCtxSynchronize();
        if (r != CUDA_SUCCESS) return Status::make(Code::Backend, d.text("cuCtxSynchronize(before unmap)", r));
        const size_t P = page();
        // Reversible part: unmap every region; the handles still hold the
        // memory, so a failure maps the regions done so far back (the page
        // stays committed, contents intact).
        for (int64_t reg = 0; reg < cfg_.num_regions; ++reg) {
            if ((r = unmap_slice(reg, page_id)) != CUDA_SUCCESS) {
                for (int64_t q = 0; q < reg; ++q) {
                    const CUdeviceptr vq = slice_va(q, page_id);
                    if (d.cuMemMap(vq, P, sliced_ ? P * static_cast<size_t>(q) : 0, handle(q, page_id), 0) ==
                        CUDA_SUCCESS) {
                        data(q, page_id) = 1;
                        set_access(vq, P, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
                    } else {
                        note("release rollback: cuMemMap failed; page " + std::to_string(page_id) +
                             " has a hole in region " + std::to_string(q));
                    }
                }
                return Status::make(Code::Backend,
                                    d.text("cuMemUnmap(page " + std::to_string(page_id) + ")", r));
            }
        }
        // Point of no return: the page is released. Freed, not recycled: the
        // next commit gets fresh memory and zero-fills it (invariant 6).
        committed_.fetch_sub(static_cast<int64_t>(P) * cfg_.num_regions, std::memory_order_relaxed);
        release_handles(page_id);
        for (int64_t reg = 0; reg < cfg_.num_regions; ++reg) map_zero(reg, page_id);
        return Status::ok();
    }

    int64_t allocated_bytes() const override {
        return committed_.load(std::memory_order_relaxed) + stranded_.load(std::memory_order_relaxed);
    }
    void* region_base(int64_t region) const override {
        return reinterpret_cast<void*>(base_ + static_cast<CUdeviceptr>(region * cfg_.region_bytes));
    }
    int device_type() const override { return 2; /* kDLCUDA */ }
    int device_id() const override { return device_; }
    std::string describe() const override { return describe_; }
    std::string last_error() const override {
        std::lock_guard<std::mutex> lock(err_mu_);
        return last_error_;
    }

    // Gives every page's memory back and leaves the range inert: every
    // granule on the read-only zero page, so tensors that outlive the space
    // read zeros and fault on write. The VA stays reserved (and the context
    // retained) until the backend is destroyed, so a stale tensor can never
    // reach memory the driver has handed to someone else.
    void close() override {
        if (closed_ || base_ == 0) {
            closed_ = true;
            return;
        }
        closed_ = true;
        Driver& d = driver();
        CtxScope scope(ctx_.ctx);
        if (scope.result() != CUDA_SUCCESS) {
            note(d.text("close: cuCtxPushCurrent", scope.result()));
            return;
        }
        CUresult r = d.cuCtxSynchronize();  // fence, as release()
        if (r != CUDA_SUCCESS) note(d.text("close: cuCtxSynchronize", r));
        for (int64_t p = 0; p < npages_; ++p) {
            for (int64_t reg = 0; reg < cfg_.num_regions; ++reg) {
                if (!data(reg, p)) continue;
                if ((r = unmap_slice(reg, p)) != CUDA_SUCCESS) note(d.text("close: cuMemUnmap", r));
            }
            release_handles(p);
            for (int64_t reg = 0; reg < cfg_.num_regions; ++reg) map_zero(reg, p);
        }
        committed_.store(0);
        stranded_.store(0);
    }

    // A forked child's copy: forget every driver object without touching it
    // (the driver is unusable after fork, and the objects are the parent's).
    void abandon() override {
        abandoned_ = true;
        closed_ = true;
        ctx_.ctx = nullptr;
    }

private:
    size_t total() const { return static_cast<size_t>(cfg_.num_regions * cfg_.region_bytes); }
    size_t page() const { return static_cast<size_t>(cfg_.page_bytes); }
    int64_t per_page() const { return sliced_ ? 1 : cfg_.num_regions; }
    CUdeviceptr slice_va(int64_t region, int64_t p) const {
        return base_ + static_cast<CUdeviceptr>(region * cfg_.region_bytes + p * cfg_.page_bytes);
    }
    size_t first_granule(int64_t region, int64_t p) const {
        return static_cast<size_t>(region * cfg_.region_bytes + p * cfg_.page_bytes) / gran_;
    }
    uint8_t& data(int64_t region, int64_t p) { return data_[static_cast<size_t>(region * npages_ + p)]; }
    CUmemGenericAllocationHandle handle(int64_t region, int64_t p) const {
        return handles_[static_cast<size_t>(p * per_page() + (sliced_ ? 0 : region))];
    }
    CUresult set_access(CUdeviceptr va, size_t n, CUmemAccess_flags flags) {
        CUmemAccessDesc a{};
        a.location = prop_.location;
        a.flags = flags;
        return driver().cuMemSetAccess(va, n, &a, 1);
    }
    // Unmaps whatever one slice holds, one whole mapping at a time (its data
    // mapping, or each zero granule still mapped); nothing mapped is a no-op.
    // The state arrays stay exact whatever fails.
    CUresult unmap_slice(int64_t region, int64_t p) {
        Driver& d = driver();
        if (data(region, p)) {
            const CUresult r = d.cuMemUnmap(slice_va(region, p), page());
            if (r == CUDA_SUCCESS) data(region, p) = 0;
            return r;
        }
        const size_t g0 = first_granule(region, p);
        for (size_t g = g0; g < g0 + kg_; ++g) {
            if (!zmapped_[g]) continue;
            const CUresult r = d.cuMemUnmap(base_ + g * gran_, gran_);
            if (r != CUDA_SUCCESS) return r;
            zmapped_[g] = 0;
        }
        return CUDA_SUCCESS;
    }
    // Puts the read-only zero granule wherever the slice has nothing mapped;
    // a granule that fails stays unmapped (noted), and the next commit or
    // close() deals with it.
    void map_zero(int64_t region, int64_t p) {
        Driver& d = driver();
        if (data(region, p)) return;
        const size_t g0 = first_granule(region, p);
        for (size_t g = g0; g < g0 + kg_; ++g) {
            if (zmapped_[g]) continue;
            const CUdeviceptr va = base_ + g * gran_;
            CUresult r = d.cuMemMap(va, gran_, 0, zero_, 0);
            if (r != CUDA_SUCCESS) {
                note(d.text("cuMemMap(zero page, page " + std::to_string(p) + ")", r));
                continue;
            }
            zmapped_[g] = 1;
            if ((r = set_access(va, gran_, CU_MEM_ACCESS_FLAGS_PROT_READ)) != CUDA_SUCCESS) {
                note(d.text("cuMemSetAccess(zero page, page " + std::to_string(p) + ")", r));
                if (d.cuMemUnmap(va, gran_) == CUDA_SUCCESS) zmapped_[g] = 0;
            }
        }
    }
    // Drops the page's handles. Legal while still mapped (the memory lives
    // until its last unmap); a failure strands the memory, counted until close.
    void release_handles(int64_t p) {
        Driver& d = driver();
        const size_t bytes = sliced_ ? page() * static_cast<size_t>(cfg_.num_regions) : page();
        for (int64_t k = 0; k < per_page(); ++k) {
            CUmemGenericAllocationHandle& h = handles_[static_cast<size_t>(p * per_page() + k)];
            if (!h) continue;
            const CUresult r = d.cuMemRelease(h);
            if (r != CUDA_SUCCESS) {
                note(d.text("cuMemRelease(page " + std::to_string(p) + ")", r));
                std::lock_guard<std::mutex> lock(err_mu_);
                stranded_handles_.push_back(h);
                stranded_.fetch_add(static_cast<int64_t>(bytes));
            }
            h = 0;
        }
    }
    // Rolls a failed commit back to "zero granules everywhere, no handle".
    void abort_commit(int64_t p) {
        Driver& d = driver();
        d.cuStreamSynchronize(stream_);  // no fill may land after the unmap
        for (int64_t reg = 0; reg < cfg_.num_regions; ++reg) {
            if (!data(reg, p)) continue;
            const CUresult r = unmap_slice(reg, p);
            if (r != CUDA_SUCCESS) note(d.text("commit rollback: cuMemUnmap", r));
        }
        release_handles(p);
        for (int64_t reg = 0; reg < cfg_.num_regions; ++reg) map_zero(reg, p);
    }
    // Destroys the driver objects close() keeps for stale tensors.
    void teardown() {
        if (!ctx_.ctx) return;
        Driver& d = driver();
        CtxScope scope(ctx_.ctx);
        if (scope.result() != CUDA_SUCCESS) return;
        bool all_unmapped = true;
        for (int64_t reg = 0; !data_.empty() && reg < cfg_.num_regions; ++reg)
            for (int64_t p = 0; p < npages_; ++p) all_unmapped = unmap_slice(reg, p) == CUDA_SUCCESS && all_unmapped;
        {
            std::lock_guard<std::mutex> lock(err_mu_);
            for (auto h : stranded_handles_) d.cuMemRelease(h);
            stranded_handles_.clear();
        }
        if (zero_) release_zero_page(device_), zero_ = 0;
        if (base_ && all_unmapped) d.cuMemAddressFree(base_, total());
        base_ = 0;
        if (stream_) d.cuStreamDestroy(stream_), stream_ = nullptr;
    }
    void note(std::string msg) {
        std::lock_guard<std::mutex> lock(err_mu_);
        last_error_ = std::move(msg);
    }
    // A failed open: undo what was built (the destructor's teardown).
    Status fail(std::string msg, CUresult r = CUDA_SUCCESS) {
        const Code code = is_oom(r) ? Code::Shortage : Code::Backend;
        closed_ = true;
        teardown();
        return Status::make(code, std::move(msg));
    }

    BackendConfig cfg_;
    int device_;  // the ordinal: what CUmemLocation.id and DLPack want
    int64_t npages_;
    PrimaryCtx ctx_;
    CUmemAllocationProp prop_{};
    size_t gran_ = 0, kg_ = 1;  // granularity; granules per page
    bool sliced_ = false;
    std::string describe_;
    CUstream stream_ = nullptr;  // private, non-blocking: zero fills only
    CUdeviceptr base_ = 0;
    CUmemGenericAllocationHandle zero_ = 0;  // the device's shared zero granule
    // What is mapped where, exactly (no unmap of a hole, no map over mapped
    // VA, whatever failed before): per slice (region, page) whether its data
    // is mapped; per granule whether the zero granule is. A page's entries are
    // touched only by the one thread committing or releasing that page.
    std::vector<uint8_t> data_, zmapped_;
    std::vector<CUmemGenericAllocationHandle> handles_;  // per page: R handles, or 1 when sliced
    // Atomic: the reserve thread and inline commits run on different threads.
    std::atomic<int64_t> committed_{0}, stranded_{0};
    std::atomic<bool> closed_{false};
    bool abandoned_ = false;
    mutable std::mutex err_mu_;  // last_error_, stranded_handles_
    std::string last_error_;
    std::vector<CUmemGenericAllocationHandle> stranded_handles_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const BackendConfig& cfg, int device, Status* status) {
    auto b = std::make_unique<CudaBackend>(cfg, device);
    *status = b->open();
    if (!status->is_ok()) return nullptr;
    return b;
}

}  // namespace kvpool

#else  // built without cuda.h: the backend is compiled out

namespace kvpool {
std::unique_ptr<Backend> make_cuda_backend(const BackendConfig&, int, Status* status) {
    *status = Status::make(Code::Backend, cuda_unavailable_reason());
    return nullptr;
}
}  // namespace kvpool

#endif
