#include "space.hpp"

#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <system_error>

#include "geometry.hpp"

namespace kvpool {
namespace {
constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

// Bumped in every forked child: a space created before the fork sees another
// epoch there and turns inert (ARCHITECTURE.md: a space in a process that did not
// create it never releases pages). One load on the hot path, no getpid().
std::atomic<uint64_t> g_fork_epoch{0};
std::once_flag g_atfork_once;
void on_fork_child() { g_fork_epoch.fetch_add(1, std::memory_order_relaxed); }

std::string fault_text(const char* what, int64_t page, int err) {
    return std::string(what) + "(page " + std::to_string(page) + "): injected fault: " + std::strerror(err) +
           " (errno " + std::to_string(err) + ")";
}
}  // namespace

Space::Space(const SpaceConfig& cfg, std::unique_ptr<Backend> backend, std::shared_ptr<Ledger> ledger, int slot)
    : cfg_(cfg),
      backend_(std::move(backend)),
      cv_ptr_(new std::condition_variable()),
      cv_(*cv_ptr_),
      budget_(std::move(ledger), slot, cfg.num_regions * cfg.page_bytes, cfg.limit_bytes),
      pcb_(cfg.num_regions * cfg.page_bytes) {
    std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, on_fork_child); });
    fork_epoch_ = g_fork_epoch.load(std::memory_order_relaxed);
    // The budget read the pool at this generation: the watcher starts from
    // it, so a change made before its thread runs is not missed.
    watch_from_ = budget_.seen_generation();
}

std::unique_ptr<Space> Space::create(const SpaceConfig& cfg, std::unique_ptr<Backend> backend,
                                     std::shared_ptr<Ledger> ledger, int slot, Status* status) {
    if (cfg.page_bytes <= 0 || cfg.block_bytes <= 0 || cfg.num_blocks <= 0 || cfg.num_regions <= 0 ||
        cfg.block_bytes > cfg.page_bytes || cfg.reserve_min < 0 || cfg.reserve_max < cfg.reserve_min ||
        !(cfg.idle_release_s >= 0 && cfg.idle_release_s <= 1e9) || cfg.headroom_bytes < 0 ||
        (cfg.headroom_bytes > 0 && !ledger)) {
        *status = Status::make(Code::Invalid,
                               "invalid space configuration: page_bytes=" + std::to_string(cfg.page_bytes) +
                                   " block_bytes=" + std::to_string(cfg.block_bytes) + " num_blocks=" +
                                   std::to_string(cfg.num_blocks) + " num_regions=" + std::to_string(cfg.num_regions) +
                                   " reserve=(" + std::to_string(cfg.reserve_min) + ", " +
                                   std::to_string(cfg.reserve_max) + ") idle_release_s=" +
                                   std::to_string(cfg.idle_release_s) + " headroom_bytes=" +
                                   std::to_string(cfg.headroom_bytes) + "; need all sizes > 0, "
                                   "block_bytes <= page_bytes, 0 <= min <= max, 0 <= idle_release_s <= 1e9 and "
                                   "headroom_bytes >= 0 (> 0 only in a pool)");
        if (ledger) ledger->unregister_tenant(slot);  // no Space owns the slot: give it back here
        return nullptr;
    }
    std::unique_ptr<Space> s(new Space(cfg, std::move(backend), std::move(ledger), slot));
    *status = s->init();
    if (!status->is_ok()) return nullptr;  // ~Space -> close() unregisters the slot
    return s;
}

