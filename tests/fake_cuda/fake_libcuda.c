/* A fake libcuda.so.1 for kvpool's tests: the driver's virtual-memory entry
 * points over host memory (a memfd per physical allocation, mmap for maps,
 * mprotect for access), with configurable failures. Not a CUDA driver: just
 * enough contract for the backend's transactional and rollback paths.
 *
 * Test hooks (ctypes): fake_cuda_fail(name, nth, code) makes the nth next call
 * of `name` return `code`; fake_cuda_allocated() is the bytes of live
 * physical allocations; fake_cuda_live_handles() their count.
 * Env: FAKE_CUDA_GRANULARITY (default 2 MiB), FAKE_CUDA_TOTAL (default 1 GiB).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum { OK = 0, ERR_INVALID_VALUE = 1, ERR_OUT_OF_MEMORY = 2, ERR_NOT_FOUND = 500, ERR_UNKNOWN = 999 };

#define MAXH 65536
static struct { int fd; size_t size; } handles[MAXH];
static size_t allocated, live;
static char fail_name[64];
static int fail_nth, fail_code;

void fake_cuda_fail(const char* name, int nth, int code) {
    strncpy(fail_name, name, sizeof(fail_name) - 1);
    fail_nth = nth;
    fail_code = code;
}
size_t fake_cuda_allocated(void) { return allocated; }
size_t fake_cuda_live_handles(void) { return live; }

static int injected(const char* name) {
    if (fail_nth > 0 && strcmp(name, fail_name) == 0 && --fail_nth == 0) return fail_code;
    return 0;
}
static size_t env_size(const char* name, size_t dflt) {
    const char* v = getenv(name);
    return v && *v ? (size_t)strtoull(v, NULL, 10) : dflt;
}

CUresult cuInit(unsigned int flags) { (void)flags; return injected("cuInit"); }
CUresult cuGetErrorString(CUresult e, const char** s) {
    switch (e) {
        case ERR_OUT_OF_MEMORY: *s = "out of memory (fake)"; break;
        case ERR_INVALID_VALUE: *s = "invalid argument (fake)"; break;
        default: *s = "unknown error (fake)";
    }
    return OK;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) { *d = ordinal; return ordinal == 0 ? OK : ERR_INVALID_VALUE; }
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) { (void)d; *c = (void*)1; return OK; }
CUresult cuCtxSetCurrent(CUcontext c) { (void)c; return OK; }
CUresult cuMemGetInfo(size_t* free_b, size_t* total) {
    *total = env_size("FAKE_CUDA_TOTAL", 1ull << 30);
    *free_b = *total > allocated ? *total - allocated : 0;
    return OK;
}
CUresult cuMemGetAllocationGranularity(size_t* g, const void* prop, int option) {
    (void)prop; (void)option;
    *g = env_size("FAKE_CUDA_GRANULARITY", 2u << 20);
    return OK;
}
CUresult cuMemAddressReserve(CUdeviceptr* p, size_t size, size_t align, CUdeviceptr addr, unsigned long long f) {
    (void)addr; (void)f;
    if (align == 0) align = 4096;
    void* m = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return ERR_OUT_OF_MEMORY;
    uintptr_t a = ((uintptr_t)m + align - 1) & ~(uintptr_t)(align - 1);
    *p = (CUdeviceptr)a;
    return OK;
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t size) { munmap((void*)p, size); return OK; }
CUresult cuMemCreate(CUmemGenericAllocationHandle* h, size_t size, const void* prop, unsigned long long f) {
    (void)prop; (void)f;
    int e = injected("cuMemCreate");
    if (e) return e;
    if (allocated + size > env_size("FAKE_CUDA_TOTAL", 1ull << 30)) return ERR_OUT_OF_MEMORY;
    for (size_t i = 1; i < MAXH; ++i) {
        if (handles[i].size) continue;
        int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, (off_t)size) != 0) return ERR_OUT_OF_MEMORY;
        handles[i].fd = fd;
        handles[i].size = size;
        allocated += size;
        ++live;
        *h = i;
        return OK;
    }
    return ERR_OUT_OF_MEMORY;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    if (h == 0 || h >= MAXH || !handles[h].size) return ERR_INVALID_VALUE;
    close(handles[h].fd);  /* live mappings keep the pages until unmapped */
    allocated -= handles[h].size;
    handles[h].size = 0;
    --live;
    return OK;
}
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t off, CUmemGenericAllocationHandle h, unsigned long long f) {
    (void)f;
    int e = injected("cuMemMap");
    if (e) return e;
    if (h == 0 || h >= MAXH || !handles[h].size || off + size > handles[h].size) return ERR_INVALID_VALUE;
    void* m = mmap((void*)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handles[h].fd, (off_t)off);
    return m == MAP_FAILED ? ERR_INVALID_VALUE : OK;
}
CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
    int e = injected("cuMemUnmap");
    if (e) return e;
    void* m = mmap((void*)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return m == MAP_FAILED ? ERR_INVALID_VALUE : OK;
}
typedef struct { int type; int id; } Loc;
typedef struct { Loc location; int flags; } AccessDesc;
CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const AccessDesc* d, size_t n) {
    int e = injected("cuMemSetAccess");
    if (e) return e;
    if (n < 1) return ERR_INVALID_VALUE;
    int prot = d->flags == 3 ? PROT_READ | PROT_WRITE : d->flags == 1 ? PROT_READ : PROT_NONE;
    return mprotect((void*)p, size, prot) == 0 ? OK : ERR_INVALID_VALUE;
}

static const struct { const char* name; void* fn; } table[] = {
    {"cuInit", (void*)cuInit}, {"cuGetErrorString", (void*)cuGetErrorString},
    {"cuDeviceGet", (void*)cuDeviceGet}, {"cuDevicePrimaryCtxRetain", (void*)cuDevicePrimaryCtxRetain},
    {"cuCtxSetCurrent", (void*)cuCtxSetCurrent}, {"cuMemGetInfo", (void*)cuMemGetInfo},
    {"cuMemGetAllocationGranularity", (void*)cuMemGetAllocationGranularity},
    {"cuMemAddressReserve", (void*)cuMemAddressReserve}, {"cuMemAddressFree", (void*)cuMemAddressFree},
    {"cuMemCreate", (void*)cuMemCreate}, {"cuMemRelease", (void*)cuMemRelease}, {"cuMemMap", (void*)cuMemMap},
    {"cuMemUnmap", (void*)cuMemUnmap}, {"cuMemSetAccess", (void*)cuMemSetAccess},
};

CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int ver, unsigned long long flags, int* status) {
    (void)ver; (void)flags;
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); ++i) {
        if (strcmp(symbol, table[i].name) == 0) {
            *pfn = table[i].fn;
            if (status) *status = 0;
            return OK;
        }
    }
    *pfn = NULL;
    if (status) *status = 1;
    return ERR_NOT_FOUND;
}
