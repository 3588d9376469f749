"""The benchmark programs that run inside the vLLM venv.

``python -m kvpool.bench._vllm_side PROGRAM CONFIG.json OUT.json``, started
by the harness (:func:`kvpool.bench._lib.run_vllm_side`) in a temporary
folder with the vLLM venv's interpreter, where ``scripts/vllm_venv.sh``
installed kvpool. Programs:

- ``peers``: vLLM's ``BlockPool`` round trip (caching off and on, and with
  the ids extracted) and its cost vs pool size, for ``kvpool bench peers``;
- ``blockpool``: ``KVPoolBlockPool`` (the plugin) against vLLM's
  ``BlockPool``, ``get_num_free_blocks`` and the bare ``KVSpace``, for
  ``kvpool bench engines``.

vLLM is imported inside each program, never at import time: the harness
itself never imports this module. The loops are :mod:`kvpool.bench._timing`'s,
the same that time the baselines in the harness's own process.
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

from ._timing import SyncBody, interleaved_ns, repeat_ns, roundtrip_loop

# BlockPool parameters this program knows how to fill (versions differ).
KNOWN = {"enable_kv_cache_events": False, "hash_block_size": 16, "block_size": 16, "num_single_type_managers": 1}


def _import_vllm() -> tuple[Any, Any, float]:
    t0 = time.perf_counter()
    import vllm
    from vllm.v1.core.block_pool import BlockPool

    return vllm, BlockPool, time.perf_counter() - t0


def _make_block_pool(block_pool: Any, usable: int, caching: bool) -> tuple[Any, dict[str, Any], str]:
    """A ``BlockPool`` with ``usable`` blocks besides its null block 0, its kwargs and signature."""
    sig = inspect.signature(block_pool.__init__)
    kwargs: dict[str, Any] = {}
    for name, p in list(sig.parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name == "num_gpu_blocks":
            kwargs[name] = usable + 1
        elif name == "enable_caching":
            kwargs[name] = caching
        elif name in KNOWN:
            kwargs[name] = KNOWN[name]
        elif p.default is p.empty:
            raise TypeError(f"BlockPool{sig} has a required parameter this benchmark does not know: {name}")
    pool = block_pool(**kwargs)
    if pool.get_num_free_blocks() != usable:
        raise RuntimeError(f"BlockPool({kwargs}) has {pool.get_num_free_blocks()} free blocks, expected {usable}")
    return pool, kwargs, str(sig)


def _checked(cfg: dict[str, Any], pool: Any, body: SyncBody, what: str,
             counters: Callable[[], Any] = lambda: None) -> dict[str, Any]:
    """``repeat_ns`` of ``body``, failing if the free-block count (or the page counters) moved."""
    free0, c0 = pool.get_num_free_blocks(), counters()
    res = repeat_ns(body, cfg["repeats"], cfg["target_s"])
    free1, c1 = pool.get_num_free_blocks(), counters()
    if free1 != free0:
        raise RuntimeError(f"{what}: free blocks moved while timing: {free0} -> {free1}")
    if c1 != c0:
        raise RuntimeError(f"{what}: pages were committed/released while timing: {c0} -> {c1}")
    return res


def _checked_together(cfg: dict[str, Any], pools: dict[str, Any], bodies: dict[str, SyncBody], what: str,
                      counters: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """:func:`_checked` for several contenders at once, their repeats interleaved."""
    before = {k: (pools[k].get_num_free_blocks(), counters[k]()) for k in bodies}
    res = interleaved_ns(bodies, cfg["repeats"], cfg["target_s"])
    for k in bodies:
        (free0, c0), free1, c1 = before[k], pools[k].get_num_free_blocks(), counters[k]()
        if free1 != free0:
            raise RuntimeError(f"{k} {what}: free blocks moved while timing: {free0} -> {free1}")
        if c1 != c0:
            raise RuntimeError(f"{k} {what}: pages were committed/released while timing: {c0} -> {c1}")
    return res


def _with_ids(pool: Any, n: int) -> SyncBody:
    """The round trip plus what an engine needs for its block table: the ids."""

    def body(iters: int) -> None:
        get, free = pool.get_new_blocks, pool.free_blocks
        for _ in range(iters):
            blocks = get(n)
            [b.block_id for b in blocks]
            free(blocks)

    return body


# ---------------------------------------------------------------- peers


def peers(cfg: dict[str, Any]) -> dict[str, Any]:
    vllm, block_pool, import_s = _import_vllm()
    out: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                           "vllm": getattr(vllm, "__version__", None),
                           "block_pool_file": inspect.getsourcefile(block_pool), "import_s": import_s,
                           "roundtrip": {}, "scale": {}, "kwargs": {}}
    for caching in (False, True):
        pool, kwargs, sig = _make_block_pool(block_pool, cfg["roundtrip_blocks"], caching)
        out["signature"], out["kwargs"][str(caching).lower()] = sig, kwargs
        cases: dict[str, Any] = {}
        for n in cfg["sizes"]:
            rt = roundtrip_loop(pool.get_new_blocks, pool.free_blocks, n)
            cases[str(n)] = {"plain": _checked(cfg, pool, rt, f"caching={caching} n={n}")}
            if not caching:
                cases[str(n)]["with_ids"] = _checked(cfg, pool, _with_ids(pool, n), f"with ids n={n}")
        out["roundtrip"]["caching_on" if caching else "caching_off"] = cases
        del pool
    for size in cfg["scale_sizes"]:
        t0 = time.perf_counter()
        pool, _, _ = _make_block_pool(block_pool, size, False)
        blocks = pool.get_new_blocks(size)
        held = cfg["held"][str(size)]  # by block id; vLLM's ids are 1..size (0 is its null block)
        pool.free_blocks([b for b in blocks if not held[b.block_id - 1]])
        kept = [b for b in blocks if held[b.block_id - 1]]
        del blocks
        setup_s = time.perf_counter() - t0
        res = _checked(cfg, pool, roundtrip_loop(pool.get_new_blocks, pool.free_blocks, cfg["scale_n"]),
                       f"scale {size}")
        res.update(num_blocks=size, used_blocks=len(kept), setup_s=setup_s)
        out["scale"][str(size)] = res
        pool.free_blocks(kept)
        del kept, pool
        gc.collect()
    return out


# ------------------------------------------------------------ blockpool


def _profile(body: SyncBody, iters: int, top: int) -> dict[str, Any]:
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    body(iters)
    pr.disable()
    st: dict[Any, Any] = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in st.values()) or 1e-12
    rows = sorted(st.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return {"iters": iters, "total_s": total, "top_by_tottime": [
        {"function": f"{os.path.basename(f)}:{line}({name})", "ncalls_per_roundtrip": nc / iters,
         "tottime_us_per_roundtrip": tt / iters * 1e6, "cumtime_us_per_roundtrip": ct / iters * 1e6,
         "share": tt / total}
        for (f, line, name), (_cc, nc, tt, ct, _callers) in rows]}


def blockpool(cfg: dict[str, Any]) -> dict[str, Any]:
    vllm, block_pool, import_s = _import_vllm()
    import kvpool
    import kvpool.adapters.vllm as kv_vllm
    from kvpool import Geometry, KVSpace, Pool
    from kvpool.adapters.vllm.block_pool import KVPoolBlockPool

    n_blocks, hash_size = cfg["num_gpu_blocks"], cfg["hash_block_size"]

    def make(kind: str, caching: bool, ledger: Pool) -> tuple[Any, KVSpace | None]:
        """(block pool, its space or None) as vLLM's KV cache coordinator would build it."""
        if kind == "vllm":
            return block_pool(n_blocks, caching, hash_size), None
        g = Geometry(cfg["num_layers"], 1, cfg["block_bytes"], n_blocks, page_bytes=cfg["page_bytes"])
        tenant = kind == "kvpool_tenant"
        space = KVSpace(g, null_block=True, reserve=(0, cfg["big_reserve"]), reserve_thread=False,
                        pool=ledger if tenant else None, name="bench-engines" if tenant else None)
        pool = KVPoolBlockPool(n_blocks, caching, hash_size, space=space)
        pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))  # every page committed, and kept so
        s = space.stats()
        if s.pages_free or s.pages_releasing or s.committed_bytes != s.num_pages * s.page_commit_bytes:
            raise RuntimeError(f"{kind}: not every page stayed committed after the warm-up: {s}")
        return pool, space

    def counters(space: KVSpace | None) -> Callable[[], Any]:
        return lambda: None if space is None else (space.stats().commits, space.stats().releases)

    def num_free(pool: Any) -> SyncBody:
        def body(iters: int) -> None:
            f = pool.get_num_free_blocks
            for _ in range(iters):
                f()
        return body

    adapter_dir = pathlib.Path(kv_vllm.__file__).parent
    out: dict[str, Any] = {
        "python": sys.version.split()[0], "executable": sys.executable, "vllm": getattr(vllm, "__version__", None),
        "kvpool": kvpool.__version__, "kvpool_file": kvpool.__file__, "import_s": import_s,
        "adapter_hashes": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(adapter_dir.glob("*.py"))},
        "roundtrip": {}, "num_free": {}, "kvspace": {}, "profile": {}}
    ledger = Pool(cfg["pool_name"], capacity=cfg["pool_capacity"])
    try:
        for caching in (False, True):
            key = "caching_on" if caching else "caching_off"
            # Every contender built first, then timed in turn (interleaved
            # repeats): a load change on the machine hits them alike.
            built = {kind: make(kind, caching, ledger) for kind in cfg["kinds"]}
            pools = {kind: pool for kind, (pool, _) in built.items()}
            c = {kind: counters(space) for kind, (_, space) in built.items()}
            per_n = {str(n): _checked_together(cfg, pools, {
                kind: roundtrip_loop(pool.get_new_blocks, pool.free_blocks, n) for kind, pool in pools.items()},
                f"{key} n={n}", c) for n in cfg["sizes"]}
            out["roundtrip"][key] = {kind: {n: per_n[n][kind] for n in per_n} for kind in pools}
            if not caching:
                out["num_free"] = _checked_together(cfg, pools, {kind: num_free(pool) for kind, pool in pools.items()},
                                                    "get_num_free_blocks", c)
                pool, space = built["kvpool"]
                if space is not None:
                    out["kvspace"] = {str(n): _checked(cfg, pool, roundtrip_loop(space.alloc, space.free, n),
                                                       f"kvspace n={n}", c["kvpool"]) for n in cfg["sizes"]}
                if cfg["profile"]:
                    for kind in ("vllm", "kvpool"):
                        out["profile"][kind] = {
                            str(n): _profile(roundtrip_loop(pools[kind].get_new_blocks, pools[kind].free_blocks, n),
                                             max(200, 20000 // n), cfg["profile_top"]) for n in cfg["sizes"]}
            for _, space in built.values():
                if space is not None:
                    space.close()
            del built, pools
    finally:
        Pool.remove(cfg["pool_name"])
    return out


PROGRAMS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"peers": peers, "blockpool": blockpool}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in PROGRAMS:
        print(f"usage: python -m kvpool.bench._vllm_side {{{','.join(PROGRAMS)}}} CONFIG.json OUT.json",
              file=sys.stderr)
        return 2
    cfg = json.loads(pathlib.Path(argv[1]).read_text())
    out = PROGRAMS[argv[0]](cfg)
    pathlib.Path(argv[2]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
