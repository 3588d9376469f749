#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (under 5 minutes):
# build kvpool, run the GPU-marked tests against the real driver, and time
# commit/release per page against raw cuMemCreate + cuMemMap + cuMemSetAccess
# (and cuMemUnmap + cuMemRelease) in the same run. Output: gpu-check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVPOOL_VENV:-.venv-gpu}"
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# A CUDA torch: the machine's default wheel (do not pin the CPU build here).
"$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || "$PY" -m pip install -q torch
"$PY" -m pip install -q ".[test]"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
export KVPOOL_REAL_CUDA=1
"$VENV/bin/pytest" -q -m gpu tests/test_gpu.py -p no:cacheprovider
"$PY" - <<'PY'
import ctypes, json, time
import kvpool
from kvpool import Geometry, KVSpace

assert not kvpool.cuda_unavailable_reason(), kvpool.cuda_unavailable_reason()
cu = ctypes.CDLL("libcuda.so.1")
P, R, N = 2 << 20, 16, 200
g = Geometry(8, 2, 256 * 1024, 8 * N, page_bytes=P)   # 16 regions, 8 blocks a page
with KVSpace(g, device="cuda:0", reserve_thread=False, reserve=(0, 0)) as s:
    bpp = len(g.block_range(0))
    t0 = time.perf_counter()
    held = [s.alloc(bpp) for _ in range(N)]             # one commit each (R slices)
    t1 = time.perf_counter()
    for ids in held:
        s.free(ids)                                     # one release each
    t2 = time.perf_counter()

# Raw driver: the same R-slice commit of one R*P allocation, N times.
class Loc(ctypes.Structure): _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Loc),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", ctypes.c_ubyte * 8)]
class Access(ctypes.Structure): _fields_ = [("location", Loc), ("flags", ctypes.c_int)]
dev = ctypes.c_int(); ctx = ctypes.c_void_p()
cu.cuInit(0); cu.cuDeviceGet(ctypes.byref(dev), 0)
cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev); cu.cuCtxSetCurrent(ctx)
prop = Prop(); prop.type = 1; prop.location = Loc(1, 0)
acc = Access(Loc(1, 0), 3)
va = ctypes.c_uint64()
assert cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(R * N * P), ctypes.c_size_t(P), ctypes.c_uint64(0), ctypes.c_ulonglong(0)) == 0
hs = []
t3 = time.perf_counter()
for p in range(N):
    h = ctypes.c_uint64()
    assert cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(R * P), ctypes.byref(prop), ctypes.c_ulonglong(0)) == 0
    for r in range(R):
        a = ctypes.c_uint64(va.value + (r * N + p) * P)
        assert cu.cuMemMap(a, ctypes.c_size_t(P), ctypes.c_size_t(r * P), h, ctypes.c_ulonglong(0)) == 0
        assert cu.cuMemSetAccess(a, ctypes.c_size_t(P), ctypes.byref(acc), ctypes.c_size_t(1)) == 0
    hs.append(h)
t4 = time.perf_counter()
for p, h in enumerate(hs):
    for r in range(R):
        cu.cuMemUnmap(ctypes.c_uint64(va.value + (r * N + p) * P), ctypes.c_size_t(P))
    cu.cuMemRelease(h)
t5 = time.perf_counter()
cu.cuMemAddressFree(va, ctypes.c_size_t(R * N * P))
res = {"pages": N, "regions": R, "page_bytes": P,
       "kvpool_commit_us": (t1 - t0) / N * 1e6, "kvpool_release_us": (t2 - t1) / N * 1e6,
       "raw_commit_us": (t4 - t3) / N * 1e6, "raw_release_us": (t5 - t4) / N * 1e6}
res["commit_ratio"] = res["kvpool_commit_us"] / res["raw_commit_us"]
res["release_ratio"] = res["kvpool_release_us"] / res["raw_release_us"]
print(json.dumps(res, indent=1))
json.dump(res, open("gpu-check.json", "w"), indent=1)
PY
