"""Prometheus metrics of the pools on this host, read from their ledgers.

``kvpool metrics POOL`` prints the text exposition once; ``--listen
HOST:PORT`` serves it on ``/metrics``. Each scrape reads the ledgers anew
(a pool made after start-up shows up, a removed one drops out), so the
exporter holds no state and needs no tenant to call it: it is one more
reader of the shared ledger, like ``kvpool top``. It never imports torch.

Series (gauges unless named ``_total``; labels ``pool`` and, per tenant,
``tenant``)::

    kvpool_pool_capacity_bytes{pool}           the pool's budget
    kvpool_pool_committed_bytes{pool}          committed by its live tenants together
    kvpool_pool_tenants{pool}                  live tenants
    kvpool_tenant_info{pool,tenant,pid,slot}   1 per live tenant: which process serves it
    kvpool_tenant_committed_bytes{pool,tenant} ... one line per row of TENANT_METRICS
    kvpool_tenant_allocs_total{pool,tenant}    counters: allocs granted, and refused
    kvpool_tenant_shortages_total{pool,tenant}   (``rate()`` of the second: a starved server)

A tenant attribute that is ``None`` (no limit set) or that this ledger does
not have gives no sample: an absent series, not a made-up zero. Booleans
(``lending``) are 0 or 1. The counters are the tenant's own (its slot in the
ledger, counted by the engine as it answers each alloc): they start at 0 when
the tenant joins and go with it, which Prometheus reads as a counter reset.
Adding a per-tenant figure is one row in :data:`TENANT_METRICS`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from .errors import KVPoolError
from .pool import Pool, TenantInfo, list_pools

__all__ = ["TENANT_METRICS", "PoolCollector", "registry", "exposition"]


@dataclass(frozen=True)
class Figure:
    """One series: its name, its help text, the attribute it reads, and its type.

    A counter's name ends in ``_total`` (Prometheus's convention; the
    exposition's family name is the name without it).
    """

    name: str
    help: str
    attribute: str
    kind: Literal["gauge", "counter"] = "gauge"


# One row per per-tenant series, read with getattr(TenantInfo, attribute, None).
TENANT_METRICS: tuple[Figure, ...] = (
    Figure("kvpool_tenant_committed_bytes", "Physical memory the tenant has committed.", "committed_bytes"),
    Figure("kvpool_tenant_limit_bytes", "The tenant's cap on committed memory (absent: no limit).",
           "limit_bytes"),
    Figure("kvpool_tenant_guarantee_bytes", "Memory the tenant can always get back.", "guarantee_bytes"),
    Figure("kvpool_tenant_borrowed_bytes", "Committed memory above the tenant's guarantee.", "borrowed_bytes"),
    Figure("kvpool_tenant_wanted_bytes", "What the tenant's waiting requests need beyond what it holds.",
           "want_bytes"),
    Figure("kvpool_tenant_keep_free_bytes", "Of the tenant's unused guarantee, what borrowers must leave free "
           "(its headroom).", "keep_free_bytes"),
    Figure("kvpool_tenant_lending", "1 while the tenant gives memory back to a tenant below its guarantee.",
           "lending"),
    Figure("kvpool_tenant_limit_revision", "Revision of the tenant's current limit.", "limit_revision"),
    Figure("kvpool_tenant_limit_deferred", "1 while the tenant's use is above its new limit.", "limit_deferred"),
    Figure("kvpool_tenant_waiting_requests", "Allocations waiting for memory.", "waiting"),
    Figure("kvpool_tenant_idle_pages", "Committed idle pages kept ready (the reserve).", "reserve_pages"),
    Figure("kvpool_tenant_allocs_total", "Allocations granted to the tenant since it joined.", "allocs",
           "counter"),
    Figure("kvpool_tenant_shortages_total", "Allocations refused for lack of memory or admission since the "
           "tenant joined.", "shortages", "counter"),
    Figure("kvpool_tenant_freeing_bytes", "What the tenant's running requests free within the reclaim bound.",
           "freeing_bytes"),
    Figure("kvpool_tenant_preempt_bytes", "While lending, what the tenant is asked to preempt now (0: it gives "
           "back by completion only).", "preempt_bytes"),
    Figure("kvpool_tenant_preemptions_asked_total", "Preemption verdicts the tenant's engine acted on.",
           "preemptions_asked", "counter"),
    Figure("kvpool_tenant_requests_preempted_total", "Requests the tenant's engine preempted.",
           "requests_preempted", "counter"),
    Figure("kvpool_tenant_tokens_recomputed_total", "Prompt and generated tokens of preempted requests, "
           "prefilled again.", "tokens_recomputed", "counter"),
    Figure("kvpool_tenant_reclaimed_by_completion_bytes_total", "Block bytes the tenant gave back while lending "
           "as its requests finished.", "reclaimed_by_completion_bytes", "counter"),
    Figure("kvpool_tenant_reclaimed_by_preemption_bytes_total", "Block bytes the tenant gave back by preempting "
           "requests.", "reclaimed_by_preemption_bytes", "counter"),
    Figure("kvpool_tenant_reclaimed_by_eviction_bytes_total", "Block bytes of cached blocks (a prefix cache's) "
           "the tenant dropped while lending.", "reclaimed_by_eviction_bytes", "counter"),
)

POOL_METRICS: tuple[Figure, ...] = (
    Figure("kvpool_pool_capacity_bytes", "The pool's budget of physical memory.", "capacity"),
    Figure("kvpool_pool_committed_bytes", "Memory committed by the pool's live tenants together.", "committed"),
    Figure("kvpool_pool_tenants", "Live tenants of the pool.", "tenants"),
)


def tenant_value(tenant: TenantInfo, attribute: str) -> float | None:
    """A tenant's figure, or None when it has none (no limit) or this ledger lacks it."""
    if attribute == "limit_deferred":
        return float(tenant.limit_state != "applied")
    value = getattr(tenant, attribute, None)
    return None if value is None else float(value)


