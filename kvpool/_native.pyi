"""kvpool native core (private: use the kvpool package)"""

from collections.abc import Awaitable, Callable, Coroutine, Sequence
import enum
from typing import Annotated, Any, NoReturn

import numpy
import numpy.typing
from numpy.typing import NDArray


CODE_OK: int = 0

CODE_SHORTAGE: int = 1

CODE_INVALID: int = 2

CODE_BACKEND: int = 3

CODE_CLOSED: int = 4

CODE_LEDGER: int = 5

CODE_UNSATISFIABLE: int = 6

class BudgetFigures:
    """A tenant's budget: limit, guarantee, claims, lending."""

    @property
    def pooled(self) -> bool: ...

    @property
    def limit_bytes(self) -> int: ...

    @property
    def limit_revision(self) -> int: ...

    @property
    def guarantee_bytes(self) -> int: ...

    @property
    def guarantee_setting(self) -> int: ...

    @property
    def guarantee_revision(self) -> int: ...

    @property
    def claimed_bytes(self) -> int: ...

    @property
    def borrowed_bytes(self) -> int: ...

    @property
    def want_bytes(self) -> int: ...

    @property
    def lending(self) -> bool: ...

    @property
    def restoring(self) -> bool: ...

    @property
    def headroom_bytes(self) -> int: ...

    @property
    def keep_free_bytes(self) -> int: ...

    @property
    def freeing_bytes(self) -> int: ...

    @property
    def preempt_bytes(self) -> int: ...

    @property
    def preempts(self) -> bool: ...

    @property
    def preemptions_asked(self) -> int: ...

    @property
    def requests_preempted(self) -> int: ...

    @property
    def tokens_recomputed(self) -> int: ...

    @property
    def reclaimed_by_completion_bytes(self) -> int: ...

    @property
    def reclaimed_by_preemption_bytes(self) -> int: ...

    @property
    def reclaimed_by_eviction_bytes(self) -> int: ...

    @property
    def pool_capacity(self) -> int: ...

class SpaceStats:
    """A consistent snapshot of one space (taken under its lock)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def num_pages(self) -> int: ...

    @property
    def used_blocks(self) -> int: ...

    @property
    def available(self) -> int: ...

    @property
    def pages_free(self) -> int: ...

    @property
    def pages_committing(self) -> int: ...

    @property
    def pages_reserve(self) -> int: ...

    @property
    def pages_active(self) -> int: ...

    @property
    def pages_releasing(self) -> int: ...

    @property
    def room_blocks(self) -> int:
        """
        free blocks on active pages: what an alloc fills without committing a page
        """

    @property
    def committed_bytes(self) -> int: ...

    @property
    def page_commit_bytes(self) -> int: ...

    @property
    def limit_pages(self) -> int: ...

    @property
    def limit_deferred(self) -> bool: ...

    @property
    def max_blocks(self) -> int: ...

    @property
    def allocs(self) -> int: ...

    @property
    def frees(self) -> int: ...

    @property
    def shortages(self) -> int: ...

    @property
    def commits(self) -> int: ...

    @property
    def releases(self) -> int: ...

    @property
    def inline_commits(self) -> int: ...

    @property
    def inline_releases(self) -> int: ...

    @property
    def commit_failures(self) -> int: ...

    @property
    def release_failures(self) -> int: ...

    @property
    def last_error(self) -> str: ...

    @property
    def budget(self) -> BudgetFigures: ...

    @property
    def backend(self) -> str: ...

class LastExit(enum.Enum):
    """How a pool's last tenant to go went."""

    NONE = 0
    """no tenant has gone yet"""

    LEFT = 1
    """it left cleanly (closed its space)"""

    DIED = 2
    """it died without leaving and was reaped"""