Status Space::init() {
    const int64_t P = cfg_.page_bytes, B = cfg_.block_bytes, N = cfg_.num_blocks;
    const int64_t np = num_pages_for(P, B, N);
    if (np > std::numeric_limits<int32_t>::max() || N > std::numeric_limits<int32_t>::max() / 2)
        return Status::make(Code::Invalid, "space too large: " + std::to_string(N) + " blocks on " +
                                               std::to_string(np) + " pages (at most 2**30 blocks)");
    table_.init(P, B, N);

    efd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd_ < 0) return Status::make(Code::Backend, errno_text("eventfd", errno));

    if (cfg_.headroom_bytes > 0) {
        std::lock_guard<std::mutex> lk(mu_);
        Status h = budget_.set_headroom(cfg_.headroom_bytes);  // the budget read the pool at construction
        if (!h.is_ok()) return h;
    }
    if (cfg_.null_block) {
        // Block 0 is held from the start and never handed out; its page is
        // pinned (committed for the space's lifetime). The first alloc of a
        // fresh space always yields block 0: page 0 holds floor(P/B) blocks,
        // the most any page holds, and is planned first.
        int64_t id = -1, avail = 0;
        std::unique_lock<std::mutex> lk(mu_);
        Status s = alloc_locked(lk, 1, &id, &avail, nullptr, /*nonblocking=*/false, /*promised=*/false);
        if (!s.is_ok()) return s;
        table_.page(0).pinned = true;
        used_ -= 1;  // the null block is not a user block
        counters_.allocs -= 1;
    }
    try {
        if (cfg_.reserve_thread) thread_ = std::thread([this] { thread_main(); });
        if (budget_.pooled()) watcher_ = std::thread([this] { watcher_main(); });
    } catch (const std::system_error& e) {
        // Out of threads (a pids cgroup, RLIMIT_NPROC): a typed failure, and
        // ~Space stops whichever thread did start.
        return Status::make(Code::Backend, std::string("cannot start the space's threads: ") + e.what() +
                                               " (a pids cgroup or RLIMIT_NPROC may be exhausted)");
    }
    return Status::ok();
}

Space::~Space() { close(); }

bool Space::inherited() const { return fork_epoch_ != g_fork_epoch.load(std::memory_order_relaxed); }

Status Space::check_usable() const {
    if (inherited())
        return Status::make(Code::Closed, "this KV space was inherited across fork(): it is inert in the child "
                                          "(create a new one there)");
    if (closed_) return Status::make(Code::Closed, "space is closed");
    return Status::ok();
}

// ------------------------------------------------------------- accounting

// The one limit verdict: committed pages (releasing ones still hold memory;
// committing ones are not counted yet) above the limit in force. DEFERRED in
// Python, limit_state 1 in the ledger, SpaceStats::limit_deferred: all read
// this, nothing re-derives it.
bool Space::limit_deferred_locked() const {
    const int64_t lim = budget_.limit_pages();
    return lim >= 0 && table_.committed() > lim;
}

// Idle committed pages (RESERVE, or COMMITTING by the thread) that may be
// handed out: all of them, unless a lowered limit puts some above it. Those
// are on their way back and must not be activated.
int64_t Space::idle_usable_pages_locked() const {
    const int64_t idle = table_.idle();
    const int64_t lim = budget_.limit_pages();
    if (lim < 0) return idle;
    return std::min(idle, std::max<int64_t>(0, lim - table_.count(PageState::Active)));
}

int64_t Space::idle_usable_cap_locked() const {
    const int64_t k = idle_usable_pages_locked();
    if (k == table_.idle()) return table_.blocks(PageState::Reserve) + table_.blocks(PageState::Committing);
    // Over the limit (rare): the k largest idle pages.
    std::vector<int32_t> caps;
    for (int32_t p : table_.reserve()) caps.push_back(table_.page(p).cap);
    for (int32_t p : table_.committing()) caps.push_back(table_.page(p).cap);
    std::sort(caps.rbegin(), caps.rend());
    int64_t sum = 0;
    for (int64_t i = 0; i < k; ++i) sum += caps[i];
    return sum;
}

int64_t Space::max_blocks_locked() const {
    const int64_t null = cfg_.null_block ? 1 : 0;
    const int64_t mp = budget_.max_pages();
    const int64_t blocks = mp < 0 ? table_.capacity() : table_.top_pages_blocks(mp);
    return std::max<int64_t>(0, std::min(blocks, table_.capacity()) - null);
}

// The settled view: in-flight commits count as reserve, in-flight releases as
// free (their claim comes back), so available() never depends on the reserve
// thread's timing; alloc waits for a transition when it needs the page in
// flight. A lender's (or restorer's) allocs are refused: nothing is available to it.
int64_t Space::available_locked() const {
    if (budget_.gives_back()) return 0;
    int64_t avail = table_.partial_free() + idle_usable_cap_locked();
    int64_t k = budget_.room_pages(false, table_.count(PageState::Releasing));
    std::vector<int32_t> rel;
    for (int32_t p : table_.releasing()) rel.push_back(table_.page(p).cap);
    std::sort(rel.rbegin(), rel.rend());
    size_t ri = 0;
    for (const auto& bucket : table_.free_by_cap()) {
        while (k > 0 && ri < rel.size() && rel[ri] >= bucket.first) { avail += rel[ri++]; --k; }
        const int64_t take = std::min<int64_t>(k, static_cast<int64_t>(bucket.second.size()));
        avail += take * bucket.first;
        k -= take;
        if (k == 0) break;
    }
    while (k > 0 && ri < rel.size()) { avail += rel[ri++]; --k; }
    return avail;
}

