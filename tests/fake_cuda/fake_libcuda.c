/* A fake libcuda.so.1 for kvpool's tests: the driver's virtual-memory entry
 * points over host memory (a memfd per physical allocation, mmap for maps,
 * mprotect for access), strict enough to reject what the real driver rejects
 * (issue 15). Not a CUDA driver: the contract kvpool's backend relies on.
 *
 * Rules it enforces (each breach returns the real driver's error *and* is
 * counted as a violation, so a test can assert none happened even where the
 * backend swallows an error):
 *   - cuInit first; cuMem* (except the granularity query), memset/memcpy,
 *     stream and sync calls need a context current on the *calling thread*
 *     (a per-thread context stack: cuCtxPush/Pop/SetCurrent/GetCurrent);
 *   - devices are ordinals 0..FAKE_CUDA_DEVICES-1 (default 2); CUdevice
 *     handles are not ordinals (handle = 100 + ordinal), so a backend that
 *     passes a handle where CUmemLocation.id wants an ordinal is caught;
 *     (FAKE_CUDA_HANDLES_ARE_ORDINALS=1 lifts this one rule, to see what else
 *     a backend breaks);
 *   - cuMemMap only onto reserved VA that is not mapped, aligned to the
 *     granularity, offset + size within the allocation; with
 *     FAKE_CUDA_MAP_OFFSET_ZERO=1 a non-zero offset is CUDA_ERROR_INVALID_VALUE
 *     (cuda.h: "currently must be zero"; not a violation: a probe may try it);
 *     with FAKE_CUDA_MAP_OFFSET_IGNORED=1 the offset is silently treated as 0
 *     (a driver that misapplies it: layers would alias);
 *   - cuMemUnmap of exactly one whole mapping (no sub-range, no range with
 *     holes, not several mappings at once); cuMemSetAccess only over whole
 *     mappings with no holes;
 *   - cuMemAddressFree only of a whole reservation with nothing mapped in it;
 *   - cuDevicePrimaryCtxRelease only of a retained context;
 *   - a cuMemUnmap while simulated kernels are in flight (fake_cuda_launch)
 *     and no cuCtxSynchronize since: the real symptom is error 700 later;
 *   - fresh allocations are filled with 0xA5 (the real driver does not
 *     promise zeros); cuMemsetD8Async on a stream runs only at the next
 *     cuStreamSynchronize / cuCtxSynchronize of that work (asynchronous).
 *
 * Test hooks (ctypes / dlsym): fake_cuda_fail(name, nth, code) makes the nth
 * next call of `name` return `code`; fake_cuda_allocated() bytes of live
 * physical allocations; fake_cuda_live_handles(); fake_cuda_mappings();
 * fake_cuda_violations() and fake_cuda_violation_text() (the last one);
 * fake_cuda_reset_violations(); fake_cuda_primary_refs(ordinal);
 * fake_cuda_calls(name) (calls so far, "" = all); fake_cuda_launch() (a
 * kernel in flight until the next cuCtxSynchronize).
 * Env: FAKE_CUDA_GRANULARITY (default 2 MiB), FAKE_CUDA_TOTAL (per device,
 * default 1 GiB), FAKE_CUDA_DEVICES, FAKE_CUDA_NO_VMM=1 (device lacks VMM).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
    OK = 0, ERR_INVALID_VALUE = 1, ERR_OUT_OF_MEMORY = 2, ERR_NOT_INITIALIZED = 3, ERR_INVALID_DEVICE = 101,
    ERR_INVALID_CONTEXT = 201, ERR_NOT_FOUND = 500, ERR_ILLEGAL_ADDRESS = 700, ERR_UNKNOWN = 999
};
enum { MAXDEV = 8, MAXH = 65536, MAXM = 1 << 17, MAXR = 256, MAXQ = 4096, MAXSTREAM = 64 };

typedef struct { int type; int id; } Loc;
typedef struct { int type; int handle_types; Loc location; void* win32; unsigned char flags[8]; } Prop;
typedef struct { Loc location; int flags; } AccessDesc;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static struct { int refs; } prim[MAXDEV];  /* primary contexts; CUcontext = &prim[d] */
static struct { int fd; size_t size; int dev; } handles[MAXH];
static struct { CUdeviceptr va; size_t size; CUmemGenericAllocationHandle h; int prot; } maps[MAXM];
static size_t nmaps;
static struct { CUdeviceptr va, raw; size_t size, raw_size; } resv[MAXR];
static struct { CUdeviceptr va; size_t n; unsigned char v; CUstream s; } queue[MAXQ];
static size_t nqueue;
static int streams[MAXSTREAM];
static size_t allocated[MAXDEV], live;
static int kernels_in_flight;
static long violations;
static char violation_text[512];
static char fail_name[64];
static int fail_nth, fail_code;
static struct { const char* name; long n; } calls[64];

