"""The ``kvpool`` command line.

``kvpool demo`` is the main job. For now it walks one engine's KV space
through a burst of requests on the CPU backend: blocks are allocated, K/V
are written through torch views, blocks are freed, and the committed
physical memory follows use. (The multi-engine demo replaces it.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import torch

from .geometry import MiB, Geometry
from .space import KVSpace


def _mib(n: int) -> str:
    return f"{n / MiB:8.1f} MiB"


def demo(args: argparse.Namespace) -> int:
    # A Llama-ish layer: 16-token blocks, 8 KV heads of dim 128 in bf16 -> 32 KiB.
    tokens, heads, dim = 16, 8, 128
    block_shape = (tokens, heads, dim)
    block_bytes = tokens * heads * dim * 2
    g = Geometry(args.layers, 2, block_bytes, args.blocks)
    rows: list[dict[str, object]] = []

    def report(event: str) -> None:
        st = space.stats()
        row = {
            "event": event,
            "used_blocks": st.used_blocks,
            "committed_bytes": st.committed_bytes,
            "memfd_bytes": space.allocated_bytes(),
            "reserve_pages": st.pages_reserve,
        }
        rows.append(row)
        if not args.json:
            print(f"{event:<34} {st.used_blocks:6d} blocks  committed {_mib(st.committed_bytes)}"
                  f"  (memfd {_mib(space.allocated_bytes())}, {st.pages_reserve} idle pages)")

    with KVSpace(g, reserve=(1, 2)) as space:
        if not args.json:
            print(f"KV space: {g.num_layers} layers x {g.num_kv_buffers} buffers, {g.blocks} blocks of "
                  f"{block_bytes // 1024} KiB; virtual {_mib(g.region_bytes * g.num_regions)}, "
                  f"{g.page_commit_bytes // MiB} MiB per page commit")
        space.settle(5)
        report("start (reserve thread warm)")
        views = space.tensors(torch.bfloat16, block_shape)
        gen = torch.Generator().manual_seed(0)
        requests = []
        t0 = time.perf_counter()
        for i in range(args.requests):
            n = int(torch.randint(4, 64, (1,), generator=gen))
            ids = space.alloc(n)
            idx = torch.from_numpy(ids)
            for layer in views:
                layer[0][idx] = float(i + 1)   # keys
                layer[1][idx] = -float(i + 1)  # values
            requests.append((i, ids))
        alloc_s = time.perf_counter() - t0
        report(f"{args.requests} requests admitted")
        # Every request reads back exactly what it wrote: no block was shared.
        for i, ids in requests:
            idx = torch.from_numpy(ids)
            for layer in views:
                if not (torch.all(layer[0][idx] == i + 1) and torch.all(layer[1][idx] == -(i + 1))):
                    print(f"error: request {i} lost its KV data", file=sys.stderr)
                    return 1
        for _, ids in requests[: len(requests) // 2]:
            space.free(ids)
        space.settle(5)
        report("half the requests finished")
        for _, ids in requests[len(requests) // 2 :]:
            space.free(ids)
        space.settle(5)
        report("all requests finished")
        space.set_reserve(0, 0)  # engine shutting down: keep nothing idle
        space.trim()
        space.settle(5)
        report("reserve 0 + trim()")
        if args.json:
            json.dump({"geometry": {"layers": g.num_layers, "blocks": g.blocks, "block_bytes": block_bytes},
                       "alloc_and_write_seconds": alloc_s, "steps": rows}, sys.stdout, indent=2)
            print()
        else:
            print(f"\nadmitted {args.requests} requests (alloc + K/V writes) in {alloc_s * 1e3:.1f} ms; "
                  "physical memory followed use and went back to the machine.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool", description="Elastic KV-cache allocator")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="walk one KV space through a burst of requests (CPU)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
