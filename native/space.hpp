// One KV space: a page table (page_table.hpp), a budget (budget.hpp), a
// reserve thread and a pool watcher (reserve.cpp) over a Backend. Plain
// C++17; knows nothing of Python (see bindings.cpp).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend.hpp"
#include "budget.hpp"
#include "ledger.hpp"
#include "page_table.hpp"
#include "status.hpp"

namespace kvpool {

struct SpaceConfig {
    int64_t num_regions = 1;
    int64_t page_bytes = 2 << 20;
    int64_t block_bytes = 0;
    int64_t num_blocks = 0;
    bool null_block = false;
    int64_t reserve_min = 1;   // idle committed pages the thread keeps ready
    int64_t reserve_max = 2;   // idle committed pages kept before releasing
    bool reserve_thread = true;
    int64_t limit_bytes = -1;  // the private budget's limit (a pooled space's lives in the ledger)
    // Idle pages above reserve_max go back to the pool on pressure (a lowered
    // limit, lending, another tenant waiting) at once, otherwise only once
    // they stayed unused for a whole interval of this length (0: at once, as
    // they empty). Keeps a steady alloc/free loop free of page syscalls.
    double idle_release_s = 1.0;
    // Bytes of the unused guarantee borrowers leave free (budget.hpp, rule 5);
    // a pooled space only. Published in the ledger before the first alloc.
    int64_t headroom_bytes = 0;
};

struct SpaceStats {
    int64_t num_blocks = 0, capacity = 0, num_pages = 0, used_blocks = 0, available = 0;
    int64_t pages_free = 0, pages_committing = 0, pages_reserve = 0, pages_active = 0,
            pages_releasing = 0;
    // Free blocks on ACTIVE pages: what an alloc fills without committing a
    // page (a lender's running requests grow only into these).
    int64_t room_blocks = 0;
    int64_t committed_bytes = 0, page_commit_bytes = 0, limit_pages = -1;
    // The one limit verdict (Space::limit_deferred_locked): committed pages
    // above the limit in force, waiting to be given back as they empty.
    bool limit_deferred = false;
    int64_t max_blocks = 0;  // the most this tenant can ever hold (admission)
    int64_t allocs = 0, frees = 0, shortages = 0;
    int64_t commits = 0, releases = 0, inline_commits = 0, inline_releases = 0;
    int64_t commit_failures = 0, release_failures = 0;
    std::string last_error;
    BudgetFigures budget;
    std::string backend;  // what the backend chose (mapping counts, CUDA offset mode)
};

enum class FaultKind : int { Commit = 0, Release = 1 };

// How Space::acquire waits (acquire.cpp).
struct AcquireWait {
    bool promised = false;  // as Space::alloc's `promised`
    // Give up (Shortage, "stalled") after this long with no other tenant
    // making progress: nobody claimed, freed, was granted, joined, left or
    // changed a setting. A stopped or hung peer costs a shortage; a busy
    // one only time.
    double stall_s = 30.0;
    double timeout_s = std::numeric_limits<double>::infinity();  // give up after this long in all
    // Polled between waits (never with the space mutex held): true ends the
    // wait with Interrupted, nothing held.
    std::function<bool()> interrupted;
};

class Space {
public:
    // Returns nullptr and sets *status on failure. With a ledger, `slot` is
    // this space's tenant slot, owned from here on: a failed create
    // unregisters it.
    static std::unique_ptr<Space> create(const SpaceConfig& cfg, std::unique_ptr<Backend> backend,
                                         std::shared_ptr<Ledger> ledger, int slot, Status* status);
    ~Space();
    Space(const Space&) = delete;
    Space& operator=(const Space&) = delete;