static __thread CUcontext ctx_stack[32];
static __thread int ctx_depth;

/* ---- hooks ---- */
void fake_cuda_fail(const char* name, int nth, int code) {
    pthread_mutex_lock(&mu);
    strncpy(fail_name, name, sizeof(fail_name) - 1);
    fail_nth = nth;
    fail_code = code;
    pthread_mutex_unlock(&mu);
}
size_t fake_cuda_allocated(void) {
    size_t t = 0;
    for (int d = 0; d < MAXDEV; ++d) t += allocated[d];
    return t;
}
size_t fake_cuda_live_handles(void) { return live; }
size_t fake_cuda_mappings(void) { return nmaps; }
long fake_cuda_violations(void) { return violations; }
const char* fake_cuda_violation_text(void) { return violation_text; }
void fake_cuda_reset_violations(void) { violations = 0; violation_text[0] = 0; }
int fake_cuda_primary_refs(int ordinal) { return ordinal >= 0 && ordinal < MAXDEV ? prim[ordinal].refs : -1; }
void fake_cuda_launch(void) { kernels_in_flight = 1; }
long fake_cuda_calls(const char* name) {
    long t = 0;
    for (size_t i = 0; i < sizeof(calls) / sizeof(calls[0]) && calls[i].name; ++i)
        if (!*name || strcmp(calls[i].name, name) == 0) t += calls[i].n;
    return t;
}

/* ---- helpers (mu held) ---- */
static size_t env_size(const char* name, size_t dflt) {
    const char* v = getenv(name);
    return v && *v ? (size_t)strtoull(v, NULL, 10) : dflt;
}
static int ndev(void) {
    size_t n = env_size("FAKE_CUDA_DEVICES", 2);
    return n > MAXDEV ? MAXDEV : (int)n;
}
static size_t gran(void) { return env_size("FAKE_CUDA_GRANULARITY", 2u << 20); }
static int violation(int code, const char* fmt, unsigned long long a, unsigned long long b) {
    ++violations;
    snprintf(violation_text, sizeof(violation_text), fmt, a, b);
    return code;
}
static void count(const char* name) {
    for (size_t i = 0; i < sizeof(calls) / sizeof(calls[0]); ++i) {
        if (calls[i].name == NULL) calls[i].name = name;
        if (strcmp(calls[i].name, name) == 0) { ++calls[i].n; return; }
    }
}
/* Every entry point starts here: counts the call, applies an injected failure. */
static int enter(const char* name) {
    count(name);
    if (fail_nth > 0 && strcmp(name, fail_name) == 0 && --fail_nth == 0) return fail_code;
    return OK;
}
static int current_dev(void) {  /* -1: no context current on this thread */
    if (ctx_depth == 0 || ctx_stack[ctx_depth - 1] == NULL) return -1;
    return (int)((char*)ctx_stack[ctx_depth - 1] - (char*)prim) / (int)sizeof(prim[0]);
}
static int need_ctx(const char* name) {
    if (!initialized) return violation(ERR_NOT_INITIALIZED, "call before cuInit (%llx%llx)", 0, 0);
    int d = current_dev();
    if (d < 0 || prim[d].refs == 0) {
        ++violations;
        snprintf(violation_text, sizeof(violation_text), "%s without a current context on this thread", name);
        return ERR_INVALID_CONTEXT;
    }
    return OK;
}
static int handle_base(void) { return env_size("FAKE_CUDA_HANDLES_ARE_ORDINALS", 0) ? 0 : 100; }
static int valid_ordinal(int id) { return id >= 0 && id < ndev(); }
static int valid_ctx(CUcontext c) {
    for (int d = 0; d < ndev(); ++d)
        if (c == (CUcontext)&prim[d]) return prim[d].refs > 0;
    return 0;
}
static long find_map(CUdeviceptr va) {
    for (size_t i = 0; i < nmaps; ++i)
        if (maps[i].va == va) return (long)i;
    return -1;
}
static int overlaps_mapping(CUdeviceptr va, size_t n) {
    for (size_t i = 0; i < nmaps; ++i)
        if (va < maps[i].va + maps[i].size && maps[i].va < va + n) return 1;
    return 0;
}
static int in_reservation(CUdeviceptr va, size_t n) {
    for (int i = 0; i < MAXR; ++i)
        if (resv[i].size && va >= resv[i].va && va + n <= resv[i].va + resv[i].size) return 1;
    return 0;
}
/* [va, va+n) is exactly a run of whole mappings, no holes: returns how many. */
static long whole_mappings(CUdeviceptr va, size_t n) {
    long k = 0;
    for (CUdeviceptr p = va; p < va + n; ++k) {
        long i = find_map(p);
        if (i < 0 || maps[i].va + maps[i].size > va + n) return -1;
        p += maps[i].size;
    }
    return n == 0 ? -1 : k;
}
static int accessible(CUdeviceptr va, size_t n, int prot) {
    for (CUdeviceptr p = va; p < va + n;) {
        long i = -1;
        for (size_t j = 0; j < nmaps; ++j)
            if (p >= maps[j].va && p < maps[j].va + maps[j].size) { i = (long)j; break; }
        if (i < 0 || (maps[i].prot & prot) != prot) return 0;
        p = maps[i].va + maps[i].size;
    }
    return 1;
}
static void run_queue(CUstream s, int all) {
    size_t keep = 0;
    for (size_t i = 0; i < nqueue; ++i) {
        if (all || queue[i].s == s) memset((void*)queue[i].va, queue[i].v, queue[i].n);
        else queue[keep++] = queue[i];
    }
    nqueue = keep;
}

