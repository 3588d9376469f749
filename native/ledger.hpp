// The pool ledger: one shared-memory segment per pool (/dev/shm/kvpool-<name>,
// mode 0600) that every engine process on the host joins. It holds the pool
// capacity, one slot per tenant and a generation word that doubles as a futex
// for cross-process wake-ups.
//
// A ledger no peer can block (ARCHITECTURE.md). There is no lock: a tenant can be
// SIGKILLed, SIGSTOPped, frozen by a cgroup or hostile at any instruction and
// no other tenant ever waits for it.
//
//   * A slot's figures (claimed, pending, want, waiting, verdicts) are written
//     only by its owner. The pool total is not stored: it is the sum of the
//     live slots, so a tenant dying between two stores cannot leave the books
//     inconsistent (there is no second store to miss).
//   * Claim before commit, without a lock: the owner publishes the claim as
//     `pending`, then reads every slot (sequentially consistent); if the sum
//     (claims and pending claims of everyone) fits the capacity it moves the
//     bytes to `claimed`. Of two tenants racing for the last bytes at least
//     one sees the other's pending claim (the store-load order of SC atomics),
//     so the pool is never over-committed; at worst both back off and retry
//     (a bounded number of times, then a shortage). A tenant stopped inside a
//     claim holds its pending bytes while it is stopped: a shortage, never a
//     hang.
//   * Settings (limit, guarantee and their revisions) may be written by any
//     process (operators): a per-slot seqlock whose writers enter by CAS. A
//     reader retries a bounded number of times and otherwise keeps the last
//     settings it read; a writer that finds it busy for that long gets an
//     error. Nobody waits indefinitely.
//   * Slots are taken by CAS on the pid word. A dead tenant's slot is reaped
//     by whoever notices (CAS pid -> -reaper pid, clear, free). A tenant in
//     this process's PID namespace is judged by pid + start time + pidns
//     inode. Another namespace's pids cannot be judged (its pid 7 is not our
//     pid 7), so every tenant also holds an open-file-description lock on
//     one byte of the ledger file at its slot's offset while it is live: the
//     kernel drops it when the owner's process dies, whatever its namespace
//     (round 3, pidns_dead_container_leak.py: a container that died with its
//     namespace kept its bytes and its name forever). A reaper judges a
//     foreign slot by taking that lock itself, without waiting (F_OFD_SETLK):
//     it gets it only if the owner is gone; a stopped owner still holds it.
//
// Trust: a segment is used only if it is ours (owner uid, mode 0600, regular
// file, opened O_NOFOLLOW, created O_EXCL) and its layout checks out.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "status.hpp"