    // All-or-nothing: writes n ids to out, or changes nothing and returns a
    // Shortage (with *available set; on success it is not computed),
    // Unsatisfiable (n beyond what the tenant can ever hold) or another failure. *committed (optional) = pages this
    // call committed inline.
    // nonblocking: return WouldBlock, before changing anything, instead of
    // waiting for the mutex, committing a page, waiting for a page in flight
    // or reaping (the binding calls it first with the GIL held).
    // `promised`: the caller read available() >= n while this tenant was not
    // lending, and a tenant below its guarantee may have started waiting
    // since (another process). Such an alloc is granted as that count said:
    // the lending verdict and the waiters' protections do not refuse it,
    // the limit and the pool's free bytes still do. An engine that promised
    // blocks to its scheduler (the vLLM plugin's free count) cannot take the
    // promise back mid-step; it stops growing at its next count instead.
    Status alloc(int64_t n, int64_t* out, int64_t* available, int64_t* committed = nullptr,
                 bool nonblocking = false, bool promised = false);
    // The one bounded wait of every synchronous caller (the vLLM block pool,
    // the SGLang allocator): alloc, and on a shortage wait for memory to
    // come back and try again. While it waits the space reports one waiting
    // request (unless the caller already reports its own), so lenders give
    // back; it wakes on the pool's generation (cross-process) and the
    // reserve thread, through the eventfd. Answers as alloc does, once:
    // Unsatisfiable at once, never queued; Shortage only when the pool
    // stalled (AcquireWait::stall_s) or the timeout passed.
    Status acquire(int64_t n, int64_t* out, int64_t* available, const AcquireWait& wait);
    // Validates the whole batch first; on any bad id changes nothing and
    // returns Invalid with the offending ids in *bad. *released (optional) =
    // pages this call released inline; *available (optional) = available()
    // after the call. Never waits on another process.
    // nonblocking: WouldBlock (nothing changed) if the mutex is taken; and
    // without a reserve thread no inline release: *release_due says pages
    // are due to go back, which release_inline() (GIL released) then does.
    // `preempted` (> 0): the ids are those of that many requests preempted,
    // with `tokens` to recompute (budget.hpp, rule 6: counted as such);
    // `evicted`: cached blocks the engine drops (counted as such while lending).
    Status free(const int64_t* ids, int64_t n, std::vector<int64_t>* bad, int64_t* released = nullptr,
                int64_t* available = nullptr, bool nonblocking = false, bool* release_due = nullptr,
                int64_t preempted = 0, int64_t tokens = 0, bool evicted = false);
    // Without a reserve thread: release the idle pages due to go back; returns how many.
    int64_t release_inline();
    int64_t available();
    // available() that never waits: false (nothing computed) if the mutex is
    // taken, or if a stale budget would release pages inline (no reserve
    // thread); the binding then calls available() without the GIL.
    bool try_available(int64_t* out);
    // The most blocks this tenant can ever hold (min of limit and pool
    // capacity, through the page formula).
    int64_t max_blocks();
    Status trim(int64_t* released);
    Status set_limit(int64_t bytes, int64_t revision, LimitResult* result);
    Status set_guarantee(int64_t bytes, int64_t revision, LimitResult* result);
    Status set_headroom(int64_t bytes);  // budget.hpp, rule 5
    Status publish_freeing(int64_t bytes);  // budget.hpp, rule 6
    Status set_preempts(bool preempts);     // budget.hpp, rule 6
    Status set_reserve(int64_t min_pages, int64_t max_pages);
    Status page_occupancy(const int64_t* pages, int64_t n, int64_t* used, int64_t* state);
    SpaceStats stats();
    BudgetFigures budget();
    bool settle(double timeout_s);
    void inject_fault(FaultKind kind, int64_t nth, int err);
    int64_t allocated_bytes();
    // Pages the last alloc committed / the last free (or release_inline)
    // released inline: read by the caller's thread right after its call,
    // for debug traces only.
    int64_t last_alloc_commits() const { return last_alloc_commits_.load(std::memory_order_relaxed); }
    int64_t last_free_releases() const { return last_free_releases_.load(std::memory_order_relaxed); }
    void* region_base(int64_t region) const { return backend_->region_base(region); }
    int device_type() const { return backend_->device_type(); }
    int device_id() const { return backend_->device_id(); }
    int share_fd() const { return backend_->share_fd(); }
    int mirror_fd() const { return backend_->mirror_fd(); }
    uint64_t mirror_nonce() const { return backend_->mirror_nonce(); }
    int eventfd() const { return efd_; }
    const SpaceConfig& config() const { return cfg_; }
    int64_t capacity() const { return table_.capacity(); }
    int64_t num_pages() const { return table_.num_pages(); }
    bool closed() const { return closed_.load(std::memory_order_acquire); }
    bool has_ledger() const { return budget_.pooled(); }
    // A space inherited across fork() is inert in the child: it answers
    // Closed and never touches the memory, the threads or the ledger.
    bool inherited() const;
    void report_waiting(int32_t waiting);
    void close();

private:
    explicit Space(const SpaceConfig& cfg, std::unique_ptr<Backend> backend, std::shared_ptr<Ledger> ledger, int slot);
    Status init();
    Status check_usable() const;
    Status enter_locked(std::unique_lock<std::mutex>& lk, bool nonblocking);
    // alloc() once entered, uncounted in the ledger (alloc() counts its answer;
    // init()'s null block is no tenant's alloc). May wait on cv_ through lk.
    Status alloc_locked(std::unique_lock<std::mutex>& lk, int64_t n, int64_t* out, int64_t* available,
                        int64_t* committed, bool nonblocking, bool promised);
    // Its steps (alloc.cpp), in order.
    Status admit_locked(int64_t n, int64_t* available, bool promised);
    Status plan_locked(std::unique_lock<std::mutex>& lk, int64_t n, int64_t* available, bool nonblocking,
                       bool promised, std::vector<int32_t>* plan);
    Status claim_and_commit_locked(const std::vector<int32_t>& plan, int64_t n, int64_t* available, bool promised);
    void hand_out_locked(int64_t n, int64_t* out);