#define LOCKED(expr)                  \
    do {                              \
        pthread_mutex_lock(&mu);      \
        CUresult r_ = (expr);         \
        pthread_mutex_unlock(&mu);    \
        return r_;                    \
    } while (0)

/* ---- entry points ---- */
static CUresult do_init(void) {
    int e = enter("cuInit");
    if (!e) initialized = 1;
    return e;
}
CUresult cuInit(unsigned int flags) { (void)flags; LOCKED(do_init()); }
CUresult cuGetErrorString(CUresult e, const char** s) {
    switch (e) {
        case ERR_OUT_OF_MEMORY: *s = "out of memory (fake)"; break;
        case ERR_INVALID_VALUE: *s = "invalid argument (fake)"; break;
        case ERR_INVALID_CONTEXT: *s = "invalid device context (fake)"; break;
        case ERR_INVALID_DEVICE: *s = "invalid device ordinal (fake)"; break;
        case ERR_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered (fake)"; break;
        default: *s = "unknown error (fake)";
    }
    return OK;
}
static CUresult do_device_get(CUdevice* d, int ordinal) {
    int e = enter("cuDeviceGet");
    if (e) return e;
    if (!initialized) return ERR_NOT_INITIALIZED;
    if (!valid_ordinal(ordinal)) return ERR_INVALID_DEVICE;
    *d = handle_base() + ordinal;
    return OK;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) { LOCKED(do_device_get(d, ordinal)); }