namespace kvpool {

constexpr uint64_t kLedgerMagic = 0x4b56504f4f4c4c34ULL;  // "KVPOOLL4"
// 3: allocs and shortages per slot; 4: headroom, keep_free; 5: a live tenant
// holds its slot's lock (a build without it would be reaped as dead by one with it);
// 6: reclaimed_eviction per slot.
constexpr uint32_t kLedgerVersion = 6;
constexpr int kMaxTenants = 64;
constexpr int kMaxNameLen = 64;             // pool and tenant names: [A-Za-z0-9][A-Za-z0-9._-]{0,63}
constexpr int kNameBytes = 72;              // stored NUL-terminated
constexpr int64_t kMaxRevision = int64_t{1} << 53;  // revisions are exact in a double (JSON, Python floats)

// Settings any process may write (operators), under the slot's seqlock.
struct SlotSettings {
    std::atomic<uint64_t> seq;  // odd while a writer is inside
    std::atomic<int64_t> limit;            // bytes, -1 = none
    std::atomic<int64_t> limit_revision;
    std::atomic<int64_t> guarantee;        // bytes, -1 = the default (equal) share
    std::atomic<int64_t> guarantee_revision;
};

struct TenantSlot {
    // 0: free; > 0: the owner's pid; < 0: -pid of a process reaping the slot.
    std::atomic<int32_t> pid;
    std::atomic<uint32_t> live;       // 1 once the owner finished registering
    std::atomic<uint64_t> pidns;      // inode of the owner's /proc/self/ns/pid
    std::atomic<uint64_t> start_time; // /proc/<pid>/stat starttime: guards against pid reuse
    char name[kNameBytes];
    // --- written by the owner only ---
    std::atomic<int64_t> claimed;     // bytes committed or being committed
    std::atomic<int64_t> pending;     // a claim being judged (counted by every judge)
    std::atomic<int64_t> want;        // bytes its waiting requests need beyond `claimed` (0: none)
    std::atomic<uint64_t> wait_ticket;  // pool-wide arrival order of its wait (0: not waiting)
    std::atomic<int32_t> waiting;     // waiting requests
    std::atomic<int32_t> limit_state; // 0 applied, 1 deferred: the owner's verdict
    std::atomic<int64_t> reserve_pages;  // idle committed pages
    std::atomic<int32_t> lending;     // 1 while it lends to a tenant below its guarantee, 2 while it
                                      // restores what others keep free (budget.hpp, rule 5)
    // 1: its engine reclaims by completion only (it never acts on the
    // preempt verdict: SGLang, whose requests interleave on pages), so every
    // judge splits the preemption among the other lenders (budget.hpp,
    // rule 6). Was a pad word: ledgers before it read 0, as preempting.
    std::atomic<int32_t> no_preempt;
    std::atomic<int64_t> judged_revision;  // the limit revision limit_state judged
    // Headroom (budget.hpp, rule 5): bytes of its unused guarantee this
    // tenant asks borrowers to leave free, so its next request is granted at
    // once instead of after a borrower's step; keep_free is what that asks
    // now (min(headroom, guarantee - claimed), 0 above the guarantee),
    // computed by the owner's budget and summed by every judge.
    std::atomic<int64_t> headroom;
    std::atomic<int64_t> keep_free;
    // Monotonic (Prometheus counters): allocs the owner answered, granted or
    // refused for lack of memory or admission. Bumped on the hot path, so
    // relaxed: a reader wants a recent count, not an order against claims.
    std::atomic<uint64_t> allocs;
    std::atomic<uint64_t> shortages;
    // Reclaim by completion first (budget.hpp, rule 2; issue 31). `freeing`:
    // bytes this tenant's running requests will free within the reclaim
    // bound (its engine computes it every step); every judge reads it to tell
    // how much of a starving waiter's need completions will cover. The rest
    // is the owner's own verdict and counters, for readers (top, metrics):
    // `preempt_bytes`, what it is asked to preempt now (0: reclaim by
    // completion only); verdicts with preempt_bytes > 0 its engine acted on,
    // requests it preempted, their tokens to recompute, and bytes it gave
    // back while lending by completion, by preemption and by evicting cached
    // blocks (a prefix cache's). Monotonic, relaxed.
    std::atomic<int64_t> freeing;
    std::atomic<int64_t> preempt_bytes;
    std::atomic<uint64_t> preempt_asked;
    std::atomic<uint64_t> preempted;
    std::atomic<uint64_t> recomputed_tokens;
    std::atomic<uint64_t> reclaimed_completion;
    std::atomic<uint64_t> reclaimed_preemption;
    std::atomic<uint64_t> reclaimed_eviction;
    SlotSettings settings;
};

struct LedgerHeader {
    std::atomic<uint64_t> magic;  // written last at creation
    uint32_t version;
    uint32_t header_bytes;
    int64_t capacity;             // immutable once magic is written
    std::atomic<uint32_t> generation;  // futex word: bumped on every change others may act on
    // How the last tenant to go went (LastExit). A pool with no live tenant
    // is *empty* (made for later, or everyone left) unless its last tenant
    // died without leaving: then it is *stale*, the books of a crash, and
    // `kvpool pools --gc` removes it (issue 32). Was a pad word (0 = None),
    // so ledgers made before it read as never left.
    std::atomic<uint32_t> last_exit;
    std::atomic<uint64_t> tickets;     // source of wait tickets
    TenantSlot tenants[kMaxTenants];
};

// How a pool's last tenant to go went (LedgerHeader::last_exit).
enum class LastExit : uint32_t { None = 0, Left = 1, Died = 2 };

// One live tenant as read from the ledger (a snapshot row).
struct TenantRow {
    int slot = -1;
    int32_t pid = 0;
    bool visible = true;      // in this process's PID namespace (liveness judged here)
    std::string name;
    int64_t claimed = 0, pending = 0, want = 0;
    uint64_t wait_ticket = 0;
    int32_t waiting = 0, limit_state = 0, lending = 0, restoring = 0;
    int64_t reserve_pages = 0;
    int64_t headroom = 0, keep_free = 0;  // owner-published (TenantSlot)
    uint64_t allocs = 0, shortages = 0;  // owner-counted answers to alloc: granted, refused
    int64_t freeing = 0, preempt_bytes = 0;  // owner-published (TenantSlot): reclaim by completion first
    bool preempts = true;                    // owner-published (TenantSlot::no_preempt == 0)
    uint64_t preempt_asked = 0, preempted = 0, recomputed_tokens = 0;  // owner-counted (TenantSlot)
    uint64_t reclaimed_completion = 0, reclaimed_preemption = 0;       // bytes given back while lending
    uint64_t reclaimed_eviction = 0;  // of them, cached blocks dropped (a prefix cache's)
    int64_t limit = -1, limit_revision = 0, guarantee = -1, guarantee_revision = 0;
};

// Every live tenant read in one pass; figures derived from the same rows
// (the total is the sum of the rows, never read apart from them).
struct LedgerSnapshot {
    int64_t capacity = 0;
    uint32_t generation = 0;
    LastExit last_exit = LastExit::None;
    std::vector<TenantRow> rows;
    int64_t claimed_total() const;
    // A tenant's guarantee in force: its explicit one, or an equal share of
    // what explicit guarantees leave, among the tenants on the default.
    int64_t guarantee_of(const TenantRow& t) const;
    const TenantRow* find(int slot) const;
};

enum class LimitResult : int { Applied = 0, Stale = 1, Conflict = 2, Same = 3 };

bool valid_name(const std::string& name);
// A user-supplied name for an error message: quoted, printable ASCII as is,
// every other byte escaped (\xNN, \n, \t), cut after 80 characters with
// its length, so a name can neither flood a message nor drive a terminal.
std::string quoted_name(const std::string& name);

class Ledger {
public:
    // Opens the pool, creating it with `capacity` bytes if it does not exist
    // (create=false: join only). Returns nullptr and sets *status on failure.
    static std::shared_ptr<Ledger> open(const std::string& name, int64_t capacity, bool create, Status* status);
    ~Ledger();
    Ledger(const Ledger&) = delete;
    Ledger& operator=(const Ledger&) = delete;

