"""Structured traces through structlog: one event per request, never per block.

kvpool owns its logger (it does not reconfigure structlog for the host
application). Every event carries ``pool``, ``tenant`` and ``request_id``;
bind the request id around engine calls with :func:`bind_request`.

Output: human console lines on stderr by default, JSON lines with
``KVPOOL_LOG_FORMAT=json``. Level: ``KVPOOL_LOG_LEVEL`` (default
``warning``; per-request grants are ``debug``, waits/timeouts/limits ``info``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, MutableMapping
from typing import Any

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from . import _core

__all__ = ["DEBUG", "INFO", "bind_request", "capture", "configure", "enabled", "get_logger"]

DEBUG, INFO = 10, 20
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
# The level's one owner, native so the hot path's faces read it as a field:
# Python hot paths read ``state.level`` instead of calling enabled().
state = _core.native.TraceLevel()
_state = state


def enabled(level: int) -> bool:
    """Whether events of ``level`` are emitted: hot paths skip building them otherwise."""
    return bool(level >= _state.level)


def _filter_level(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    if _LEVELS.get(method, 20) < _state.level:
        raise structlog.DropEvent
    return event


def _default_request_id(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    event.setdefault("request_id", None)
    return event


def _renderer(fmt: str) -> Processor:
    if fmt == "json":
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer(colors=False)


# Mutated in place (never rebound): loggers created earlier see changes.
_PROCESSORS: list[Processor] = []


def configure(fmt: str | None = None, level: str | None = None) -> None:
    """(Re)read the output format and level (defaults from the environment)."""
    fmt = (fmt or os.environ.get("KVPOOL_LOG_FORMAT", "console")).lower()
    level = (level or os.environ.get("KVPOOL_LOG_LEVEL", "warning")).lower()
    if level not in _LEVELS:
        raise ValueError(f"KVPOOL_LOG_LEVEL must be one of {sorted(_LEVELS)}, got {level!r}")
    _state.level = _LEVELS[level]
    _PROCESSORS[:] = [
        _filter_level,
        structlog.contextvars.merge_contextvars,
        _default_request_id,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _renderer(fmt),
    ]


configure()


def get_logger(**context: Any) -> Any:
    """A kvpool logger bound to ``context`` (pool, tenant, ...)."""
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        processors=_PROCESSORS,
        wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
        cache_logger_on_first_use=False,
    ).bind(**context)


@contextlib.contextmanager
def bind_request(request_id: object, **more: Any) -> Iterator[None]:
    """Tag every kvpool event inside the block (this task only) with ``request_id``."""
    with structlog.contextvars.bound_contextvars(request_id=request_id, **more):
        yield


@contextlib.contextmanager
def capture() -> Iterator[list[MutableMapping[str, Any]]]:
    """Collect kvpool events (all levels) as dicts instead of printing them (tests)."""
    events: list[MutableMapping[str, Any]] = []

    def keep(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
        event["log_level"] = method
        events.append(dict(event))
        raise structlog.DropEvent

    saved, saved_level = list(_PROCESSORS), _state.level
    _PROCESSORS[:] = [structlog.contextvars.merge_contextvars, _default_request_id, keep]
    _state.level = 0
    try:
        yield events
    finally:
        _PROCESSORS[:] = saved
        _state.level = saved_level