class TenantRow:
    """One live tenant as a ledger snapshot read it."""

    @property
    def slot(self) -> int: ...

    @property
    def pid(self) -> int: ...

    @property
    def visible(self) -> bool: ...

    @property
    def name(self) -> str: ...

    @property
    def claimed(self) -> int: ...

    @property
    def pending(self) -> int: ...

    @property
    def want(self) -> int: ...

    @property
    def wait_ticket(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def limit_state(self) -> int: ...

    @property
    def lending(self) -> int: ...

    @property
    def restoring(self) -> int: ...

    @property
    def reserve_pages(self) -> int: ...

    @property
    def headroom(self) -> int: ...

    @property
    def keep_free(self) -> int: ...

    @property
    def allocs(self) -> int: ...

    @property
    def shortages(self) -> int: ...

    @property
    def freeing(self) -> int: ...

    @property
    def preempt_bytes(self) -> int: ...

    @property
    def preempts(self) -> bool: ...

    @property
    def preempt_asked(self) -> int: ...

    @property
    def preempted(self) -> int: ...

    @property
    def recomputed_tokens(self) -> int: ...

    @property
    def reclaimed_completion(self) -> int: ...

    @property
    def reclaimed_preemption(self) -> int: ...

    @property
    def reclaimed_eviction(self) -> int: ...

    @property
    def limit(self) -> int: ...

    @property
    def limit_revision(self) -> int: ...

    @property
    def guarantee(self) -> int: ...

    @property
    def guarantee_revision(self) -> int: ...

class LedgerSnapshot:
    """
    Every live tenant read in one pass; the total is the sum of these rows.
    """

    @property
    def capacity(self) -> int: ...

    @property
    def generation(self) -> int: ...

    @property
    def last_exit(self) -> LastExit: ...

    @property
    def rows(self) -> list[TenantRow]: ...

    @property
    def claimed_total(self) -> int: ...

    def guarantee_of(self, row: TenantRow) -> int:
        """A tenant's guarantee in force: explicit, or the equal default share."""

class Outcome:
    """
    A call's status: code (a CODE_* constant; CODE_OK when it worked) and message.
    """

    @property
    def code(self) -> int: ...

    @property
    def message(self) -> str: ...

class Trimmed(Outcome):
    """Space.trim's outcome: the idle pages it released."""

    @property
    def released(self) -> int: ...

class LimitResult(enum.Enum):
    """How a revisioned limit or guarantee was taken."""

    APPLIED = 0
    """set under its revision"""

    STALE = 1
    """older than the revision in force: ignored"""

    CONFLICT = 2
    """the revision in force with another value: ignored"""

    SAME = 3
    """the revision and value in force already"""

class SettingOutcome(Outcome):
    """A limit's or guarantee's outcome: how it was taken."""

    @property
    def result(self) -> LimitResult: ...

class DeviceMemory(Outcome):
    """A CUDA device's free and total bytes."""

    @property
    def free_bytes(self) -> int: ...

    @property
    def total_bytes(self) -> int: ...

class PageOccupancy(Outcome):
    """Per asked page: its used blocks and its state."""

    @property
    def used(self) -> Annotated[NDArray[numpy.int64], dict(shape=(None,))]: ...

    @property
    def states(self) -> Annotated[NDArray[numpy.int64], dict(shape=(None,))]: ...

class Opened(Outcome):
    """What an open made (a Ledger, a RankMemory); None on failure."""

    @property
    def value(self) -> object: ...

class PageRanges:
    """Per page p of a geometry, its blocks [first[p], last[p])."""

    @property
    def first(self) -> Annotated[NDArray[numpy.int64], dict(shape=(None,))]: ...

    @property
    def last(self) -> Annotated[NDArray[numpy.int64], dict(shape=(None,))]: ...

def format_size(bytes: int) -> str:
    """
    Bytes as people read them: binary units, one decimal ('128.0 MiB', '1.0 PiB'); under 1 KiB 'N B'.
    """

def format_size_exact(bytes: int) -> str:
    """
    format_size, with the exact count where that rounds: '11.8 MiB (12345678 bytes)'.
    """

def cpu_granularity() -> int:
    """Smallest page size step of the CPU backend."""

def cuda_unavailable_reason() -> str:
    """Why the CUDA backend cannot be used here (empty when it can)."""

def cuda_mem_info(device: int) -> DeviceMemory:
    """A CUDA device's free and total bytes (cuMemGetInfo)."""

def page_ranges(page_bytes: int, block_bytes: int, num_blocks: int) -> PageRanges:
    """Per-page block ranges [first, last) of a geometry (the one formula)."""

class Ledger:
    @property
    def name(self) -> str: ...

    @property
    def capacity(self) -> int: ...

    @property
    def generation(self) -> int: ...

    def snapshot(self) -> LedgerSnapshot:
        """
        Every live tenant in one pass (lock-free; never waits for another process).
        """

    def set_setting(self, tenant: str, guarantee: bool, bytes: int, revision: int) -> SettingOutcome:
        """
        Set a tenant's limit (guarantee=False) or guarantee; revision < 0 = next.
        """

    def reap(self) -> int:
        """Reap dead tenants of this PID namespace; returns how many."""

    def inject_stop_mid_claim(self) -> None:
        """
        Test hook: the next claim of this process stops it (SIGSTOP) with its claim pending.
        """

def open_ledger(name: str, capacity: int, create: bool) -> Opened:
    """Open (or create) a pool ledger: its value a Ledger, or None."""

class Failure:
    """A failed alloc or free: nothing changed."""

    @property
    def code(self) -> int: ...

    @property
    def message(self) -> str: ...

    @property
    def available(self) -> int: ...

    @property
    def max_blocks(self) -> int: ...

    @property
    def bad_ids(self) -> list[int]: ...

class Space:
    def alloc(self, n: int) -> numpy.typing.NDArray[numpy.int64] | Failure:
        """
        All-or-nothing: n block ids (int64 array), or a Failure (nothing changed).
        """

    def alloc_items(self, n: int, items: list[Any], promised: bool = False) -> list[Any] | Failure:
        """
        alloc (alloc_promised if promised) answered as [items[id] for each id]; items: a list with an entry per block.
        """

    def acquire(self, n: int, items: list[Any] | None = None, promised: bool = False, stall: float = 30.0, timeout: float = float('inf')) -> numpy.typing.NDArray[numpy.int64] | list[Any] | Failure:
        """
        alloc, waiting (GIL released) while the pool makes progress: a Failure only for a request never grantable, a closed space, or a pool stalled for `stall` s (or after `timeout` s).
        """

    def free_items(self, items: list[Any], attr: str) -> int | Failure:
        """
        free of [getattr(item, attr) for item in items] (the ids read natively); as free.
        """

    def alloc_promised(self, n: int) -> numpy.typing.NDArray[numpy.int64] | Failure:
        """
        alloc granted as an earlier available() said, even if this tenant lends now (its limit and the
        pool's free bytes still apply).
        """

    def free(self, ids: numpy.typing.NDArray[numpy.int64] | list[int]) -> int | Failure:
        """
        Validates the whole batch first: blocks available after it, or a Failure naming the bad ids (nothing freed). TypeError unless ids is a 1-D C-contiguous int64 numpy array or a list of ints.
        """

    def available(self) -> int:
        """
        Blocks a following alloc can deliver (waits for the space's mutex only without the GIL).
        """

    def trim(self) -> Trimmed:
        """Release every idle committed page: how many it released."""

    def set_limit(self, limit_bytes: int, revision: int) -> SettingOutcome:
        """
        Set and apply this tenant's one limit (-1: none); in a pool under `revision` (-1: next).
        """

    def set_reserve(self, min_pages: int, max_pages: int) -> Outcome: ...

    def page_occupancy(self, pages: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)]) -> PageOccupancy:
        """The used blocks and state of each page in `pages`."""

    def stats(self) -> SpaceStats: ...

    def budget(self) -> BudgetFigures:
        """The tenant's budget figures (refreshed from the pool)."""

    def max_blocks(self) -> int:
        """The most blocks this tenant can ever hold (admission bound)."""

    def set_guarantee(self, guarantee_bytes: int, revision: int) -> SettingOutcome:
        """
        Set this tenant's guarantee (-1: the default share) under `revision` (-1: next).
        """

    def set_headroom(self, headroom_bytes: int) -> Outcome:
        """Bytes of this tenant's unused guarantee borrowers must leave free."""

    def publish_freeing(self, freeing_bytes: int) -> Outcome:
        """
        Bytes this tenant's running requests free within the reclaim bound (budget.hpp, rule 6).
        """

    def set_preempts(self, preempts: bool) -> Outcome:
        """
        Whether this tenant's engine acts on the preempt verdict (false: by completion only; budget.hpp, rule 6).
        """

    def free_preempted(self, ids: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)], requests: int, tokens: int) -> object:
        """
        Free the blocks of `requests` preempted requests with `tokens` to recompute, counted as reclaimed by preemption (budget.hpp, rule 6): None, or a Failure (nothing freed).
        """

    def free_evicted(self, ids: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)]) -> object:
        """
        Free cached blocks the engine drops (a prefix cache's), counted while lending as reclaimed by eviction (budget.hpp, rule 6): None, or a Failure (nothing freed).
        """

    @property
    def inherited(self) -> bool:
        """Inherited across fork(): inert in this process."""

    def settle(self, timeout_s: float) -> bool:
        """Wait until the reserve thread is idle; False on timeout."""

    def inject_fault(self, kind: int, nth: int, errno: int) -> None:
        """Test-only: fail the nth next commit (0) or release (1)."""

    def allocated_bytes(self) -> int:
        """Bytes the backend really holds (memfd st_blocks on CPU)."""

    def region(self, region: int) -> Annotated[NDArray[numpy.uint8], dict(shape=(None,))]:
        """Region memory as a DLPack-capable byte array."""

    def memory(self) -> Annotated[NDArray[numpy.uint8], dict(shape=(None,))]:
        """All regions, back to back, as one DLPack-capable byte array."""

    @property
    def share_fd(self) -> int:
        """The memfd another process can map (-1: none)."""

    @property
    def mirror_fd(self) -> int:
        """A mirrored space's channel the ranks attach to (-1: none)."""

    @property
    def mirror_nonce(self) -> int:
        """The channel's random identity (0: none)."""

    def report_waiting(self, waiting: int) -> None: ...

    @property
    def eventfd(self) -> int: ...

    @property
    def last_alloc_commits(self) -> int:
        """Pages the last alloc committed inline (for debug traces)."""

    @property
    def last_free_releases(self) -> int:
        """Pages the last free released inline (for debug traces)."""

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...

