// The CUDA driver loaded at run time, and the device-wide pieces every CUDA
// space shares (cuda_driver.hpp). What a space does with them, and the
// driver's rules it follows, are in cuda_backend.cpp.
#include "backend.hpp"
#include "cuda_driver.hpp"

#ifdef KVPOOL_HAVE_CUDA_H
#include <dlfcn.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace kvpool {
namespace cuda_detail {

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

CUmemAllocationProp device_prop(int ordinal) {
    CUmemAllocationProp p{};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = ordinal;  // an ordinal, not a CUdevice handle
    return p;
}

// Does cuMemMap honour a non-zero offset on this device? Mapping one
// two-granule allocation at two VAs (offsets 0 and one granule), writing
// distinct bytes through each and reading both back tells a driver that
// rejects offsets (an error) and one that ignores them (the bytes alias)
// from one that honours them. Any failure reads as "not safe". Called with
// the device's context current, once per space (about ten driver calls).
bool offsets_proven_safe(int ordinal, size_t gran, std::string* why) {
    Driver& d = driver();
    const CUmemAllocationProp prop = device_prop(ordinal);
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    CUstream s = nullptr;
    bool mapped0 = false, mapped1 = false, safe = false;
    CUresult r;
    auto probe = [&]() -> std::string {
        if ((r = d.cuMemCreate(&h, 2 * gran, &prop, 0)) != CUDA_SUCCESS) return h = 0, d.text("probe cuMemCreate", r);
        if ((r = d.cuMemAddressReserve(&va, 2 * gran, gran, 0, 0)) != CUDA_SUCCESS)
            return va = 0, d.text("probe cuMemAddressReserve", r);
        if ((r = d.cuMemMap(va, gran, 0, h, 0)) != CUDA_SUCCESS) return d.text("probe cuMemMap(offset 0)", r);
        mapped0 = true;
        if ((r = d.cuMemMap(va + gran, gran, gran, h, 0)) != CUDA_SUCCESS) return d.text("cuMemMap(offset != 0)", r);
        mapped1 = true;
        CUmemAccessDesc a{};
        a.location = prop.location;
        a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        if ((r = d.cuMemSetAccess(va, 2 * gran, &a, 1)) != CUDA_SUCCESS) return d.text("probe cuMemSetAccess", r);
        if ((r = d.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS)
            return s = nullptr, d.text("probe cuStreamCreate", r);
        unsigned char got[2] = {0, 0};
        if ((r = d.cuMemsetD8Async(va, 0x5A, gran, s)) != CUDA_SUCCESS ||
            (r = d.cuMemsetD8Async(va + gran, 0xC3, gran, s)) != CUDA_SUCCESS ||
            (r = d.cuStreamSynchronize(s)) != CUDA_SUCCESS || (r = d.cuMemcpyDtoH(&got[0], va, 1)) != CUDA_SUCCESS ||
            (r = d.cuMemcpyDtoH(&got[1], va + gran, 1)) != CUDA_SUCCESS)
            return d.text("probe write/read", r);
        if (got[0] != 0x5A || got[1] != 0xC3) return "cuMemMap ignores its offset (the two mappings alias)";
        safe = true;
        return "cuMemMap offsets proven safe by the start-up probe";
    };
    *why = probe();
    if (s) d.cuStreamDestroy(s);
    if (mapped1) d.cuMemUnmap(va + gran, gran);
    if (mapped0) d.cuMemUnmap(va, gran);
    if (va) d.cuMemAddressFree(va, 2 * gran);
    if (h) d.cuMemRelease(h);
    return safe;
}

// One granule of zeros per device, shared by every space of the process and
// mapped read-only at every idle granule of their reservations. Zero-filled
// once, when created, through a scratch mapping (cuMemCreate does not promise
// zeros). Refcounted: freed with the last space of the device. Called with
// the device's context current.
namespace {
std::mutex g_zero_mu;
std::map<int, std::pair<CUmemGenericAllocationHandle, int>> g_zero;  // ordinal -> (handle, spaces)
}  // namespace

Status acquire_zero_page(int ordinal, size_t gran, const CUmemAllocationProp& prop, CUstream s,
                         CUmemGenericAllocationHandle* out) {
    Driver& d = driver();
    std::lock_guard<std::mutex> lock(g_zero_mu);
    auto it = g_zero.find(ordinal);
    if (it != g_zero.end()) {
        ++it->second.second;
        *out = it->second.first;
        return Status::ok();
    }
    CUmemGenericAllocationHandle h = 0;
    CUresult r = d.cuMemCreate(&h, gran, &prop, 0);
    if (r != CUDA_SUCCESS) return Status::make(is_oom(r) ? Code::Shortage : Code::Backend, d.text("cuMemCreate(zero page)", r));
    CUdeviceptr va = 0;
    bool mapped = false;
    std::string err;
    if ((r = d.cuMemAddressReserve(&va, gran, gran, 0, 0)) != CUDA_SUCCESS) {
        va = 0;
        err = d.text("cuMemAddressReserve(zero page)", r);
    } else if ((r = d.cuMemMap(va, gran, 0, h, 0)) != CUDA_SUCCESS) {
        err = d.text("cuMemMap(zero page)", r);
    } else {
        mapped = true;
        CUmemAccessDesc a{};
        a.location = prop.location;
        a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        if ((r = d.cuMemSetAccess(va, gran, &a, 1)) != CUDA_SUCCESS ||
            (r = d.cuMemsetD8Async(va, 0, gran, s)) != CUDA_SUCCESS || (r = d.cuStreamSynchronize(s)) != CUDA_SUCCESS)
            err = d.text("zero-filling the zero page", r);
    }
    if (mapped && (r = d.cuMemUnmap(va, gran)) != CUDA_SUCCESS && err.empty()) err = d.text("cuMemUnmap(zero page scratch)", r);
    if (va && (!mapped || r == CUDA_SUCCESS)) d.cuMemAddressFree(va, gran);
    if (!err.empty()) {
        d.cuMemRelease(h);
        return Status::make(is_oom(r) ? Code::Shortage : Code::Backend, err);
    }
    g_zero[ordinal] = {h, 1};
    *out = h;
    return Status::ok();
}

void release_zero_page(int ordinal) {
    std::lock_guard<std::mutex> lock(g_zero_mu);
    auto it = g_zero.find(ordinal);
    if (it == g_zero.end() || --it->second.second > 0) return;
    driver().cuMemRelease(it->second.first);
    g_zero.erase(it);
}

}  // namespace cuda_detail

using cuda_detail::CtxScope;
using cuda_detail::Driver;
using cuda_detail::PrimaryCtx;
using cuda_detail::driver;

std::string cuda_unavailable_reason() { return driver().error; }

Status cuda_mem_info(int device, int64_t* free_bytes, int64_t* total_bytes) {
    Driver& d = driver();
    if (!d.error.empty()) return Status::make(Code::Backend, d.error);
    PrimaryCtx ctx;  // retained for the call only, restoring the caller's context
    Status st = ctx.retain(device);
    if (!st.is_ok()) return st;
    CtxScope scope(ctx.ctx);
    if (scope.result() != CUDA_SUCCESS) return Status::make(Code::Backend, d.text("cuCtxPushCurrent", scope.result()));
    size_t f = 0, t = 0;
    const CUresult r = d.cuMemGetInfo(&f, &t);
    if (r != CUDA_SUCCESS) return Status::make(Code::Backend, d.text("cuMemGetInfo", r));
    *free_bytes = static_cast<int64_t>(f);
    *total_bytes = static_cast<int64_t>(t);
    return Status::ok();
}

}  // namespace kvpool

#else  // built without cuda.h: the driver is compiled out

namespace kvpool {
std::string cuda_unavailable_reason() { return "kvpool was built without CUDA headers"; }
Status cuda_mem_info(int, int64_t*, int64_t*) { return Status::make(Code::Backend, cuda_unavailable_reason()); }
}  // namespace kvpool

#endif
