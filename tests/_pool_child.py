"""A tenant process for the pool tests (run as a script, not collected).

Does random alloc/free on a KVSpace in POOL until killed. Between operations
it honours a pause flag in a small shared file: when byte 0 is 1 it settles
its reserve thread, marks itself paused in byte 1+slot and waits, so the
parent can sample the ledger against real memory at a quiet moment. It
counts its operations in the same file (8 bytes at 8 + 8*index) so the
parent can check that survivors keep going while other tenants are killed.
"""

from __future__ import annotations

import mmap
import os
import random
import struct
import sys
import time

from kvpool import Geometry, KVSpace, Pool, PoolExhausted


def main() -> None:
    pool_name, index, ctl_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    g = Geometry(1, 2, 4096, 256, page_bytes=16384)
    fd = os.open(ctl_path, os.O_RDWR)
    ctl = mmap.mmap(fd, 64)
    rng = random.Random(os.getpid())
    # No commit before "ready": until then the parent cannot pause us, so we
    # must stay quiet; the reserve minimum is raised right after.
    space = KVSpace(g, pool=Pool(pool_name, create=False), name=f"t{index}-{os.getpid()}", reserve=(0, 2))
    held: list[list[int]] = []
    ops = 0
    print("ready", flush=True)
    space.set_reserve(1, 2)
    while True:
        if ctl[0] == 1:
            space.settle(60)
            ctl[1 + index] = 1
            while ctl[0] == 1:
                time.sleep(0.001)
            ctl[1 + index] = 0
        if held and rng.random() < 0.5:
            space.free(held.pop(rng.randrange(len(held))))
        else:
            try:
                held.append(space.alloc(rng.randint(1, 12)).tolist())
            except PoolExhausted:
                pass
        ops += 1
        struct.pack_into("<Q", ctl, 8 + 8 * index, ops)


if __name__ == "__main__":
    main()