    const std::string& name() const { return name_; }
    int64_t capacity() const { return hdr_->capacity; }
    uint32_t generation() const { return hdr_->generation.load(std::memory_order_acquire); }

    // A new tenant starts with `limit_bytes` / `guarantee_bytes` (-1: none /
    // the default share) at revision 0.
    Status register_tenant(const std::string& name, int64_t limit_bytes, int64_t guarantee_bytes, int* slot);
    void unregister_tenant(int slot);

    // Claim `bytes` for `slot` if the pool has room and `admit` (the
    // tenant's budget policy, judged on a snapshot that includes this claim
    // as pending) agrees. Returns true if claimed; on false *why says why.
    template <class Admit>
    bool claim(int slot, int64_t bytes, Admit&& admit, std::string* why);
    void release(int slot, int64_t bytes);

    // Owner-written figures.
    void report(int slot, int32_t limit_state, int64_t judged_revision, int32_t waiting, int64_t reserve_pages);
    // Publish what this tenant's waiting requests need (0: nothing waits).
    // Takes a wait ticket on the first want, drops it on 0; bumps the
    // generation when the want appears or goes (lenders react to it).
    void publish_want(int slot, int64_t want_bytes);
    void publish_lending(int slot, int32_t state);  // 0, 1 lending, 2 restoring
    void publish_headroom(int slot, int64_t headroom_bytes, int64_t keep_free_bytes);
    // Reclaim by completion first (TenantSlot::freeing and what follows it).
    void publish_freeing(int slot, int64_t bytes) { hdr_->tenants[slot].freeing.store(bytes, std::memory_order_seq_cst); }
    void publish_preempts(int slot, bool preempts) {
        hdr_->tenants[slot].no_preempt.store(preempts ? 0 : 1, std::memory_order_seq_cst);
    }
    void publish_preempt(int slot, int64_t bytes) { hdr_->tenants[slot].preempt_bytes.store(bytes, std::memory_order_release); }
    void count_preemption(int slot, bool asked, uint64_t requests, uint64_t tokens, uint64_t bytes) {
        TenantSlot& t = hdr_->tenants[slot];
        if (asked) t.preempt_asked.fetch_add(1, std::memory_order_relaxed);
        t.preempted.fetch_add(requests, std::memory_order_relaxed);
        t.recomputed_tokens.fetch_add(tokens, std::memory_order_relaxed);
        t.reclaimed_preemption.fetch_add(bytes, std::memory_order_relaxed);
    }
    void count_reclaimed_completion(int slot, uint64_t bytes) {
        hdr_->tenants[slot].reclaimed_completion.fetch_add(bytes, std::memory_order_relaxed);
    }
    void count_reclaimed_eviction(int slot, uint64_t bytes) {
        hdr_->tenants[slot].reclaimed_eviction.fetch_add(bytes, std::memory_order_relaxed);
    }
    // One alloc answered (granted, or refused: a shortage or beyond what the
    // tenant can ever hold). The hot path: one relaxed add on the owner's
    // slot, no lock, no syscall; inline so it costs no call either.
    void count_alloc(int slot, bool granted) {
        TenantSlot& t = hdr_->tenants[slot];
        (granted ? t.allocs : t.shortages).fetch_add(1, std::memory_order_relaxed);
    }

