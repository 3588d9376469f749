// CUDA backend: the driver's virtual-memory API, loaded at run time.
//
// Compiled from cuda.h only (KVPOOL_HAVE_CUDA_H); libcuda.so.1 is dlopen()ed
// when a cuda space is created and every entry point is fetched through
// cuGetProcAddress, so the module imports on machines without a driver and
// says why CUDA is unavailable. $KVPOOL_LIBCUDA overrides the library path
// (the tests load a fake driver that keeps host memory behind the VMM calls).
//
//   VA (one reservation):  [ region 0 | region 1 | ... ]   region = num_pages x P
//   commit page p:         one cuMemCreate of R x P bytes, mapped in R slices
//                          (cuMemMap offset r x P) at page p of every region
//   unmapped slices:       one shared zero page, mapped read-only: padding
//                          reads zeros, a stray write faults instead of aliasing
//
// Every driver error is a value: out of memory at cuMemCreate is a shortage,
// anything else a Backend status carrying the driver's own message.
#include "backend.hpp"

#ifdef KVPOOL_HAVE_CUDA_H
#include <cuda.h>
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace kvpool {
namespace {

template <typename T>
using Fn = T;  // lets a function-pointer type-id declare a field

struct Driver {
    void* lib = nullptr;
    std::string error;  // why it is unavailable
#define KVPOOL_CU_FNS(X)                                                                                   \
    X(cuInit, CUresult (*)(unsigned int))                                                                  \
    X(cuGetErrorString, CUresult (*)(CUresult, const char**))                                             \
    X(cuDeviceGet, CUresult (*)(CUdevice*, int))                                                           \
    X(cuDevicePrimaryCtxRetain, CUresult (*)(CUcontext*, CUdevice))                                        \
    X(cuCtxSetCurrent, CUresult (*)(CUcontext))                                                            \
    X(cuMemGetInfo, CUresult (*)(size_t*, size_t*))                                                        \
    X(cuMemGetAllocationGranularity,                                                                       \
      CUresult (*)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags))                 \
    X(cuMemAddressReserve, CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long))    \
    X(cuMemAddressFree, CUresult (*)(CUdeviceptr, size_t))                                                 \
    X(cuMemCreate,                                                                                         \
      CUresult (*)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long)) \
    X(cuMemRelease, CUresult (*)(CUmemGenericAllocationHandle))                                            \
    X(cuMemMap, CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long)) \
    X(cuMemUnmap, CUresult (*)(CUdeviceptr, size_t))                                                       \
    X(cuMemSetAccess, CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t))
#define KVPOOL_CU_FIELD(name, type) Fn<type> name = nullptr;
    KVPOOL_CU_FNS(KVPOOL_CU_FIELD)
#undef KVPOOL_CU_FIELD

    std::string text(const char* what, CUresult r) const {
        const char* s = nullptr;
        if (cuGetErrorString) cuGetErrorString(r, &s);
        return std::string(what) + ": " + (s ? s : "unknown CUDA error") + " (CUresult " + std::to_string(r) + ")";
    }
};

Driver& driver() {
    static Driver d;
    static std::once_flag once;
    std::call_once(once, [] {
        const char* path = std::getenv("KVPOOL_LIBCUDA");
        d.lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!d.lib) {
            const char* e = dlerror();
            d.error = std::string("cannot load the CUDA driver (") + (e ? e : "libcuda.so.1") + ")";
            return;
        }
        using GetProc = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
        auto get = reinterpret_cast<GetProc>(dlsym(d.lib, "cuGetProcAddress_v2"));
        if (!get) {
            d.error = "the CUDA driver has no cuGetProcAddress_v2 (driver older than CUDA 12)";
            return;
        }
#define KVPOOL_CU_LOAD(name, type)                                                              \
    {                                                                                           \
        void* fn = nullptr;                                                                     \
        CUdriverProcAddressQueryResult st{};                                                    \
        if (get(#name, &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st) != CUDA_SUCCESS || !fn) { \
            d.error = "the CUDA driver lacks " #name;                                           \
            return;                                                                             \
        }                                                                                       \
        d.name = reinterpret_cast<type>(fn);                                                    \
    }
        KVPOOL_CU_FNS(KVPOOL_CU_LOAD)
#undef KVPOOL_CU_LOAD
        const CUresult r = d.cuInit(0);
        if (r != CUDA_SUCCESS) d.error = d.text("cuInit", r);
    });
    return d;
}

class CudaBackend final : public Backend {
public:
    CudaBackend(const BackendConfig& cfg, int device) : cfg_(cfg), device_(device) {}
    ~CudaBackend() override { close(); }

