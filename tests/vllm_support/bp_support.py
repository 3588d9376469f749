"""What the vLLM block-pool checks share: the commit unit, the check registry and the helpers.

Imported by block_pool_checks.py (the script: run with the vLLM venv's
Python) and the check modules it loads; this directory is the script's, so
first on sys.path. Commit unit: 16 KiB pages x 1 region = 4 blocks of 4 KiB.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

from kvpool import Geometry, KVSpace, Pool, PoolExhausted
from kvpool.adapters.vllm import block_pool as bp
from kvpool.adapters.vllm.block_pool import KVPoolBlockPool

PAGE, BLOCK, N = 16384, 4096, 64
PER_PAGE = PAGE // BLOCK
CHECKS: dict[str, Callable[[str], None]] = {}  # name -> check, in the order they run


def check(fn: Callable[[str], None]) -> Callable[[str], None]:
    CHECKS[fn.__name__] = fn
    return fn


@contextmanager
def block_pool(pool_name: str, *, pages: int, caching: bool, tenant: str = "eng") -> Iterator[KVPoolBlockPool]:
    pool = Pool(pool_name, capacity=pages * PAGE)
    space = KVSpace(Geometry(1, 1, BLOCK, N, page_bytes=PAGE), null_block=True, pool=pool, name=tenant,
                    reserve_thread=False, reserve=(0, 0))
    try:
        yield KVPoolBlockPool(N, caching, 16, space=space)
    finally:
        space.close()


def cache(p: KVPoolBlockPool, block: object, tag: bytes) -> None:
    """Give ``block`` a prefix-cache hash, as cache_full_blocks does."""
    key = make_block_hash_with_group_id(BlockHash(tag), 0)
    p._insert_block_hash(key, block, num_tokens=16)


def cache_and_free(p: KVPoolBlockPool, n: int) -> list[object]:
    """Allocate ``n`` blocks, cache each under its id, free them: all evictable."""
    blocks = p.get_new_blocks(n)
    for blk in blocks:
        cache(p, blk, b"c%d" % blk.block_id)
    p.free_blocks(blocks)
    return blocks


def cached(p: KVPoolBlockPool, tag: bytes) -> object | None:
    got = p.get_cached_block(BlockHash(tag), [0])
    return got[0] if got else None


def other_space(p: KVPoolBlockPool, name: str = "other") -> KVSpace:
    return KVSpace(Geometry(1, 1, BLOCK, N, page_bytes=PAGE), pool=p.space.pool, name=name,
                   reserve_thread=False, reserve=(0, 0))


def wait_below_guarantee(other: KVSpace, n: int) -> None:
    """``other`` asks for ``n`` blocks, misses (the pool is full) and waits."""
    try:
        other.alloc(n)
    except PoolExhausted:
        pass
    else:
        raise AssertionError("the pool was expected to be full")
    other.report_waiting(1)


def waiting_of(p: KVPoolBlockPool) -> Callable[[], list[int]]:
    """The pool's WAITING column for this engine's tenant, as a reader sees it."""
    pool = p.space.pool
    assert pool is not None
    return lambda: [t.waiting for t in pool.tenants() if t.name == p.space.name]


def plugin_frames(fn: Callable[[], object]) -> list[str]:
    """The plugin's (adapters/vllm/block_pool.py) Python functions ``fn`` entered."""
    entered: list[str] = []

    def profile(frame: object, event: str, arg: object) -> None:
        code = frame.f_code  # type: ignore[attr-defined]
        if event == "call" and code.co_filename == bp.__file__:
            entered.append(code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return entered