int64_t Space::available() {
    if (!check_usable().is_ok()) return 0;
    std::lock_guard<std::mutex> lk(mu_);
    refresh_budget_locked();
    republish_want_locked();
    return closed_ ? 0 : available_locked();
}

// enter_locked(nonblocking) without building a Status: the vLLM plugin's
// free count calls this once per request.
bool Space::try_available(int64_t* out) {
    *out = 0;
    if (inherited() || closed_) return true;  // nothing is available
    if (!mu_.try_lock()) return false;
    std::lock_guard<std::mutex> lk(mu_, std::adopt_lock);
    if (closed_) return true;
    if (!cfg_.reserve_thread && budget_.stale()) return false;  // a refresh may release pages: not here
    refresh_budget_locked();  // with a reserve thread: wakes it, no syscall here
    republish_want_locked();
    *out = available_locked();
    return true;
}

int64_t Space::max_blocks() {
    if (!check_usable().is_ok()) return 0;
    std::lock_guard<std::mutex> lk(mu_);
    refresh_budget_locked();
    return max_blocks_locked();
}

// The pool moved (a limit, a guarantee, a tenant waiting or leaving): take
// the budget's new verdicts and act on them — give pages back above a
// lowered limit or while lending, let a refill that lacked room retry.
void Space::refresh_budget_locked() {
    if (!budget_.stale()) return;
    budget_.refresh();
    act_on_budget_locked();
}

// The budget's verdicts may have changed (a refresh, or this tenant's own
// limit or guarantee, whose write refreshes the budget itself): act on them.
void Space::act_on_budget_locked() {
    // Pressure (another tenant waits, or this one lends) makes the whole
    // idle excess surplus now: it all goes back, even if the waiter is
    // served (and stops waiting) before the last of it is released.
    if (budget_.others_waiting() || budget_.gives_back())
        idle_surplus_ = std::max(idle_surplus_, table_.count(PageState::Reserve) - reserve_target_max_locked());
    commit_retry_at_ = {};
    if (cfg_.reserve_thread) cv_.notify_all();
    else release_inline_locked();
    report_locked();
}

void Space::report_locked() { budget_.report(limit_deferred_locked(), waiting_.load(), table_.count(PageState::Reserve)); }

// A waiter's manager asks available() before retrying its head: republish
// the want against the room there is now (space.hpp, last_need_pages_).
void Space::republish_want_locked() {
    if (waiting_.load() <= 0 || last_want_pages_ <= 0 || last_need_pages_ <= 0 || !budget_.pooled()) return;
    const int64_t room = budget_.room_pages(false, table_.count(PageState::Releasing));
    note_want_locked(std::max<int64_t>(1, last_need_pages_ - std::min(last_need_pages_, room)));
}

void Space::note_want_locked(int64_t pages) {
    if (waiting_.load() > 0) budget_.publish_want(std::max<int64_t>(1, pages));
    last_want_pages_ = pages;
}

void Space::report_waiting(int32_t waiting) {
    if (!check_usable().is_ok()) return;
    waiting_.store(std::max(0, waiting));
    std::lock_guard<std::mutex> lk(mu_);
    // Only requests that wait publish a want: a caller that gave up on a
    // shortage must not keep other tenants lending.
    budget_.publish_want(waiting > 0 ? std::max<int64_t>(1, last_want_pages_) : 0);
    if (waiting <= 0) last_want_pages_ = last_need_pages_ = 0;
    report_locked();
}

Status Space::shortage_locked(int64_t n, const std::string& why, int64_t* available) {
    ++counters_.shortages;
    *available = available_locked();
    return Status::make(Code::Shortage, "requested " + std::to_string(n) + " blocks, " + std::to_string(*available) +
                                            " available" + (why.empty() ? "" : ": " + why));
}

// -------------------------------------------------------- fault injection

void Space::inject_fault(FaultKind kind, int64_t nth, int err) {
    if (!check_usable().is_ok()) return;
    std::lock_guard<std::mutex> lk(mu_);
    fault_nth_[static_cast<int>(kind)] = nth;
    fault_err_[static_cast<int>(kind)] = err;
}