static CUresult do_device_attr(int* v, int attr, CUdevice d) {
    int e = enter("cuDeviceGetAttribute");
    if (e) return e;
    if (!valid_ordinal(d - handle_base())) return violation(ERR_INVALID_DEVICE, "bad CUdevice %llu%.0llu", (unsigned)d, 0);
    *v = attr == 102 ? !env_size("FAKE_CUDA_NO_VMM", 0) : 0;  /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    return OK;
}
CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) { LOCKED(do_device_attr(v, attr, d)); }
static CUresult do_retain(CUcontext* c, CUdevice d) {
    int e = enter("cuDevicePrimaryCtxRetain");
    if (e) return e;
    if (!valid_ordinal(d - handle_base())) return violation(ERR_INVALID_DEVICE, "retain with bad CUdevice %llu%.0llu", (unsigned)d, 0);
    ++prim[d - handle_base()].refs;
    *c = (CUcontext)&prim[d - handle_base()];
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) { LOCKED(do_retain(c, d)); }
static CUresult do_release_ctx(CUdevice d) {
    int e = enter("cuDevicePrimaryCtxRelease");
    if (e) return e;
    if (!valid_ordinal(d - handle_base())) return violation(ERR_INVALID_DEVICE, "release with bad CUdevice %llu%.0llu", (unsigned)d, 0);
    if (prim[d - handle_base()].refs == 0) return violation(ERR_INVALID_CONTEXT, "primary context %llu released more than retained%.0llu", (unsigned)(d - handle_base()), 0);
    --prim[d - handle_base()].refs;
    return OK;
}
CUresult cuDevicePrimaryCtxRelease(CUdevice d) { LOCKED(do_release_ctx(d)); }
static CUresult do_set_current(CUcontext c) {
    int e = enter("cuCtxSetCurrent");
    if (e) return e;
    if (c == NULL) { if (ctx_depth > 0) --ctx_depth; return OK; }
    if (!valid_ctx(c)) return ERR_INVALID_CONTEXT;
    if (ctx_depth == 0) ctx_depth = 1;
    ctx_stack[ctx_depth - 1] = c;
    return OK;
}
CUresult cuCtxSetCurrent(CUcontext c) { LOCKED(do_set_current(c)); }
static CUresult do_push(CUcontext c) {
    int e = enter("cuCtxPushCurrent");
    if (e) return e;
    if (!valid_ctx(c) || ctx_depth == 32) return ERR_INVALID_CONTEXT;
    ctx_stack[ctx_depth++] = c;
    return OK;
}
CUresult cuCtxPushCurrent(CUcontext c) { LOCKED(do_push(c)); }
static CUresult do_pop(CUcontext* c) {
    int e = enter("cuCtxPopCurrent");
    if (e) return e;
    if (ctx_depth == 0) return violation(ERR_INVALID_CONTEXT, "pop of an empty context stack%.0llu%.0llu", 0, 0);
    --ctx_depth;
    if (c) *c = ctx_stack[ctx_depth];
    return OK;
}
CUresult cuCtxPopCurrent(CUcontext* c) { LOCKED(do_pop(c)); }
CUresult cuCtxGetCurrent(CUcontext* c) {
    *c = ctx_depth ? ctx_stack[ctx_depth - 1] : NULL;
    return OK;
}
static CUresult do_ctx_sync(void) {
    int e = enter("cuCtxSynchronize");
    if (e || (e = need_ctx("cuCtxSynchronize"))) return e;
    run_queue(NULL, 1);
    kernels_in_flight = 0;
    return OK;
}
CUresult cuCtxSynchronize(void) { LOCKED(do_ctx_sync()); }
static CUresult do_stream_create(CUstream* s, unsigned int flags) {
    (void)flags;
    int e = enter("cuStreamCreate");
    if (e || (e = need_ctx("cuStreamCreate"))) return e;
    for (int i = 0; i < MAXSTREAM; ++i)
        if (!streams[i]) { streams[i] = 1; *s = (CUstream)&streams[i]; return OK; }
    return ERR_OUT_OF_MEMORY;
}
CUresult cuStreamCreate(CUstream* s, unsigned int flags) { LOCKED(do_stream_create(s, flags)); }
static int valid_stream(CUstream s) {
    for (int i = 0; i < MAXSTREAM; ++i)
        if (s == (CUstream)&streams[i]) return streams[i];
    return 0;
}
static CUresult do_stream_destroy(CUstream s) {
    int e = enter("cuStreamDestroy");
    if (e || (e = need_ctx("cuStreamDestroy"))) return e;
    if (!valid_stream(s)) return violation(ERR_INVALID_VALUE, "destroy of an unknown stream%.0llu%.0llu", 0, 0);
    run_queue(s, 0);
    *(int*)s = 0;
    return OK;
}
CUresult cuStreamDestroy(CUstream s) { LOCKED(do_stream_destroy(s)); }
static CUresult do_stream_sync(CUstream s) {
    int e = enter("cuStreamSynchronize");
    if (e || (e = need_ctx("cuStreamSynchronize"))) return e;
    if (s != NULL && !valid_stream(s)) return violation(ERR_INVALID_VALUE, "sync of an unknown stream%.0llu%.0llu", 0, 0);
    run_queue(s, s == NULL);
    return OK;
}
CUresult cuStreamSynchronize(CUstream s) { LOCKED(do_stream_sync(s)); }
static CUresult do_mem_info(size_t* free_b, size_t* total) {
    int e = enter("cuMemGetInfo");
    if (e || (e = need_ctx("cuMemGetInfo"))) return e;
    int d = current_dev();
    *total = env_size("FAKE_CUDA_TOTAL", 1ull << 30);
    *free_b = *total > allocated[d] ? *total - allocated[d] : 0;
    return OK;
}
CUresult cuMemGetInfo(size_t* free_b, size_t* total) { LOCKED(do_mem_info(free_b, total)); }
static CUresult do_granularity(size_t* g, const Prop* prop, int option) {
    (void)option;
    int e = enter("cuMemGetAllocationGranularity");
    if (e) return e;
    if (!initialized) return ERR_NOT_INITIALIZED;
    if (!valid_ordinal(prop->location.id))
        return violation(ERR_INVALID_DEVICE, "granularity: location.id %llu is not a device ordinal%.0llu",
                         (unsigned)prop->location.id, 0);
    *g = gran();
    return OK;
}
CUresult cuMemGetAllocationGranularity(size_t* g, const Prop* prop, int option) {
    LOCKED(do_granularity(g, prop, option));
}
static CUresult do_reserve(CUdeviceptr* p, size_t size, size_t align) {
    int e = enter("cuMemAddressReserve");
    if (e || (e = need_ctx("cuMemAddressReserve"))) return e;
    if (size == 0 || size % gran()) return ERR_INVALID_VALUE;
    if (align == 0) align = gran();
    for (int i = 0; i < MAXR; ++i) {
        if (resv[i].size) continue;
        void* m = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return ERR_OUT_OF_MEMORY;
        uintptr_t a = ((uintptr_t)m + align - 1) & ~(uintptr_t)(align - 1);
        resv[i].raw = (CUdeviceptr)(uintptr_t)m;
        resv[i].raw_size = size + align;
        resv[i].va = a;
        resv[i].size = size;
        *p = a;
        return OK;
    }
    return ERR_OUT_OF_MEMORY;
}
CUresult cuMemAddressReserve(CUdeviceptr* p, size_t size, size_t align, CUdeviceptr addr, unsigned long long f) {
    (void)addr; (void)f;
    LOCKED(do_reserve(p, size, align));
}
static CUresult do_address_free(CUdeviceptr p, size_t size) {
    int e = enter("cuMemAddressFree");
    if (e || (e = need_ctx("cuMemAddressFree"))) return e;
    for (int i = 0; i < MAXR; ++i) {
        if (!resv[i].size || resv[i].va != p) continue;
        if (resv[i].size != size) return violation(ERR_INVALID_VALUE, "cuMemAddressFree size %llu != %llu", size, resv[i].size);
        if (overlaps_mapping(p, size)) return violation(ERR_INVALID_VALUE, "cuMemAddressFree of %llx with mappings inside%.0llu", p, 0);
        munmap((void*)(uintptr_t)resv[i].raw, resv[i].raw_size);
        resv[i].size = 0;
        return OK;
    }
    return violation(ERR_INVALID_VALUE, "cuMemAddressFree of %llx: not a reservation%.0llu", p, 0);
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t size) { LOCKED(do_address_free(p, size)); }
static CUresult do_create(CUmemGenericAllocationHandle* h, size_t size, const Prop* prop) {
    int e = enter("cuMemCreate");
    if (e || (e = need_ctx("cuMemCreate"))) return e;
    if (!valid_ordinal(prop->location.id))
        return violation(ERR_INVALID_DEVICE, "cuMemCreate: location.id %llu is not a device ordinal%.0llu",
                         (unsigned)prop->location.id, 0);
    const int d = prop->location.id;
    if (size == 0 || size % gran()) return ERR_INVALID_VALUE;
    if (allocated[d] + size > env_size("FAKE_CUDA_TOTAL", 1ull << 30)) return ERR_OUT_OF_MEMORY;
    for (size_t i = 1; i < MAXH; ++i) {
        if (handles[i].size) continue;
        int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, (off_t)size) != 0) return ERR_OUT_OF_MEMORY;
        /* Fresh device memory holds whatever was there before: never zeros. */
        void* m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED) { close(fd); return ERR_OUT_OF_MEMORY; }
        memset(m, 0xA5, size);
        munmap(m, size);
        handles[i].fd = fd;
        handles[i].size = size;
        handles[i].dev = d;
        allocated[d] += size;
        ++live;
        *h = i;
        return OK;
    }
    return ERR_OUT_OF_MEMORY;
}
CUresult cuMemCreate(CUmemGenericAllocationHandle* h, size_t size, const Prop* prop, unsigned long long f) {
    (void)f;
    LOCKED(do_create(h, size, prop));
}
static CUresult do_release(CUmemGenericAllocationHandle h) {
    int e = enter("cuMemRelease");
    if (e || (e = need_ctx("cuMemRelease"))) return e;
    if (h == 0 || h >= MAXH || !handles[h].size) return violation(ERR_INVALID_VALUE, "cuMemRelease of unknown handle %llu%.0llu", h, 0);
    close(handles[h].fd); /* live mappings keep the pages until unmapped */
    allocated[handles[h].dev] -= handles[h].size;
    handles[h].size = 0;
    --live;
    return OK;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) { LOCKED(do_release(h)); }
