"""The HTTP front of ``kvpool metrics --listen``: ``GET /metrics`` and nothing else.

Why not prometheus_client's ``start_http_server`` (round 3, metrics_listen.py):
it starts one thread per connection and never times a connection out, so 400
idle connections held open by anyone who can reach the port held 402 threads
for as long as they liked, and it answered 200 with the metrics on every path
(``/foo``, ``/../../etc/passwd``). An exporter is scraped by one Prometheus
every few seconds; it needs none of that.

So: one asyncio loop in one thread. A connection costs a few KiB, not a
thread; it has :data:`HEAD_TIMEOUT_S` to send its request head (request line
and headers, at most :data:`HEAD_LIMIT` bytes), past which it is closed; at
most :data:`MAX_CONNECTIONS` are open at once, and one beyond that is closed
at once (Prometheus retries at its next interval). A scrape meanwhile is
answered as soon as its head arrives. Answers: 200 for ``GET``/``HEAD
/metrics`` (a query string is ignored, as Prometheus' own exporters do), 404
for any other path, 405 for another method, 400 for a head that is not
HTTP/1.x. Every answer closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

__all__ = ["HEAD_LIMIT", "HEAD_TIMEOUT_S", "MAX_CONNECTIONS", "serve"]

HEAD_TIMEOUT_S = 10.0
HEAD_LIMIT = 16 * 1024
MAX_CONNECTIONS = 512  # under the usual 1024 descriptors a process may open
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the Prometheus text format
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, str] | None:
    """(method, path) of a well-formed HTTP/1.x head, or None."""
    head = await reader.readuntil(b"\r\n\r\n")  # LimitOverrunError past the reader's limit
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None
    return parts[0], parts[1].split("?", 1)[0]


def _answer(status: int, body: bytes, *, head_only: bool = False, extra: str = "") -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: "
            f"{CONTENT_TYPE if status == 200 else 'text/plain; charset=utf-8'}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
    return head.encode() + (b"" if head_only else body)


async def serve(host: str, port: int, render: Callable[[], bytes],
                on_listening: Callable[[int], None]) -> None:
    """Serve ``render()`` on ``/metrics`` until cancelled; ``on_listening(port)``
    once the socket listens (OSError if it cannot)."""
    open_now = 0

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now
        open_now += 1
        try:
            if open_now > MAX_CONNECTIONS:
                return
            try:
                req = await asyncio.wait_for(_read_head(reader), HEAD_TIMEOUT_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return  # idle, cut off or oversized: closed without a word
            if req is None:
                writer.write(_answer(400, b"not an HTTP/1.x request\n"))
            elif req[0] not in ("GET", "HEAD"):
                writer.write(_answer(405, b"only GET and HEAD\n", extra="Allow: GET, HEAD\r\n"))
            elif req[1] != "/metrics":
                writer.write(_answer(404, b"kvpool serves /metrics only\n", head_only=req[0] == "HEAD"))
            else:
                writer.write(_answer(200, render(), head_only=req[0] == "HEAD"))
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.drain(), HEAD_TIMEOUT_S)
        finally:
            open_now -= 1
            writer.close()

    server = await asyncio.start_server(connection, host, port, limit=HEAD_LIMIT)
    async with server:
        on_listening(server.sockets[0].getsockname()[1])
        await server.serve_forever()
