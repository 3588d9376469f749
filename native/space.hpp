// One KV space: page table, block allocator and reserve thread over a
// Backend. Plain C++17; knows nothing of Python (see bindings.cpp).
//
// Page states:   FREE --commit--> RESERVE --first alloc--> ACTIVE
//                  ^                 |  ^                      |
//                  +----release------+  +---last block freed---+
// plus two transient states (COMMITTING, RELEASING) owned by the reserve
// thread while it runs a syscall without holding the lock.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend.hpp"
#include "ledger.hpp"
#include "status.hpp"

namespace kvpool {

enum class PageState : uint8_t { Free = 0, Committing = 1, Reserve = 2, Active = 3, Releasing = 4 };

struct SpaceConfig {
    int64_t num_regions = 1;
    int64_t page_bytes = 2 << 20;
    int64_t block_bytes = 0;
    int64_t num_blocks = 0;
    bool null_block = false;
    int64_t reserve_min = 1;   // idle committed pages the thread keeps ready
    int64_t reserve_max = 2;   // idle committed pages kept before releasing
    bool reserve_thread = true;
    int64_t limit_pages = -1;  // cap on committed pages, -1 = none (without a ledger)
};

struct SpaceStats {
    int64_t num_blocks = 0, capacity = 0, num_pages = 0, used_blocks = 0, available = 0;
    int64_t pages_free = 0, pages_committing = 0, pages_reserve = 0, pages_active = 0,
            pages_releasing = 0;
    int64_t committed_bytes = 0, page_commit_bytes = 0, limit_pages = -1;
    // The one limit verdict (see Space::limit_deferred_locked): committed
    // pages above the limit in force, waiting to be given back as they empty.
    bool limit_deferred = false;
    int64_t allocs = 0, frees = 0, shortages = 0;
    int64_t commits = 0, releases = 0, inline_commits = 0, inline_releases = 0;
    int64_t commit_failures = 0, release_failures = 0;
    std::string last_error;
};

enum class FaultKind : int { Commit = 0, Release = 1 };

class Space {
public:
    // Returns nullptr and sets *status on failure.
    // With a ledger, every commit is claimed in the pool first (claim before
    // commit) and every release returned; `slot` is this space's tenant slot,
    // owned from here on: a failed create unregisters it.
    static std::unique_ptr<Space> create(const SpaceConfig& cfg, std::unique_ptr<Backend> backend,
                                         std::shared_ptr<Ledger> ledger, int slot, Status* status);
    ~Space();
    Space(const Space&) = delete;
    Space& operator=(const Space&) = delete;

    // All-or-nothing: writes n ids to out, or changes nothing and returns a
    // Shortage (with *available set) or another failure.
    // *committed (optional) = pages this call committed inline.
    Status alloc(int64_t n, int64_t* out, int64_t* available, int64_t* committed = nullptr);
    // Validates the whole batch first; on any bad id changes nothing and
    // returns Invalid with the offending ids in *bad.
    // *released (optional) = pages this call released inline; *available
    // (optional) = available() after the call, so that a caller handing the
    // freed blocks to waiters needs no second call.
    Status free(const int64_t* ids, int64_t n, std::vector<int64_t>* bad, int64_t* released = nullptr,
                int64_t* available = nullptr);
    int64_t available();
    // Releases every idle (RESERVE) page now. *released = pages given back.
    Status trim(int64_t* released);
    // Sets this tenant's one limit (bytes, -1 = none) and applies it now:
    // idle pages above it go back, a raised limit wakes waiters (eventfd).
    // With a ledger the limit lives in the pool under `revision` (-1 = the
    // next one) and *result says how the pool took it; without one it is
    // local and always Applied.
    Status set_limit(int64_t bytes, int64_t revision, LimitResult* result);
    // The limit in force: (bytes, revision); (-1, -1) without a ledger.
    void limit_setting(int64_t* bytes, int64_t* revision) const;
    Status set_reserve(int64_t min_pages, int64_t max_pages);
    // used/state per page; Invalid if a page id is out of range.
    Status page_occupancy(const int64_t* pages, int64_t n, int64_t* used, int64_t* state);
    SpaceStats stats();
    // Waits until the reserve thread has nothing left to do (tests, audits).
    bool settle(double timeout_s);
    // Test-only: make the nth next page operation of `kind` fail with errno
    // `err` (ENOSPC/ENOMEM read as a shortage). nth = 0 clears.
    void inject_fault(FaultKind kind, int64_t nth, int err);
    int64_t allocated_bytes();
    void* region_base(int64_t region) const { return backend_->region_base(region); }
    int device_type() const { return backend_->device_type(); }
    int device_id() const { return backend_->device_id(); }
    int share_fd() const { return backend_->share_fd(); }
    int eventfd() const { return efd_; }
    const SpaceConfig& config() const { return cfg_; }
    int64_t capacity() const { return capacity_; }
    int64_t num_pages() const { return static_cast<int64_t>(pages_.size()); }
    bool closed() const { return closed_.load(std::memory_order_acquire); }
    bool has_ledger() const { return ledger_ != nullptr; }
    void report_waiting(int32_t waiting);
    void close();

private:
    struct Page {
        int64_t first = 0;           // first block id on the page
        int32_t cap = 0;             // blocks on the page
        int32_t nfree = 0;           // free blocks (ACTIVE pages)
        PageState state = PageState::Free;
        bool pinned = false;         // holds the null block: never released
        int32_t prev = -1, next = -1;  // links in bucket_head_[nfree]
        std::vector<int32_t> free_off;  // free block offsets, a stack
    };

