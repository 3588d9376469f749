// The space's two threads.
//
// Reserve thread: keeps at least reserve_min idle committed pages, and gives
// idle pages back: while over the limit or while lending (a lender keeps no
// idle pages: they go back to the pool at once); above reserve_max while
// another tenant waits (all the excess seen then, even if the waiter is served
// first); and otherwise above reserve_max only once they stayed
// unused for a whole idle interval (idle_release_s), so a steady alloc/free
// loop never commits and releases the same pages over and over. It never calls into
// Python (it has no Python state at all) and never holds mu_ across a
// syscall: it marks the page COMMITTING/RELEASING, unlocks, runs the syscall,
// relocks.
//
// Pool watcher (pooled spaces): futex-waits on the pool's generation word and
// wakes only when it moves (another tenant released budget someone waits for,
// a setting changed, a tenant joined, left or started waiting). It then takes
// the budget's new verdicts and signals the eventfd so a waiting manager
// re-dispatches. No polling: an idle space sleeps until the pool changes.
// Only while this tenant has waiting requests does it also wake once a second
// to reap tenants that died holding budget (a dead process bumps nothing).
#include <algorithm>

#include "space.hpp"

namespace kvpool {

// While lending, or while another tenant waits below its guarantee, no idle
// page is kept: pages no block uses are what such a waiter may need to reach
// its guarantee (or one request's worth above it), and a tenant within its
// own guarantee keeps every page it uses, never its idle ones.
int64_t Space::reserve_target_max_locked() const {
    return budget_.gives_back() || budget_.starving() ? 0 : cfg_.reserve_max;
}

// Idle pages above the reserve's max go back now, not after the idle
// interval: another tenant waits (or this one lends), or no interval is set.
bool Space::release_pressed_locked() const {
    return cfg_.idle_release_s <= 0 || budget_.gives_back() || budget_.others_waiting();
}

// A new idle interval: it ends idle_release_s from now; the low-water mark
// starts at the reserve as it is (alloc lowers it as it takes pages).
void Space::arm_idle_interval_locked() {
    idle_tick_at_ = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(cfg_.idle_release_s));
    idle_low_water_ = table_.count(PageState::Reserve);
}

// What the reserve thread wants to do. One definition for the thread and for
// settle(), which must agree on "nothing left to do". `cheap` skips the
// pool's room (a ledger snapshot): the hot paths only decide whether to wake
// the thread, which then looks properly.
Space::ThreadWork Space::thread_work_locked(std::chrono::steady_clock::time_point now) const {
    ThreadWork w{};
    const int64_t lim = budget_.limit_pages();
    const int64_t n_reserve = table_.count(PageState::Reserve);
    const bool over_limit = n_reserve > 0 && lim >= 0 &&
                            table_.count(PageState::Active) + n_reserve + table_.count(PageState::Committing) > lim;
    const bool excess = n_reserve > reserve_target_max_locked();
    w.want_release = over_limit || (excess && (idle_surplus_ > 0 || release_pressed_locked()));
    const int64_t target_min = budget_.gives_back() || budget_.starving() ? 0 : cfg_.reserve_min;
    w.want_commit = table_.idle() < target_min && !table_.free_by_cap().empty() && budget_.room_pages() > 0;
    w.release_now = w.want_release && now >= release_retry_at_;
    w.commit_now = w.want_commit && now >= commit_retry_at_;
    return w;
}

bool Space::thread_has_work_locked() const {
    const ThreadWork w = thread_work_locked(std::chrono::steady_clock::now());
    return w.release_now || w.commit_now;
}