    Status open() {
        Driver& d = driver();
        if (!d.error.empty()) return Status::make(Code::Backend, d.error);
        CUresult r;
        if ((r = d.cuDeviceGet(&dev_, device_)) != CUDA_SUCCESS) return fail(d.text("cuDeviceGet", r));
        if ((r = d.cuDevicePrimaryCtxRetain(&ctx_, dev_)) != CUDA_SUCCESS)
            return fail(d.text("cuDevicePrimaryCtxRetain", r));
        if ((r = d.cuCtxSetCurrent(ctx_)) != CUDA_SUCCESS) return fail(d.text("cuCtxSetCurrent", r));
        prop_ = {};
        prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop_.location.id = dev_;
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
        if ((r = d.cuMemAddressReserve(&base_, total(), gran_, 0, 0)) != CUDA_SUCCESS)
            return fail(d.text("cuMemAddressReserve", r));
        if ((r = d.cuMemCreate(&zero_, gran_, &prop_, 0)) != CUDA_SUCCESS) {
            d.cuMemAddressFree(base_, total());
            base_ = 0;
            return fail(d.text("cuMemCreate(zero page)", r));
        }
        // Back every slice with the zero page, read-only.
        for (size_t off = 0; off < total(); off += gran_) {
            Status s = map_zero(base_ + off, gran_);
            if (!s.is_ok()) {
                close();
                return s;
            }
        }
        handles_.assign(static_cast<size_t>(cfg_.region_bytes / cfg_.page_bytes), 0);
        return Status::ok();
    }

    Status commit(int64_t page) override {
        Driver& d = driver();
        if (base_ == 0) return Status::make(Code::Closed, "space is closed");
        CUmemGenericAllocationHandle h = 0;
        const size_t P = static_cast<size_t>(cfg_.page_bytes);
        CUresult r = d.cuMemCreate(&h, P * static_cast<size_t>(cfg_.num_regions), &prop_, 0);
        if (r == CUDA_ERROR_OUT_OF_MEMORY) return Status::make(Code::Shortage, d.text("cuMemCreate", r));
        if (r != CUDA_SUCCESS) return Status::make(Code::Backend, d.text("cuMemCreate", r));
        for (int64_t reg = 0; reg < cfg_.num_regions; ++reg) {
            const CUdeviceptr va = slice(reg, page);
            std::string err;
            if ((r = d.cuMemUnmap(va, P)) != CUDA_SUCCESS) err = d.text("cuMemUnmap(zero)", r);
            else if ((r = d.cuMemMap(va, P, P * static_cast<size_t>(reg), h, 0)) != CUDA_SUCCESS) {
                err = d.text("cuMemMap", r);
                restore_zero(va);
            } else if ((r = set_access(va, P, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)) != CUDA_SUCCESS) {
                err = d.text("cuMemSetAccess", r);
                d.cuMemUnmap(va, P);
                restore_zero(va);
            }
            if (!err.empty()) {
                // All-or-nothing: put the regions done so far back on the zero page.
                for (int64_t q = 0; q < reg; ++q) {
                    d.cuMemUnmap(slice(q, page), P);
                    restore_zero(slice(q, page));
                }
                d.cuMemRelease(h);
                return Status::make(Code::Backend, err);
            }
        }
        handles_[static_cast<size_t>(page)] = h;
        committed_ += static_cast<int64_t>(P) * cfg_.num_regions;
        return Status::ok();
    }