    explicit Space(const SpaceConfig& cfg, std::unique_ptr<Backend> backend, std::shared_ptr<Ledger> ledger,
                   int slot);
    int64_t limit_pages_locked() const;
    bool deferred_under_locked(int64_t limit_pages) const;
    bool limit_deferred_locked() const;
    void apply_limit_locked();
    int64_t ledger_room_pages_locked() const;
    bool pool_is_short_locked() const;
    bool claim_locked(int64_t pages, Status* status);
    void unclaim_locked(int64_t pages);
    void report_locked();
    void watcher_main();
    Status init();

    // --- bookkeeping, all called with mu_ held ---
    void bucket_insert(int32_t p);
    void bucket_remove(int32_t p);
    int32_t bucket_find_ge(int32_t k) const;
    int32_t bucket_find_max() const;
    void free_push(int32_t p);
    void free_remove(int32_t p);
    int64_t headroom_locked() const;      // settled view: releasing pages count as free
    int64_t headroom_now_locked() const;  // physical: what a commit may add right now
    int64_t idle_usable_pages_locked() const;
    int64_t idle_usable_cap_locked() const;
    int64_t available_locked() const;
    void activate_locked(int32_t p);
    void take_locked(int32_t p, int64_t k, int64_t*& out);
    void return_block_locked(int64_t id);
    void to_reserve_locked(int32_t p);
    void released_locked(int32_t p);
    struct ThreadWork {
        bool want_release, want_commit;  // wanted, whatever the retry deadlines
        bool release_now, commit_now;    // wanted and due now
    };
    ThreadWork thread_work_locked(std::chrono::steady_clock::time_point now) const;
    bool thread_has_work_locked() const;
    int64_t release_inline_locked();
    Status do_commit(int32_t p, int injected_err);
    Status do_release(int32_t p, int injected_err);
    int consume_fault_locked(FaultKind kind);
    void signal_eventfd();
    void thread_main();

    SpaceConfig cfg_;
    std::unique_ptr<Backend> backend_;
    int64_t capacity_ = 0;
    int32_t max_cap_ = 0;

    std::mutex mu_;
    std::condition_variable cv_;         // page transitions, thread work, settle
    std::vector<Page> pages_;
    std::vector<uint8_t> held_;          // per block: 0 free, 1 held, 2 marked (free validation)
    std::vector<int32_t> bucket_head_;   // ACTIVE pages with 0 < nfree, by nfree
    std::vector<uint64_t> bucket_bits_;  // non-empty buckets: best-fit lookup by bit scan
    // FREE pages by capacity, largest first: top-k sums stay exact under a limit.
    std::vector<std::pair<int32_t, std::vector<int32_t>>> free_by_cap_;
    std::vector<int32_t> reserve_;       // RESERVE pages, a stack
    std::vector<int32_t> releasing_caps_;
    std::vector<int32_t> committing_pages_;
    int64_t partial_free_ = 0, reserve_cap_ = 0, committing_cap_ = 0;
    int64_t n_active_ = 0, n_reserve_ = 0, n_committing_ = 0, n_releasing_ = 0;
    int64_t used_ = 0;
    int64_t fault_nth_[2] = {0, 0};
    int fault_err_[2] = {0, 0};
    // After a failed commit/release the thread retries no earlier than these
    // (a free, trim or new reserve setting resets the commit deadline).
    std::chrono::steady_clock::time_point commit_retry_at_{}, release_retry_at_{};
    bool stop_ = false;
    // Atomic so that `closed` is readable without the mutex (and the GIL).
    std::atomic<bool> closed_{false};
    bool close_done_ = false;
    SpaceStats counters_;
    int efd_ = -1;
    std::thread thread_;
    std::shared_ptr<Ledger> ledger_;
    int slot_ = -1;
    int64_t pcb_ = 0;  // bytes per page commit: num_regions * page_bytes
    std::atomic<int32_t> waiting_{0};
    std::thread watcher_;  // futex-waits on the pool generation (cross-process wake-ups)
};

}  // namespace kvpool