@dataclass(frozen=True)
class PoolSample:
    """One consistent read of a pool: figures and live tenants."""

    name: str
    capacity: int
    committed: int
    tenant_list: Sequence[TenantInfo]

    @property
    def tenants(self) -> int:
        return len(self.tenant_list)


def read_pool(name: str) -> PoolSample:
    pool = Pool(name, create=False)
    pool.reap()  # dead tenants first, so what follows is live-only
    snap = pool.snapshot()  # one read: committed is the sum of these very rows
    return PoolSample(name, snap.capacity, snap.committed, snap.tenants)


class PoolCollector(Collector):
    """Reads the named pools (or every pool on the host) at each scrape.

    A pool that is gone or unreadable at scrape time is left out of that
    scrape (``kvpool pools`` says why); the others are still served.
    """

    def __init__(self, pools: Iterable[str] | None = None) -> None:
        self._pools = None if pools is None else list(pools)

    def _samples(self) -> list[PoolSample]:
        out = []
        for name in self._pools if self._pools is not None else list_pools():
            try:
                out.append(read_pool(name))
            except (KVPoolError, OSError):
                continue
        return out

    def collect(self) -> Iterator[Metric]:
        samples = self._samples()
        for fig in POOL_METRICS:
            family = GaugeMetricFamily(fig.name, fig.help, labels=["pool"])
            for s in samples:
                family.add_metric([s.name], float(getattr(s, fig.attribute)))
            yield family
        info = GaugeMetricFamily("kvpool_tenant_info", "1 per live tenant; pid and slot say which process "
                                 "serves it.", labels=["pool", "tenant", "pid", "slot"])
        for s in samples:
            for t in s.tenant_list:
                info.add_metric([s.name, t.name, str(t.pid), str(t.slot)], 1.0)
        yield info
        for fig in TENANT_METRICS:
            kind = CounterMetricFamily if fig.kind == "counter" else GaugeMetricFamily
            series = kind(fig.name, fig.help, labels=["pool", "tenant"])
            for s in samples:
                for t in s.tenant_list:
                    value = tenant_value(t, fig.attribute)
                    if value is not None:
                        series.add_metric([s.name, t.name], value)
            if series.samples:  # a figure no tenant has (yet) is no series at all
                yield series


def registry(pools: Iterable[str] | None = None) -> CollectorRegistry:
    """A registry holding only kvpool's collector (no process or GC metrics of this exporter)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PoolCollector(pools))
    return reg


def exposition(pools: Iterable[str] | None = None) -> str:
    """The Prometheus text exposition (format 0.0.4) of the pools, read now."""
    from prometheus_client.exposition import generate_latest

    return generate_latest(registry(pools)).decode()