    Status release(int64_t page) override {
        Driver& d = driver();
        if (base_ == 0) return Status::make(Code::Closed, "space is closed");
        const size_t P = static_cast<size_t>(cfg_.page_bytes);
        const CUmemGenericAllocationHandle h = handles_[static_cast<size_t>(page)];
        for (int64_t reg = 0; reg < cfg_.num_regions; ++reg) {
            const CUdeviceptr va = slice(reg, page);
            CUresult r = d.cuMemUnmap(va, P);
            if (r != CUDA_SUCCESS) {
                // All-or-nothing, as commit: the page stays RESERVE (committed),
                // so map the regions already on the zero page back to its memory.
                for (int64_t q = 0; q < reg; ++q) {
                    const CUdeviceptr vq = slice(q, page);
                    d.cuMemUnmap(vq, P);
                    d.cuMemMap(vq, P, P * static_cast<size_t>(q), h, 0);
                    set_access(vq, P, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
                }
                return Status::make(Code::Backend, d.text("cuMemUnmap", r));
            }
            restore_zero(va);
        }
        // Freed, not recycled: the next commit gets a fresh allocation, so no
        // KV data crosses tenants (DESIGN.md invariant 6).
        CUresult r = d.cuMemRelease(h);
        handles_[static_cast<size_t>(page)] = 0;
        committed_ -= static_cast<int64_t>(P) * cfg_.num_regions;
        if (r != CUDA_SUCCESS) return Status::make(Code::Backend, d.text("cuMemRelease", r));
        return Status::ok();
    }

    int64_t allocated_bytes() const override { return committed_; }
    void* region_base(int64_t region) const override {
        return reinterpret_cast<void*>(base_ + static_cast<CUdeviceptr>(region * cfg_.region_bytes));
    }
    int device_type() const override { return 2; /* kDLCUDA */ }
    int device_id() const override { return device_; }

    void close() override {
        if (base_ == 0) return;
        Driver& d = driver();
        d.cuMemUnmap(base_, total());
        for (auto& h : handles_)
            if (h) d.cuMemRelease(h), h = 0;
        if (zero_) d.cuMemRelease(zero_), zero_ = 0;
        d.cuMemAddressFree(base_, total());
        base_ = 0;
        committed_ = 0;
    }

private:
    size_t total() const { return static_cast<size_t>(cfg_.num_regions * cfg_.region_bytes); }
    CUdeviceptr slice(int64_t region, int64_t page) const {
        return base_ + static_cast<CUdeviceptr>(region * cfg_.region_bytes + page * cfg_.page_bytes);
    }
    CUresult set_access(CUdeviceptr va, size_t n, CUmemAccess_flags flags) {
        CUmemAccessDesc a{};
        a.location = prop_.location;
        a.flags = flags;
        return driver().cuMemSetAccess(va, n, &a, 1);
    }
    Status map_zero(CUdeviceptr va, size_t n) {
        Driver& d = driver();
        for (size_t off = 0; off < n; off += gran_) {
            CUresult r = d.cuMemMap(va + off, gran_, 0, zero_, 0);
            if (r != CUDA_SUCCESS) return Status::make(Code::Backend, d.text("cuMemMap(zero page)", r));
            if ((r = set_access(va + off, gran_, CU_MEM_ACCESS_FLAGS_PROT_READ)) != CUDA_SUCCESS)
                return Status::make(Code::Backend, d.text("cuMemSetAccess(zero page)", r));
        }
        return Status::ok();
    }
    void restore_zero(CUdeviceptr va) { map_zero(va, static_cast<size_t>(cfg_.page_bytes)); }
    Status fail(std::string msg) { return Status::make(Code::Backend, std::move(msg)); }

    BackendConfig cfg_;
    int device_;
    CUdevice dev_ = 0;
    CUcontext ctx_ = nullptr;
    CUmemAllocationProp prop_{};
    size_t gran_ = 0;
    CUdeviceptr base_ = 0;
    CUmemGenericAllocationHandle zero_ = 0;
    std::vector<CUmemGenericAllocationHandle> handles_;
    int64_t committed_ = 0;
};

}  // namespace

std::string cuda_unavailable_reason() { return driver().error; }

Status cuda_mem_info(int device, int64_t* free_bytes, int64_t* total_bytes) {
    Driver& d = driver();
    if (!d.error.empty()) return Status::make(Code::Backend, d.error);
    CUdevice dev;
    CUcontext ctx;
    CUresult r;
    if ((r = d.cuDeviceGet(&dev, device)) != CUDA_SUCCESS) return Status::make(Code::Backend, d.text("cuDeviceGet", r));
    if ((r = d.cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS ||
        (r = d.cuCtxSetCurrent(ctx)) != CUDA_SUCCESS)
        return Status::make(Code::Backend, d.text("cuDevicePrimaryCtxRetain", r));
    size_t f = 0, t = 0;
    if ((r = d.cuMemGetInfo(&f, &t)) != CUDA_SUCCESS) return Status::make(Code::Backend, d.text("cuMemGetInfo", r));
    *free_bytes = static_cast<int64_t>(f);
    *total_bytes = static_cast<int64_t>(t);
    return Status::ok();
}

std::unique_ptr<Backend> make_cuda_backend(const BackendConfig& cfg, int device, Status* status) {
    auto b = std::make_unique<CudaBackend>(cfg, device);
    *status = b->open();
    if (!status->is_ok()) return nullptr;
    return b;
}

}  // namespace kvpool

#else  // built without cuda.h: the backend is compiled out

namespace kvpool {
std::string cuda_unavailable_reason() { return "kvpool was built without CUDA headers"; }
Status cuda_mem_info(int, int64_t*, int64_t*) { return Status::make(Code::Backend, cuda_unavailable_reason()); }
std::unique_ptr<Backend> make_cuda_backend(const BackendConfig&, int, Status* status) {
    *status = Status::make(Code::Backend, cuda_unavailable_reason());
    return nullptr;
}
}  // namespace kvpool

#endif