int Space::consume_fault_locked(FaultKind kind) {
    const int k = static_cast<int>(kind);
    if (fault_nth_[k] <= 0) return 0;
    if (--fault_nth_[k] == 0) return fault_err_[k];
    return 0;
}

Status Space::do_commit(int32_t p, int injected_err) {
    if (injected_err != 0)
        return Status::make((injected_err == ENOSPC || injected_err == ENOMEM) ? Code::Shortage : Code::Backend,
                            fault_text("commit", p, injected_err));
    return backend_->commit(p);
}

Status Space::do_release(int32_t p, int injected_err) {
    if (injected_err != 0) return Status::make(Code::Backend, fault_text("release", p, injected_err));
    return backend_->release(p);
}

// A page whose release succeeded: FREE again, its claim returned to the pool.
void Space::released_locked(int32_t p) {
    // The release went through, but the backend may have recorded a failure
    // past its point of no return (a handle it could not free): surface it.
    std::string late = backend_->last_error();
    if (!late.empty()) counters_.last_error = std::move(late);
    table_.set_state(p, PageState::Free);
    ++counters_.releases;
    budget_.release(1);
}

Status Space::trim(int64_t* released) {
    *released = 0;
    Status usable = check_usable();
    if (!usable.is_ok()) return usable;
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return Status::make(Code::Closed, "space is closed");
    Status result = Status::ok();
    std::vector<int32_t> pages = table_.reserve();
    for (auto it = pages.rbegin(); it != pages.rend(); ++it) {
        Status s = do_release(*it, consume_fault_locked(FaultKind::Release));
        if (!s.is_ok()) {
            ++counters_.release_failures;
            counters_.last_error = s.message;
            if (result.is_ok()) result = s;
            continue;  // stays idle reserve
        }
        released_locked(*it);
        ++*released;
    }
    if (*released) report_locked();
    commit_retry_at_ = {};
    cv_.notify_all();
    return result;
}

Status Space::set_limit(int64_t bytes, int64_t revision, LimitResult* result) {
    *result = LimitResult::Applied;
    Status usable = check_usable();
    if (!usable.is_ok()) return usable;
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return Status::make(Code::Closed, "space is closed");
    Status s = budget_.set_limit(bytes, revision, result);
    if (!s.is_ok() || *result != LimitResult::Applied) return s;
    act_on_budget_locked();  // gives pages back above a lowered limit
    signal_eventfd();  // a raised limit is new capacity for whoever waits
    return Status::ok();
}

Status Space::set_headroom(int64_t bytes) {
    Status usable = check_usable();
    if (!usable.is_ok()) return usable;
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return Status::make(Code::Closed, "space is closed");
    refresh_budget_locked();  // keep_free is judged against the guarantee in force
    return budget_.set_headroom(bytes);
}

Status Space::set_guarantee(int64_t bytes, int64_t revision, LimitResult* result) {
    *result = LimitResult::Applied;
    Status usable = check_usable();
    if (!usable.is_ok()) return usable;
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return Status::make(Code::Closed, "space is closed");
    Status s = budget_.set_guarantee(bytes, revision, result);
    if (!s.is_ok() || *result != LimitResult::Applied) return s;
    // A lowered guarantee can make this tenant lend: its idle pages go back
    // now, as when another tenant's change makes it lend.
    act_on_budget_locked();
    signal_eventfd();
    return s;
}

Status Space::set_reserve(int64_t min_pages, int64_t max_pages) {
    Status usable = check_usable();
    if (!usable.is_ok()) return usable;
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return Status::make(Code::Closed, "space is closed");
    if (min_pages < 0 || max_pages < min_pages)
        return Status::make(Code::Invalid, "reserve needs 0 <= min <= max, got min=" + std::to_string(min_pages) +
                                               " max=" + std::to_string(max_pages));
    cfg_.reserve_min = min_pages;
    cfg_.reserve_max = max_pages;
    // The same re-balancing as a limit change: releases above max, refills below min.
    commit_retry_at_ = {};
    if (cfg_.reserve_thread) cv_.notify_all();
    else release_inline_locked();
    report_locked();
    return Status::ok();
}