static CUresult do_map(CUdeviceptr p, size_t size, size_t off, CUmemGenericAllocationHandle h, unsigned long long f) {
    int e = enter("cuMemMap");
    if (e || (e = need_ctx("cuMemMap"))) return e;
    if (f != 0 || h == 0 || h >= MAXH || !handles[h].size || off + size > handles[h].size || size == 0 ||
        p % gran() || size % gran() || off % gran())
        return violation(ERR_INVALID_VALUE, "cuMemMap at %llx: bad handle, size or alignment (offset %llu)", p, off);
    if (off != 0 && env_size("FAKE_CUDA_MAP_OFFSET_ZERO", 0)) return ERR_INVALID_VALUE; /* "currently must be zero" */
    if (!in_reservation(p, size)) return violation(ERR_INVALID_VALUE, "cuMemMap at %llx: outside any reservation (%llu bytes)", p, size);
    if (overlaps_mapping(p, size)) return violation(ERR_INVALID_VALUE, "cuMemMap over mapped VA at %llx (%llu bytes)", p, size);
    if (nmaps == MAXM) return ERR_OUT_OF_MEMORY;
    const size_t real_off = env_size("FAKE_CUDA_MAP_OFFSET_IGNORED", 0) ? 0 : off;
    void* m = mmap((void*)(uintptr_t)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handles[h].fd, (off_t)real_off);
    if (m == MAP_FAILED) return ERR_OUT_OF_MEMORY;
    maps[nmaps].va = p;
    maps[nmaps].size = size;
    maps[nmaps].h = h;
    maps[nmaps].prot = 0;
    ++nmaps;
    return OK;
}
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t off, CUmemGenericAllocationHandle h, unsigned long long f) {
    LOCKED(do_map(p, size, off, h, f));
}
static CUresult do_unmap(CUdeviceptr p, size_t size) {
    int e = enter("cuMemUnmap");
    if (e || (e = need_ctx("cuMemUnmap"))) return e;
    /* "The range must be the entire contiguous address range that was mapped
     * to": one whole mapping, not a sub-range, not several at once. */
    if (whole_mappings(p, size) != 1)
        return violation(ERR_INVALID_VALUE, "cuMemUnmap of %llx (+%llu): not exactly one whole mapping", p, size);
    if (kernels_in_flight)
        violation(OK, "cuMemUnmap of %llx (+%llu) while kernels may still read it (no fence)", p, size);
    void* m = mmap((void*)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return ERR_UNKNOWN;
    size_t keep = 0;
    for (size_t i = 0; i < nmaps; ++i)
        if (!(maps[i].va >= p && maps[i].va < p + size)) maps[keep++] = maps[i];
    nmaps = keep;
    return OK;
}
CUresult cuMemUnmap(CUdeviceptr p, size_t size) { LOCKED(do_unmap(p, size)); }
static CUresult do_set_access(CUdeviceptr p, size_t size, const AccessDesc* d, size_t n) {
    int e = enter("cuMemSetAccess");
    if (e || (e = need_ctx("cuMemSetAccess"))) return e;
    if (n < 1 || !valid_ordinal(d->location.id))
        return violation(ERR_INVALID_DEVICE, "cuMemSetAccess: location.id %llu is not a device ordinal%.0llu",
                         (unsigned)d->location.id, 0);
    if (whole_mappings(p, size) < 0)
        return violation(ERR_INVALID_VALUE, "cuMemSetAccess on %llx (+%llu): not a fully mapped range", p, size);
    int prot = d->flags == 3 ? PROT_READ | PROT_WRITE : d->flags == 1 ? PROT_READ : PROT_NONE;
    if (mprotect((void*)(uintptr_t)p, size, prot) != 0) return ERR_OUT_OF_MEMORY;
    for (size_t i = 0; i < nmaps; ++i)
        if (maps[i].va >= p && maps[i].va < p + size) maps[i].prot = prot;
    return OK;
}
CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const AccessDesc* d, size_t n) {
    LOCKED(do_set_access(p, size, d, n));
}
static CUresult do_memset_async(CUdeviceptr p, unsigned char v, size_t n, CUstream s, const char* name) {
    int e = enter(name);
    if (e || (e = need_ctx(name))) return e;
    if (!accessible(p, n, PROT_READ | PROT_WRITE))
        return violation(ERR_ILLEGAL_ADDRESS, "memset of %llx (+%llu): not mapped read-write", p, n);
    if (s == NULL) { memset((void*)(uintptr_t)p, v, n); return OK; }
    if (!valid_stream(s)) return violation(ERR_INVALID_VALUE, "memset on an unknown stream%.0llu%.0llu", 0, 0);
    if (nqueue == MAXQ) run_queue(NULL, 1);
    queue[nqueue].va = p;
    queue[nqueue].n = n;
    queue[nqueue].v = v;
    queue[nqueue].s = s;
    ++nqueue;
    return OK;
}
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
    LOCKED(do_memset_async(p, v, n, s, "cuMemsetD8Async"));
}
CUresult cuMemsetD8(CUdeviceptr p, unsigned char v, size_t n) { LOCKED(do_memset_async(p, v, n, NULL, "cuMemsetD8")); }
static CUresult do_dtoh(void* dst, CUdeviceptr src, size_t n) {
    int e = enter("cuMemcpyDtoH");
    if (e || (e = need_ctx("cuMemcpyDtoH"))) return e;
    if (!accessible(src, n, PROT_READ)) return violation(ERR_ILLEGAL_ADDRESS, "copy from %llx (+%llu): not readable", src, n);
    run_queue(NULL, 1); /* synchronous: the legacy stream waits for earlier work */
    memcpy(dst, (void*)(uintptr_t)src, n);
    return OK;
}
CUresult cuMemcpyDtoH(void* dst, CUdeviceptr src, size_t n) { LOCKED(do_dtoh(dst, src, n)); }

