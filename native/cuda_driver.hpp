// The CUDA driver as kvpool uses it: the entry points loaded at run time,
// the context helpers every call into the driver goes through, and the
// device-wide pieces every CUDA space of the process shares (the start-up
// offset probe, the zero granule). cuda_backend.cpp builds a space's memory
// on top of it and says which driver rules apply and why.
//
// Compiled only with cuda.h (KVPOOL_HAVE_CUDA_H): libcuda.so.1 (or
// $KVPOOL_LIBCUDA) is dlopen()ed on first use and every entry point fetched
// through cuGetProcAddress, so the module imports on machines without a
// driver and says why CUDA is unavailable.
#pragma once

#ifdef KVPOOL_HAVE_CUDA_H
#include <cuda.h>

#include <string>

#include "status.hpp"

namespace kvpool::cuda_detail {

template <typename T>
using Fn = T;  // lets a function-pointer type-id declare a field

struct Driver {
    void* lib = nullptr;
    std::string error;  // why it is unavailable
    // Fetched by base name at version 12000: the driver hands back the
    // versioned entry point (cuCtxPushCurrent -> _v2, cuMemcpyDtoH -> _v2, ...).
#define KVPOOL_CU_FNS(X)                                                                                   \
    X(cuInit, CUresult (*)(unsigned int))                                                                  \
    X(cuGetErrorString, CUresult (*)(CUresult, const char**))                                             \
    X(cuDeviceGet, CUresult (*)(CUdevice*, int))                                                           \
    X(cuDeviceGetAttribute, CUresult (*)(int*, CUdevice_attribute, CUdevice))                              \
    X(cuDevicePrimaryCtxRetain, CUresult (*)(CUcontext*, CUdevice))                                        \
    X(cuDevicePrimaryCtxRelease, CUresult (*)(CUdevice))                                                   \
    X(cuCtxPushCurrent, CUresult (*)(CUcontext))                                                           \
    X(cuCtxPopCurrent, CUresult (*)(CUcontext*))                                                           \
    X(cuCtxSynchronize, CUresult (*)(void))                                                                \
    X(cuStreamCreate, CUresult (*)(CUstream*, unsigned int))                                               \
    X(cuStreamDestroy, CUresult (*)(CUstream))                                                             \
    X(cuStreamSynchronize, CUresult (*)(CUstream))                                                         \
    X(cuMemsetD8Async, CUresult (*)(CUdeviceptr, unsigned char, size_t, CUstream))                         \
    X(cuMemcpyDtoH, CUresult (*)(void*, CUdeviceptr, size_t))                                              \
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

    std::string text(const std::string& what, CUresult r) const {
        const char* s = nullptr;
        if (cuGetErrorString) cuGetErrorString(r, &s);
        return what + ": " + (s ? s : "unknown CUDA error") + " (CUresult " + std::to_string(r) + ")";
    }
};

// The process's driver, loaded on first call; error says why it is unusable.
Driver& driver();

inline bool is_oom(CUresult r) { return r == CUDA_ERROR_OUT_OF_MEMORY; }

// Makes `ctx` current on this thread for the scope and restores the caller's
// current context after (a push/pop pair never disturbs it).
class CtxScope {
public:
    explicit CtxScope(CUcontext ctx) : r_(driver().cuCtxPushCurrent(ctx)) {}
    ~CtxScope() {
        if (r_ == CUDA_SUCCESS) {
            CUcontext popped = nullptr;
            driver().cuCtxPopCurrent(&popped);
        }
    }
    CtxScope(const CtxScope&) = delete;
    CtxScope& operator=(const CtxScope&) = delete;
    CUresult result() const { return r_; }

private:
    CUresult r_;
};

// A retained primary context, released on destruction.
struct PrimaryCtx {
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    Status retain(int ordinal) {
        Driver& d = driver();
        CUresult r;
        if ((r = d.cuDeviceGet(&dev, ordinal)) != CUDA_SUCCESS)
            return Status::make(Code::Backend, d.text("cuDeviceGet(" + std::to_string(ordinal) + ")", r));
        if ((r = d.cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS) {
            ctx = nullptr;
            return Status::make(Code::Backend, d.text("cuDevicePrimaryCtxRetain", r));
        }
        return Status::ok();
    }
    ~PrimaryCtx() {
        if (ctx) driver().cuDevicePrimaryCtxRelease(dev);
    }
};

// The allocation properties of device memory on `ordinal` (pinned, on the device).
CUmemAllocationProp device_prop(int ordinal);

// Whether cuMemMap honours a non-zero offset on this device (a probe; any
// failure reads as "not safe"); *why says what it found. Called with the
// device's context current.
bool offsets_proven_safe(int ordinal, size_t gran, std::string* why);

// The device's shared read-only zero granule (zero-filled once, refcounted
// per space); released with the last space of the device. Called with the
// device's context current.
Status acquire_zero_page(int ordinal, size_t gran, const CUmemAllocationProp& prop, CUstream s,
                         CUmemGenericAllocationHandle* out);
void release_zero_page(int ordinal);

}  // namespace kvpool::cuda_detail

#endif  // KVPOOL_HAVE_CUDA_H