Status Space::page_occupancy(const int64_t* pages, int64_t n, int64_t* used, int64_t* state) {
    Status usable = check_usable();
    if (!usable.is_ok()) return usable;
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return Status::make(Code::Closed, "space is closed");
    for (int64_t i = 0; i < n; ++i)
        if (pages[i] < 0 || pages[i] >= num_pages())
            return Status::make(Code::Invalid, "page " + std::to_string(pages[i]) + " is out of range [0, " +
                                                   std::to_string(num_pages()) + ")");
    for (int64_t i = 0; i < n; ++i) {
        const auto& pg = table_.page(static_cast<int32_t>(pages[i]));
        state[i] = static_cast<int64_t>(pg.state);
        used[i] = pg.state == PageState::Active ? pg.cap - pg.nfree : 0;
    }
    return Status::ok();
}

SpaceStats Space::stats() {
    SpaceStats s = counters_;
    s.num_blocks = cfg_.num_blocks;
    s.capacity = table_.capacity();
    s.num_pages = num_pages();
    s.page_commit_bytes = pcb_;
    if (!check_usable().is_ok()) return s;
    std::lock_guard<std::mutex> lk(mu_);
    s = counters_;
    s.num_blocks = cfg_.num_blocks;
    s.capacity = table_.capacity();
    s.num_pages = num_pages();
    s.page_commit_bytes = pcb_;
    s.used_blocks = used_;
    s.available = closed_ ? 0 : available_locked();
    s.pages_free = table_.count(PageState::Free);
    s.pages_committing = table_.count(PageState::Committing);
    s.pages_reserve = table_.count(PageState::Reserve);
    s.pages_active = table_.count(PageState::Active);
    s.pages_releasing = table_.count(PageState::Releasing);
    s.room_blocks = table_.partial_free();
    s.committed_bytes = table_.committed() * pcb_;
    s.limit_pages = budget_.limit_pages();
    s.limit_deferred = limit_deferred_locked();
    s.max_blocks = max_blocks_locked();
    s.budget = budget_.figures();
    s.backend = backend_->describe();
    return s;
}

BudgetFigures Space::budget() {
    if (!check_usable().is_ok()) return BudgetFigures{};
    std::lock_guard<std::mutex> lk(mu_);
    refresh_budget_locked();
    budget_.judge_preempt();  // rule 6: on a fresh snapshot (others' freeing moves without a generation)
    return budget_.figures();
}

Status Space::publish_freeing(int64_t bytes) {
    Status usable = check_usable();
    if (!usable.is_ok()) return usable;
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return Status::make(Code::Closed, "space is closed");
    return budget_.publish_freeing(bytes);
}

Status Space::set_preempts(bool preempts) {
    Status usable = check_usable();
    if (!usable.is_ok()) return usable;
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return Status::make(Code::Closed, "space is closed");
    budget_.set_preempts(preempts);
    budget_.judge_preempt();  // its own verdict: 0 from now on if it does not preempt
    return Status::ok();
}

int64_t Space::allocated_bytes() {
    if (!check_usable().is_ok()) return 0;
    std::lock_guard<std::mutex> lk(mu_);
    return backend_->allocated_bytes();
}

void Space::signal_eventfd() {
    const uint64_t one = 1;
    // EAGAIN only if the counter would overflow: the fd is readable anyway.
    ssize_t r = ::write(efd_, &one, sizeof(one));
    (void)r;
}

void Space::close() {
    if (inherited()) {
        // A forked child: the threads, the memory and the tenant slot belong
        // to the parent. Touch none of them (the mutex may even have been
        // held by a parent thread at fork time); leave the objects behind.
        closed_ = true;
        if (thread_.joinable()) thread_.detach();
        if (watcher_.joinable()) watcher_.detach();
        (void)cv_ptr_.release();
        if (backend_) backend_->abandon();  // unmaps here only: never punches the parent's memory
        efd_ = -1;
        return;
    }
    std::unique_lock<std::mutex> lk(mu_);
    if (closed_) {
        // Another caller is closing: return only once memory is really back.
        cv_.wait(lk, [this] { return close_done_; });
        return;
    }
    closed_ = true;
    stop_ = true;
    cv_.notify_all();
    lk.unlock();
    if (thread_.joinable()) thread_.join();
    if (watcher_.joinable()) {
        // Wake the watcher out of its futex wait (it re-checks stop_).
        budget_.ledger()->bump_generation();
        watcher_.join();
    }
    lk.lock();
    backend_->close();  // gives every committed byte back
    if (budget_.pooled()) budget_.ledger()->unregister_tenant(budget_.slot());  // and its claims to the pool
    if (efd_ >= 0) ::close(efd_);
    efd_ = -1;
    close_done_ = true;
    cv_.notify_all();
}

}  // namespace kvpool