void Space::thread_main() {
    using clock = std::chrono::steady_clock;
    constexpr auto kRetry = std::chrono::milliseconds(200);
    std::unique_lock<std::mutex> lk(mu_);
    while (!stop_) {
        const ThreadWork work = thread_work_locked(clock::now());
        if (work.release_now) {
            const int32_t p = table_.reserve().back();
            table_.set_state(p, PageState::Releasing);
            const int err = consume_fault_locked(FaultKind::Release);
            lk.unlock();
            Status s = do_release(p, err);
            lk.lock();
            if (s.is_ok()) {
                released_locked(p);
                if (idle_surplus_ > 0) --idle_surplus_;
                report_locked();
                signal_eventfd();  // budget came back: a waiter under a limit may fit now
            } else {
                ++counters_.release_failures;
                counters_.last_error = s.message;
                table_.set_state(p, PageState::Reserve);
                release_retry_at_ = clock::now() + kRetry;  // notifications do not shorten this
            }
            cv_.notify_all();
            continue;
        }
        if (work.commit_now) {
            std::string why;
            if (!budget_.claim(1, &why)) {
                // The pool is full: wait for budget (a generation change
                // resets this deadline) instead of spinning.
                commit_retry_at_ = clock::now() + kRetry;
                continue;
            }
            // Largest capacity first, as available() counts.
            const auto& bucket = table_.free_by_cap().front().second;
            const int32_t p = bucket.back();
            table_.set_state(p, PageState::Committing);
            const int err = consume_fault_locked(FaultKind::Commit);
            lk.unlock();
            Status s = do_commit(p, err);
            lk.lock();
            if (s.is_ok()) {
                table_.set_state(p, PageState::Reserve);
                ++counters_.commits;
                signal_eventfd();
            } else {
                table_.set_state(p, PageState::Free);
                budget_.release(1);
                ++counters_.commit_failures;
                counters_.last_error = s.message;
                // Out of memory or a failing backend: retry later, or sooner
                // if a free/trim/new reserve setting resets the deadline.
                commit_retry_at_ = clock::now() + kRetry;
            }
            cv_.notify_all();
            continue;
        }
        // The idle interval, while idle pages exceed the reserve's max: at
        // its end, those that stayed idle all along (the low-water mark above
        // max) go back; then a new interval starts if the excess remains.
        auto wake_at = clock::time_point::max();
        const int64_t excess = table_.count(PageState::Reserve) - reserve_target_max_locked();
        if (excess > 0 && cfg_.idle_release_s > 0) {
            if (idle_tick_at_ == clock::time_point::max()) {
                arm_idle_interval_locked();
            } else if (clock::now() >= idle_tick_at_) {
                idle_surplus_ = std::max<int64_t>(
                    idle_surplus_, std::min(idle_low_water_, table_.count(PageState::Reserve)) -
                                       reserve_target_max_locked());
                arm_idle_interval_locked();
                if (idle_surplus_ > 0) continue;  // release them (want_release sees the surplus)
            }
            wake_at = idle_tick_at_;
        } else {
            idle_tick_at_ = clock::time_point::max();
            idle_surplus_ = 0;
        }
        cv_.notify_all();  // wake settle() waiters: nothing to do now
        if (work.want_release) wake_at = std::min(wake_at, release_retry_at_);
        if (work.want_commit) wake_at = std::min(wake_at, commit_retry_at_);
        if (wake_at == clock::time_point::max()) cv_.wait(lk);
        else cv_.wait_until(lk, wake_at);
    }
}

void Space::watcher_main() {
    const std::shared_ptr<Ledger>& ledger = budget_.ledger();
    uint32_t seen = watch_from_;
    while (true) {
        {
            // After reading `seen`: close() sets stop_ before it bumps the
            // generation, so either we see stop_ here or the wait below
            // returns at once (a thread started after close's bump).
            std::lock_guard<std::mutex> lk(mu_);
            if (stop_) return;
        }
        ledger->wait_generation(seen, waiting_.load() > 0 ? 1.0 : -1.0);
        // Someone here waits for budget: a tenant that died holding it is
        // reaped by whoever notices; be that one (reap bumps the generation).
        if (waiting_.load() > 0) ledger->reap();
        const uint32_t now = ledger->generation();
        {
            std::lock_guard<std::mutex> lk(mu_);
            if (stop_) return;
            if (now == seen) continue;  // a timeout or a spurious wake: nothing changed
            refresh_budget_locked();
        }
        seen = now;
        signal_eventfd();
    }
}

bool Space::settle(double timeout_s) {
    if (!check_usable().is_ok()) return true;
    std::unique_lock<std::mutex> lk(mu_);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (!closed_ && (table_.count(PageState::Committing) > 0 || table_.count(PageState::Releasing) > 0 ||
                        (cfg_.reserve_thread && thread_has_work_locked()))) {
        cv_.notify_all();
        if (cv_.wait_until(lk, deadline) == std::cv_status::timeout) return false;
    }
    return true;
}

}  // namespace kvpool