    // --- accounting, all called with mu_ held ---
    bool limit_deferred_locked() const;
    int64_t idle_usable_pages_locked() const;
    int64_t idle_usable_cap_locked() const;
    int64_t available_locked() const;
    int64_t max_blocks_locked() const;
    void refresh_budget_locked();
    void act_on_budget_locked();
    void report_locked();
    void note_want_locked(int64_t pages);
    Status shortage_locked(int64_t n, const std::string& why, int64_t* available);

    // --- page operations ---
    void released_locked(int32_t p);
    int64_t release_inline_locked();
    bool inline_release_due_locked() const;
    Status reject_free_locked(const int64_t* ids, int64_t n, std::vector<int64_t>* bad);
    Status do_commit(int32_t p, int injected_err);
    Status do_release(int32_t p, int injected_err);
    int consume_fault_locked(FaultKind kind);
    void signal_eventfd();
    // acquire(): a mark of what others did (acquire.cpp), and one wait for
    // a wake-up of at most `seconds`.
    uint64_t progress_mark_locked() const;
    void wait_wakeup(double seconds);

    // --- reserve thread and pool watcher (reserve.cpp) ---
    struct ThreadWork {
        bool want_release, want_commit;  // wanted, whatever the retry deadlines
        bool release_now, commit_now;    // wanted and due now
    };
    ThreadWork thread_work_locked(std::chrono::steady_clock::time_point now) const;
    bool thread_has_work_locked() const;
    int64_t reserve_target_max_locked() const;
    bool release_pressed_locked() const;
    void arm_idle_interval_locked();
    void thread_main();
    void watcher_main();

    SpaceConfig cfg_;
    std::unique_ptr<Backend> backend_;
    std::mutex mu_;
    // Heap-held so that a forked child can leave it alone: destroying a
    // condition variable whose waiters lived in the parent hangs.
    std::unique_ptr<std::condition_variable> cv_ptr_;
    std::condition_variable& cv_;  // page transitions, thread work, settle
    PageTable table_;
    Budget budget_;
    int64_t used_ = 0;
    int64_t fault_nth_[2] = {0, 0};
    int fault_err_[2] = {0, 0};
    // After a failed commit/release the thread retries no earlier than these
    // (a free, trim or new reserve setting resets the commit deadline).
    std::chrono::steady_clock::time_point commit_retry_at_{}, release_retry_at_{};
    // The idle interval (cfg_.idle_release_s): armed while idle pages exceed
    // the reserve's max; at its end the pages that stayed idle all along
    // (the low-water mark of the reserve above max) may go back.
    std::chrono::steady_clock::time_point idle_tick_at_ = std::chrono::steady_clock::time_point::max();
    int64_t idle_low_water_ = 0;   // fewest RESERVE pages seen since the interval began
    int64_t idle_surplus_ = 0;     // pages the last interval found unused: may be released now
    // Scratch for free()'s copy of the ids on its blocking path (under mu_).
    std::vector<int64_t> free_ids_;
    bool stop_ = false;
    std::atomic<bool> closed_{false};
    bool close_done_ = false;
    SpaceStats counters_;
    int efd_ = -1;
    std::thread thread_;
    std::thread watcher_;  // futex-waits on the pool generation (cross-process wake-ups)
    int64_t pcb_ = 0;  // bytes per page commit: num_regions * page_bytes
    std::atomic<int32_t> waiting_{0};
    std::atomic<int64_t> last_alloc_commits_{0}, last_free_releases_{0};
    int64_t last_want_pages_ = 0;  // pages the last shortage lacked (published while requests wait)
    // Pages the last shortage needed in all (room it had included): while
    // requests wait, available() republishes the want as this less the room
    // there is now, so memory freed since lowers what lenders are asked
    // (budget.hpp, rule 6) without waiting for the next alloc attempt.
    int64_t last_need_pages_ = 0;
    void republish_want_locked();
    uint64_t fork_epoch_ = 0;
    uint32_t watch_from_ = 0;  // pool generation the watcher starts from
};

}  // namespace kvpool
