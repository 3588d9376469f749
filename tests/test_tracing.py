"""Structured traces: one event per request, with pool, tenant and request id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import anyio
import pytest

from kvpool import Geometry, KVCacheManager, bind_request, tracing

from .conftest import KiB

G = Geometry(1, 2, 4 * KiB, 32, page_bytes=16 * KiB)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_every_outcome_is_one_event_with_context_fields() -> None:
    with tracing.capture() as events:
        async with KVCacheManager(G, pool=None, name="engine-a", reserve=(0, 0), reserve_thread=False) as m:
            with bind_request("req-1"):
                ids = await m.alloc(20)  # 5 pages committed inline
            with bind_request("req-2"):
                with pytest.raises(TimeoutError):
                    await m.alloc(20, timeout=0.01)
            scope = anyio.CancelScope()

            async def cancelled() -> None:
                with scope, bind_request("req-3"):
                    await m.alloc(20)

            async def waiter() -> None:
                with bind_request("req-4"):
                    await m.alloc(16)

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancelled)
                for _ in range(10):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
                tg.start_soon(waiter)
                for _ in range(10):
                    await anyio.lowlevel.checkpoint()
                with bind_request("req-1"):
                    m.free(ids)
    by_name: dict[str, list[dict[str, object]]] = {}
    for e in events:
        assert e["pool"] == "-" and e["tenant"] == "engine-a"
        assert "request_id" in e
        by_name.setdefault(str(e["event"]), []).append(dict(e))
    granted = by_name["alloc.granted"]
    assert granted == [granted[0]] and granted[0]["n"] == 20 and granted[0]["request_id"] == "req-1"
    assert by_name["pages.committed"][0]["pages"] == 5
    (timeout,) = by_name["alloc.timeout"]
    assert timeout["request_id"] == "req-2" and timeout["n"] == 20
    (cancel,) = by_name["alloc.cancelled"]
    assert cancel["request_id"] == "req-3" and cancel["after_grant"] is False
    (waited,) = by_name["alloc.waited"]
    assert waited["request_id"] == "req-4" and float(waited["waited_ms"]) >= 0  # type: ignore[arg-type]
    (free,) = by_name["free"]
    assert free["n"] == 20 and free["request_id"] == "req-1"
    # One event per request, never per block: 20 blocks freed -> one free event.
    assert len(events) < 15


@pytest.mark.anyio
async def test_shortage_of_alloc_nowait_is_traced_with_numbers() -> None:
    with tracing.capture() as events:
        async with KVCacheManager(G, reserve_thread=False, reserve=(0, 0)) as m:
            await m.alloc(30)
            with pytest.raises(Exception):
                m.alloc_nowait(5)
    (short,) = [e for e in events if e["event"] == "alloc.shortage"]
    assert short["requested"] == 5 and short["available"] == 2


def test_json_output_with_kvpool_log_format(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = textwrap.dedent(
        """
        import asyncio
        from kvpool import Geometry, KVCacheManager, bind_request
        async def main():
            async with KVCacheManager(Geometry(1, 1, 4096, 8, page_bytes=16384), name="t") as m:
                with bind_request("r9"):
                    await m.alloc(2)
        asyncio.run(main())
        """
    )
    env = {"KVPOOL_LOG_FORMAT": "json", "KVPOOL_LOG_LEVEL": "debug", "PATH": "/usr/bin:/bin",
           "KVPOOL_POOL": os.environ["KVPOOL_POOL"]}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         cwd=tmp_path, check=True)
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    granted = [e for e in lines if e["event"] == "alloc.granted"]
    assert granted and granted[0]["request_id"] == "r9" and granted[0]["tenant"] == "t"
    assert granted[0]["level"] == "debug" and "timestamp" in granted[0]


def test_default_output_is_quiet_for_per_request_events(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = (
        "import asyncio\nfrom kvpool import Geometry, KVCacheManager\n"
        "async def main():\n"
        "    async with KVCacheManager(Geometry(1, 1, 4096, 8, page_bytes=16384)) as m:\n"
        "        await m.alloc(2)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "KVPOOL_POOL": os.environ["KVPOOL_POOL"]},
                         cwd=tmp_path, check=True)
    assert "alloc.granted" not in out.stderr