def create_space(num_regions: int, page_bytes: int, block_bytes: int, num_blocks: int, null_block: bool, reserve_min: int, reserve_max: int, reserve_thread: bool, idle_release_s: float, limit_bytes: int, guarantee_bytes: int, headroom_bytes: int, device: str, ledger: Ledger | None, tenant: str, rank_regions: Sequence[int] = [], rank_timeout_s: float = 5.0) -> Opened:
    """
    Create a KV space, as a tenant of `ledger` if given: (code, message, Space | None). With rank_regions, a mirrored space whose ranks' processes hold the memory (RankMemory).
    """

MAX_RANKS: int = 64

class RankStats:
    """One rank of a mirrored space, as its own process sees it."""

    @property
    def rank(self) -> int: ...

    @property
    def first_region(self) -> int: ...

    @property
    def num_regions(self) -> int: ...

    @property
    def region_bytes(self) -> int: ...

    @property
    def page_bytes(self) -> int: ...

    @property
    def num_pages(self) -> int: ...

    @property
    def committed_pages(self) -> int: ...

    @property
    def allocated_bytes(self) -> int: ...

    @property
    def commits(self) -> int: ...

    @property
    def releases(self) -> int: ...

    @property
    def failures(self) -> int: ...

    @property
    def generation(self) -> int: ...

    @property
    def device(self) -> str: ...

    @property
    def last_error(self) -> str: ...