static const struct { const char* name; void* fn; } table[] = {
    {"cuInit", (void*)cuInit}, {"cuGetErrorString", (void*)cuGetErrorString},
    {"cuDeviceGet", (void*)cuDeviceGet}, {"cuDeviceGetAttribute", (void*)cuDeviceGetAttribute},
    {"cuDevicePrimaryCtxRetain", (void*)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", (void*)cuDevicePrimaryCtxRelease},
    {"cuCtxSetCurrent", (void*)cuCtxSetCurrent}, {"cuCtxGetCurrent", (void*)cuCtxGetCurrent},
    {"cuCtxPushCurrent", (void*)cuCtxPushCurrent}, {"cuCtxPopCurrent", (void*)cuCtxPopCurrent},
    {"cuCtxSynchronize", (void*)cuCtxSynchronize}, {"cuStreamCreate", (void*)cuStreamCreate},
    {"cuStreamDestroy", (void*)cuStreamDestroy}, {"cuStreamSynchronize", (void*)cuStreamSynchronize},
    {"cuMemGetInfo", (void*)cuMemGetInfo},
    {"cuMemGetAllocationGranularity", (void*)cuMemGetAllocationGranularity},
    {"cuMemAddressReserve", (void*)cuMemAddressReserve}, {"cuMemAddressFree", (void*)cuMemAddressFree},
    {"cuMemCreate", (void*)cuMemCreate}, {"cuMemRelease", (void*)cuMemRelease}, {"cuMemMap", (void*)cuMemMap},
    {"cuMemUnmap", (void*)cuMemUnmap}, {"cuMemSetAccess", (void*)cuMemSetAccess},
    {"cuMemsetD8Async", (void*)cuMemsetD8Async}, {"cuMemsetD8", (void*)cuMemsetD8},
    {"cuMemcpyDtoH", (void*)cuMemcpyDtoH},
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
