"""One rank of a mirrored space, in its own process (run as a script, not collected).

argv: the RankHandle as JSON, the rank, the device. Attaches a RankMemory,
then answers one JSON line on stdout per JSON command line on stdin:
``stats`` (without waiting), ``sync``, ``fill``/``read`` a byte range of
the rank's memory (through its DLPack pointer), ``env`` (the fake CUDA driver reads its limits per call),
``violations`` (the fake driver's count of broken driver rules), ``close``.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any


def main() -> None:
    from kvpool import KVPoolError, RankHandle, RankMemory

    handle = RankHandle.from_dict(json.loads(sys.argv[1]))
    rank, device = int(sys.argv[2]), sys.argv[3]

    def reply(**kw: Any) -> None:
        print(json.dumps(kw), flush=True)

    try:
        mem = RankMemory(handle, rank, device=device)
    except (KVPoolError, ValueError) as e:
        reply(error=type(e).__name__, message=str(e))
        return
    # A real GPU's memory is not host-readable: torch reads and writes it
    # (tests/test_gpu.py); the fake driver's is host memory (ctypes).
    real_gpu = device != "cpu" and os.environ.get("KVPOOL_REAL_CUDA") == "1"
    reply(ok=True, pid=os.getpid(), **figures(mem))
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "stats":
            reply(**figures(mem))
        elif op == "sync":
            reply(synced=mem.sync(cmd.get("timeout", 60.0)), **figures(mem))
        elif op == "fill" and real_gpu:
            import torch

            mem.memory()[cmd["offset"]:cmd["offset"] + cmd["length"]].fill_(cmd["value"])
            torch.cuda.synchronize()
            reply(ok=True)
        elif op == "read" and real_gpu:
            t = mem.memory()[cmd["offset"]:cmd["offset"] + cmd["length"]]
            reply(values=sorted({int(v) for v in t.unique().cpu().tolist()}))
        elif op == "fill":
            ctypes.memset(address(mem) + cmd["offset"], cmd["value"], cmd["length"])
            reply(ok=True)
        elif op == "read":
            reply(values=sorted(set(ctypes.string_at(address(mem) + cmd["offset"], cmd["length"]))))
        elif op == "env":
            os.environ[cmd["name"]] = str(cmd["value"])
            reply(ok=True)
        elif op == "violations":
            lib = ctypes.CDLL(os.environ["KVPOOL_LIBCUDA"])
            lib.fake_cuda_violations.restype = ctypes.c_long
            reply(violations=int(lib.fake_cuda_violations()))
        elif op == "close":
            mem.close()
            reply(ok=True, **figures(mem))
            return


def address(mem: Any) -> int:
    """Data pointer of the rank's memory through its DLPack capsule (torch
    here has no CUDA to wrap the fake GPU's memory); checks the device."""

    class DLDevice(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice)]

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    capsule = mem._mem.memory()  # held while its DLTensor is read
    tensor = ctypes.cast(get(capsule, b"dltensor"), ctypes.POINTER(DLTensor)).contents
    expected = (1, 0) if mem.device == "cpu" else (2, int(mem.device.partition(":")[2]))
    assert (tensor.device.device_type, tensor.device.device_id) == expected, (tensor.device.device_type, expected)
    return int(tensor.data)


def figures(mem: Any) -> dict[str, Any]:
    s = mem.stats()
    return {"committed_pages": s.committed_pages, "allocated_bytes": s.allocated_bytes, "failures": s.failures,
            "last_error": s.last_error, "generation": s.generation}


if __name__ == "__main__":
    main()