    // Settings (any process). *result says how the pool took it.
    Status set_limit(int slot, int64_t bytes, int64_t revision, LimitResult* result);
    Status set_guarantee(int slot, int64_t bytes, int64_t revision, LimitResult* result);
    Status find_tenant(const std::string& tenant, int* slot);
    // The slot's settings (seqlock read); false if a writer kept it busy.
    bool read_settings(int slot, int64_t* limit, int64_t* limit_rev, int64_t* guarantee, int64_t* guarantee_rev) const;

    // names=false skips the tenant names (the budget's judgements need none:
    // no string is built on the hot path).
    LedgerSnapshot snapshot(bool names = true) const;
    // Reaps dead tenants of this PID namespace; returns how many.
    int reap();
    // Futex wait until the generation differs from `seen` (timeout < 0: none).
    void wait_generation(uint32_t seen, double timeout_s) const;
    void bump_generation();  // and wake every waiter, in every process
    // When no other tenant wants memory (no waiter anywhere, the common
    // case): *free_bytes = capacity minus every claim but `slot`'s pending
    // one, *keep_free = what the other tenants ask borrowers to leave free,
    // and true. False if someone waits (then the fair-share rules need a
    // full snapshot). One pass, no settings read, no strings.
    bool quiet_free_bytes(int slot, int64_t* free_bytes, int64_t* keep_free) const;
    // Whether any tenant other than `slot` has requests waiting.
    bool anyone_waiting(int slot) const;
    // Whether any tenant other than `slot` restores what others keep free
    // (it must hear of memory coming back: a release then bumps the generation).
    bool anyone_restoring(int slot) const;

    // Test hook: the next claim stops this process (SIGSTOP) with its claim
    // pending, inside the claim protocol.
    void inject_stop_mid_claim() { stop_mid_claim_ = true; }

private:
    Ledger() = default;
    bool claim_once(int slot, int64_t bytes, bool (*admit)(void*, const LedgerSnapshot&, std::string*), void* ctx,
                    std::string* why);
    Status write_setting(int slot, bool guarantee, int64_t bytes, int64_t revision, LimitResult* result);
    bool reap_slot(int slot);
    void free_slot(int slot);  // one clearing for a tenant leaving and a dead one reaped
    // register_tenant's steps. The explicit guarantees' sum with `extra`
    // added, against the capacity (an Invalid "does not fit" status, or ok).
    Status guarantee_fits(int64_t extra, bool published) const;
    // A free slot taken for this process (pid CAS, then its liveness lock), or -1.
    int take_free_slot(int32_t me);
    // The taken slot filled in (name, start time, settings) and made live.
    void publish_slot(int slot, const std::string& name, uint64_t start, int64_t limit_bytes,
                      int64_t guarantee_bytes);
    // Another live slot with this slot's name.
    bool has_twin(int slot) const;
    // A published slot taken back (not live, pid cleared, lock dropped).
    void withdraw_slot(int slot);
    // The slot's liveness lock (see the top): take without waiting (false if
    // another open file holds it), or drop.
    bool lock_slot(int slot) const;
    void unlock_slot(int slot) const;
    // A live tenant of another PID namespace whose process is gone: its
    // slot's lock is free. Reaps it and returns true if so.
    bool reap_foreign(int slot, int32_t pid);

    std::string name_;
    LedgerHeader* hdr_ = nullptr;
    int fd_ = -1;  // kept open: the slot locks are held through it (O_CLOEXEC)
    uint64_t my_pidns_ = 0;
    bool stop_mid_claim_ = false;
};

template <class Admit>
bool Ledger::claim(int slot, int64_t bytes, Admit&& admit, std::string* why) {
    using F = std::remove_reference_t<Admit>;
    auto thunk = [](void* ctx, const LedgerSnapshot& s, std::string* w) -> bool {
        return (*static_cast<F*>(ctx))(s, w);
    };
    return claim_once(slot, bytes, thunk, static_cast<void*>(&admit), why);
}

// Process start time (clock ticks since boot) from /proc, 0 if unknown.
uint64_t process_start_time(int32_t pid);
// Inode of /proc/self/ns/pid (0 if unknown).
uint64_t own_pid_namespace();

}  // namespace kvpool
