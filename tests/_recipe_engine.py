"""A stand-in for one vLLM server of docs/serving-several-models.md (run as a script, not collected).

    python _recipe_engine.py POOL TENANT PAGES

Joins POOL as TENANT the way the vLLM plugin does (one KV space, a tenant
name), allocates PAGES pages' worth of blocks, as a server does when
requests arrive, prints one JSON line with its committed bytes, and holds
them until its stdin closes; then it closes its space and exits.
"""

from __future__ import annotations

import json
import sys

from kvpool import Geometry, KVSpace, Pool

PAGE = 2 << 20
G = Geometry(1, 2, 64 << 10, 2048, page_bytes=PAGE)  # 32 blocks a page, 64 pages of virtual capacity


def main() -> None:
    pool, tenant, pages = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with KVSpace(G, pool=Pool(pool, create=False), name=tenant, reserve_thread=False, reserve=(0, 0)) as s:
        held = s.alloc(pages * (PAGE // G.block_bytes))
        print(json.dumps({"committed": s.stats().committed_bytes}), flush=True)
        sys.stdin.read()  # until the test closes our stdin
        s.free(held)


if __name__ == "__main__":
    main()