class RankMemory:
    def memory(self) -> Annotated[NDArray[numpy.uint8], dict(shape=(None,))]:
        """This rank's regions, back to back, as a DLPack-capable byte array."""

    def stats(self) -> RankStats: ...

    def sync(self, timeout_s: float) -> bool:
        """Wait until this rank matches the leader's map; False on timeout."""

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...

def attach_rank(pid: int, fd: int, nonce: int, rank: int, device: str) -> Opened:
    """
    Attach to a mirrored space's channel as `rank`: its value a RankMemory, or None.
    """

class TraceLevel:
    """
    kvpool.tracing's level (its one owner): the hot path reads it natively.
    """

    def __init__(self) -> None: ...

    @property
    def level(self) -> int:
        """Events below this level are not emitted (logging's numbers)."""

    @level.setter
    def level(self, arg: int, /) -> None: ...

class SpaceFace:
    """
    KVSpace's native base: alloc and free, one native call each (kvpool.space).
    """

    def __init__(self, space: Space, *, slow_alloc: Callable[..., Any], slow_free: Callable[..., None], alloc_refused: Callable[[Failure, int], NoReturn], free_refused: Callable[[Failure], NoReturn]) -> None: ...

    def alloc(self, n: int, *, promised: bool = False) -> numpy.typing.NDArray[numpy.int64]:
        """
        Allocate ``n`` blocks, all or nothing.

        Raises :class:`PoolExhausted` (with ``requested``/``available``) when
        they are not there; nothing changes then.

        ``promised=True``: the caller read ``available() >= n`` while this
        tenant was not lending and has already told its engine the blocks are
        there; a tenant below its guarantee (another process) may have started
        waiting since. The alloc is then granted as that count said: the
        lending verdict and the waiters' claims on free memory do not refuse
        it, the limit and the pool's free bytes still do. Use it only right
        after such a count (the vLLM plugin's ``get_new_blocks`` after its
        ``get_num_free_blocks``); the next count reads the new verdict.
        """

    def free(self, blocks: Any) -> None:
        """
        Free a batch of ids. Any bad id raises :class:`InvalidBlocks` and frees nothing.
        """

class ManagerFace:
    """
    KVCacheManager's native base: alloc_nowait, free and await alloc (kvpool.manager).
    """

    def __init__(self, space: Space, *, slow_alloc: Callable[..., Any], slow_free: Callable[..., None], slow_await: Callable[..., Awaitable[Any]], alloc_refused: Callable[[Any, Failure, int], NoReturn], try_refused: Callable[[Any, Failure, int], NoReturn], free_refused: Callable[[Failure], NoReturn], waiters: list[Any], trace_state: TraceLevel, debug_level: int, usable: int) -> None: ...

    def alloc_nowait(self, n: int, *, priority: int = 0) -> numpy.typing.NDArray[numpy.int64]:
        """
        n block ids now, or :class:`PoolExhausted` (never queues, never barges).
        """

    def alloc(self, n: int, *, timeout: float | None = None, priority: int = 0) -> Coroutine[Any, Any, numpy.typing.NDArray[numpy.int64]]:
        """
        Wait until n blocks can be granted, then return their ids.

        FIFO within a priority class (lower number first). ``timeout``
        raises :class:`TimeoutError` holding nothing; closing the manager
        raises :class:`PoolClosed`. Cancellation never leaks a block.

        A coroutine (``kvpool._native.AllocCall``): granted at once, its first
        send returns the ids, with no schedule point between the grant and
        the return; otherwise it runs the manager's queued wait.
        """

    def free(self, blocks: Any) -> None:
        """Give blocks back; waiters are served before any new arrival."""

class VllmFreeQueue:
    """
    The native half of the vLLM plugin's free block queue and its pool's hot path (adapters/vllm/block_pool.py).
    """

    def __init__(self, space: Space, blocks: list[Any], evictable: dict[int, Any], watchers: dict[int, Any], pool: Any, checked_get_new: Callable[[Any, int], list[Any]], vllm_get_new: Callable[[Any, int], list[Any]], free_refused: Callable[[Failure], NoReturn], take_short: Callable[[int, bool, list[Any] | Failure], list[Any]], report_waiting: Callable[[int], None], keep_readable: Callable[[list[Any]], list[Any]], id_attr: str, total: int) -> None: ...

    def popleft_n(self, n: int) -> list[Any]:
        """
        vLLM's get_new_blocks(n): the space's ids answered as vLLM's block objects.
        """

    def popleft(self) -> Any:
        """popleft_n(1)[0]."""

    def prepend_n(self, blocks: list[Any]) -> None:
        """
        Blocks at ref 0 with no cache hash: back to the space in one native call.
        """

    def append_n(self, blocks: list[Any]) -> None:
        """
        Cached (or unpinned) blocks at ref 0: held as evictable, most recent last.
        """

    def append(self, block: Any) -> None:
        """append_n([block])."""

    def get_num_free_blocks(self) -> int:
        """The plugin's free count (bound on its BlockPool instance)."""

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        """The plugin's get_new_blocks (bound on its BlockPool instance)."""

    def note_if_idle(self) -> None:
        """With every block free, tell the pool this engine waits for nothing."""

    @property
    def num_free_blocks(self) -> int:
        """vLLM's own free count (virtual)."""

    @num_free_blocks.setter
    def num_free_blocks(self, arg: int, /) -> None: ...

    @property
    def promised(self) -> int:
        """Blocks the last free count told vLLM it could have."""

    @promised.setter
    def promised(self, arg: int, /) -> None: ...

    @property
    def lending(self) -> bool:
        """The budget's lending verdict as the plugin last read it."""

    @lending.setter
    def lending(self, arg: bool, /) -> None: ...

    @property
    def virtual_count(self) -> bool:
        """
        The free count answers vLLM's virtual figure (inside vLLM's own checks).
        """

    @virtual_count.setter
    def virtual_count(self, arg: bool, /) -> None: ...

    @property
    def lend_refusals(self) -> int:
        """Free counts answered 0 in this lending episode."""

    @lend_refusals.setter
    def lend_refusals(self, arg: int, /) -> None: ...

    @property
    def reported_waiting(self) -> int:
        """What the pool's ledger was last told."""

    @reported_waiting.setter
    def reported_waiting(self, arg: int, /) -> None: ...

    @property
    def total(self) -> int:
        """Every block but vLLM's null block."""

    @property
    def evictable(self) -> dict[int, Any]:
        """Held blocks with ref_cnt 0, oldest first (dict order = LRU)."""
