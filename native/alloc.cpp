// The hot path of a KV space: alloc and free (space.hpp), and the inline
// page releases of a space without a reserve thread. Both run first
// non-blocking with the caller's GIL held (bindings.cpp): every step that
// would wait (the mutex, a page syscall, a page in flight, reaping) returns
// WouldBlock before anything changed, and the binding retries blocking.
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>

#include "space.hpp"
#include "sizes.hpp"

namespace kvpool {
namespace {
constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();
}  // namespace

// ------------------------------------------------------------------ alloc

namespace {
Status would_block() { return Status{Code::WouldBlock, std::string()}; }
}  // namespace

// The way into alloc and free: the space usable, its mutex taken (or, when
// non-blocking, WouldBlock if it is not free, or if the call might release
// pages inline: a budget refresh without a reserve thread does).
Status Space::enter_locked(std::unique_lock<std::mutex>& lk, bool nonblocking) {
    Status usable = check_usable();
    if (!usable.is_ok()) return usable;
    if (!nonblocking) lk.lock();
    else if (!lk.try_lock()) return would_block();
    if (closed_) return Status::make(Code::Closed, "space is closed");
    if (nonblocking && !cfg_.reserve_thread && budget_.stale()) return would_block();
    return Status::ok();
}

Status Space::alloc(int64_t n, int64_t* out, int64_t* available, int64_t* committed, bool nonblocking,
                    bool promised) {
    *available = 0;
    if (committed) *committed = 0;
    std::unique_lock<std::mutex> lk(mu_, std::defer_lock);
    Status entered = enter_locked(lk, nonblocking);
    if (!entered.is_ok()) return entered;
    Status s = alloc_locked(lk, n, out, available, committed, nonblocking, promised);
    // The ledger counts each answer the caller gets, exactly as the space's
    // own allocs/shortages do: a grant of n > 0 blocks, or a refusal for lack
    // of memory or admission. WouldBlock is no answer (the binding retries
    // blocking); a bad n or a driver failure is no shortage. Still under the
    // mutex: a concurrent close() cannot have given the slot back yet.
    if (s.is_ok() ? n > 0 : s.code == Code::Shortage || s.code == Code::Unsatisfiable)
        budget_.count_alloc(s.is_ok());
    return s;
}

// alloc() once entered: admit, plan, claim and commit, hand out. Each step
// either answers having changed nothing, or leaves the next one a plan it
// can finish.
Status Space::alloc_locked(std::unique_lock<std::mutex>& lk, int64_t n, int64_t* out, int64_t* available,
                           int64_t* committed, bool nonblocking, bool promised) {
    if (n < 0) return Status::make(Code::Invalid, "alloc: n must be >= 0, got " + std::to_string(n));
    if (n == 0) return Status::ok();
    Status s = admit_locked(n, available, promised);
    if (!s.is_ok()) return s;
    std::vector<int32_t> plan;  // FREE pages this call must commit
    s = plan_locked(lk, n, available, nonblocking, promised, &plan);
    if (!s.is_ok()) return s;
    if (nonblocking && !plan.empty()) return would_block();  // page commits are syscalls
    s = claim_and_commit_locked(plan, n, available, promised);
    if (!s.is_ok()) return s;
    hand_out_locked(n, out);
    idle_low_water_ = std::min(idle_low_water_, table_.count(PageState::Reserve));
    if (committed) *committed = static_cast<int64_t>(plan.size());
    last_alloc_commits_.store(static_cast<int64_t>(plan.size()), std::memory_order_relaxed);
    used_ += n;
    ++counters_.allocs;
    if (budget_.want_pages() > 0 && waiting_.load() == 0) budget_.publish_want(0);
    if (cfg_.reserve_thread && table_.idle() < cfg_.reserve_min) cv_.notify_all();
    return Status::ok();
}

// Admission: never queue what can never be granted; and a tenant that gives
// memory back (lending, restoring) does not grow unless its count promised.
Status Space::admit_locked(int64_t n, int64_t* available, bool promised) {
    refresh_budget_locked();
    // Admission: never queue what can never be granted. Checked before `out`
    // is touched: the caller may pass no buffer.
    // (Blocks on pages already committed above a lowered limit can still be
    // handed out: only what neither fits is refused.)
    const int64_t maxb = max_blocks_locked();
    if (n > maxb && n > available_locked()) {
        ++counters_.shortages;
        *available = available_locked();
        const BudgetFigures f = budget_.figures();
        std::string why = "this tenant can never hold more than " + std::to_string(maxb) +
                          " blocks (space capacity " + std::to_string(table_.capacity());
        if (f.limit_bytes >= 0) why += ", limit " + format_size_exact(f.limit_bytes);
        if (f.pool_capacity >= 0) why += ", pool capacity " + format_size_exact(f.pool_capacity);
        why += ", " + format_size_exact(pcb_) + " per page commit)";
        return Status::make(Code::Unsatisfiable, why);
    }
    if (budget_.gives_back() && !promised)
        return shortage_locked(n, budget_.lending() ? "this tenant lends its pages to a tenant below its guarantee"
                                                    : "this tenant borrows what other tenants keep free (their headroom)",
                               available);

    return Status::ok();
}

// The FREE pages to commit for n blocks beyond the usable ones (*plan), or a
// shortage (the want published). Waits on cv_ through lk for a page in
// flight, and reaps dead tenants when short of pool budget, then plans again.
Status Space::plan_locked(std::unique_lock<std::mutex>& lk, int64_t n, int64_t* available, bool nonblocking,
                          bool promised, std::vector<int32_t>* plan) {
    while (true) {
        plan->clear();
        const int64_t idle_pages = idle_usable_pages_locked();
        const int64_t n_reserve = table_.count(PageState::Reserve);
        const bool idle_limited = idle_pages < table_.idle();
        // A page the thread is still committing is only usable once it lands.
        const int64_t idle_now = std::min<int64_t>(idle_pages, n_reserve);
        int64_t usable_blocks = table_.partial_free();
        if (!idle_limited && idle_now == n_reserve) {
            usable_blocks += table_.blocks(PageState::Reserve);
        } else {
            // Over a lowered limit: hand out only the largest idle pages within
            // it; order the stack so they are consumed first (rare path).
            table_.sort_reserve_largest_last();
            const auto& rs = table_.reserve();
            for (int64_t i = 0; i < idle_now; ++i) usable_blocks += table_.page(rs[rs.size() - 1 - i]).cap;
        }
        if (n > usable_blocks) {
            int64_t need = n - usable_blocks;
            const int64_t room = budget_.room_pages(promised);
            int64_t k = room, want = 0;
            for (const auto& bucket : table_.free_by_cap()) {
                for (size_t i = bucket.second.size(); i-- > 0 && need > 0;) {
                    if (k > 0) {
                        plan->push_back(bucket.second[i]);
                        --k;
                    }
                    ++want;
                    need -= bucket.first;
                }
                if (need <= 0) break;
            }
            if (static_cast<int64_t>(plan->size()) < want || need > 0) {
                if (table_.count(PageState::Committing) + table_.count(PageState::Releasing) > 0 &&
                    (promised || n <= available_locked())) {
                    if (nonblocking) return would_block();
                    cv_.wait(lk);  // a page we need is in flight: wait for it
                    if (closed_) return Status::make(Code::Closed, "space is closed");
                    continue;
                }
                // Short of pool budget: a dead tenant may still hold some.
                // Only then (a shortage under this tenant's own limit cannot
                // be helped by reaping, and reaping reads /proc).
                const int64_t lim = budget_.limit_pages();
                const int64_t lim_room = lim < 0 ? kUnlimited : lim - budget_.claimed_pages();
                if (budget_.pooled() && room < lim_room && nonblocking) return would_block();  // reap reads /proc
                if (budget_.pooled() && room < lim_room && budget_.ledger()->reap() > 0) {
                    budget_.refresh(true);
                    continue;
                }
                last_need_pages_ = want;
                note_want_locked(want - static_cast<int64_t>(plan->size()));
                return shortage_locked(n, "", available);
            }
        }
        return Status::ok();
    }
}

// Claim the plan's budget in one step, then commit its pages all-or-nothing;
// on a failure the claim and every page committed here go back.
Status Space::claim_and_commit_locked(const std::vector<int32_t>& plan, int64_t n, int64_t* available,
                                      bool promised) {
    // Claim before commit: the budget for every planned page in one step.
    {
        std::string why;
        if (!budget_.claim(static_cast<int64_t>(plan.size()), &why, promised)) {
            last_need_pages_ = static_cast<int64_t>(plan.size());
            note_want_locked(static_cast<int64_t>(plan.size()));
            return shortage_locked(n, why, available);
        }
    }
    // Commit the planned pages all-or-nothing before touching any structure.
    for (size_t i = 0; i < plan.size(); ++i) {
        Status s = do_commit(plan[i], consume_fault_locked(FaultKind::Commit));
        if (!s.is_ok()) {
            ++counters_.commit_failures;
            int64_t kept = 0;
            for (size_t j = 0; j < i; ++j) {
                Status r = do_release(plan[j], 0);
                if (!r.is_ok()) {
                    // Cannot un-commit: keep the page as idle reserve so the
                    // books still match the memory; report both failures.
                    ++counters_.release_failures;
                    s.message += "; rollback of page " + std::to_string(plan[j]) + " failed: " + r.message;
                    table_.set_state(plan[j], PageState::Reserve);
                    ++kept;
                }
            }
            budget_.release(static_cast<int64_t>(plan.size()) - kept);  // a failed commit returns its claim
            counters_.last_error = s.message;
            if (s.code == Code::Shortage) ++counters_.shortages;
            *available = available_locked();
            return s;
        }
    }
    // Reversed so that the reserve stack hands the new pages out in plan
    // order (ascending ids on a fresh space).
    for (auto it = plan.rbegin(); it != plan.rend(); ++it) {
        table_.set_state(*it, PageState::Reserve);
        ++counters_.commits;
        ++counters_.inline_commits;
    }

    return Status::ok();
}

// Take n blocks, best fit: partially used pages first, then idle committed
// pages (the plan's among them).
void Space::hand_out_locked(int64_t n, int64_t* out) {
    int64_t remaining = n;
    int64_t* cursor = out;
    // 1. Partially used pages, best fit: the smallest page that completes the
    //    request, else empty the fullest-free page and go on. Filling holes
    //    first keeps the committed page count low.
    while (remaining > 0) {
        int32_t k = table_.bucket_find_ge(static_cast<int32_t>(std::min<int64_t>(remaining, table_.max_cap() + 1)));
        if (k >= 0) {
            table_.take(table_.bucket_head(k), remaining, cursor);
            remaining = 0;
            break;
        }
        k = table_.bucket_find_max();
        if (k < 0) break;
        table_.take(table_.bucket_head(k), k, cursor);
        remaining -= k;
    }
    // 2. Idle committed pages (including the ones committed above).
    while (remaining > 0 && !table_.reserve().empty()) {
        const int32_t p = table_.reserve().back();
        table_.activate(p);
        const int64_t k = std::min<int64_t>(remaining, table_.page(p).cap);
        table_.take(p, k, cursor);
        remaining -= k;
    }
    // The plan guaranteed enough blocks; anything else is a bookkeeping bug.
    if (remaining != 0) std::abort();
}

// ------------------------------------------------------------------- free

Status Space::free(const int64_t* ids, int64_t n, std::vector<int64_t>* bad, int64_t* released, int64_t* available,
                   bool nonblocking, bool* release_due, int64_t preempted, int64_t tokens, bool evicted) {
    if (released) *released = 0;
    if (available) *available = 0;
    if (release_due) *release_due = false;
    std::unique_lock<std::mutex> lk(mu_, std::defer_lock);
    Status entered = enter_locked(lk, nonblocking);
    if (!entered.is_ok()) return entered;
    if (n == 0) {  // nothing to free: no counter moves
        if (available) *available = available_locked();
        return Status::ok();
    }
    // The blocking path runs without the GIL: the caller's buffer may change
    // under us, so validate and apply a copy. The non-blocking one holds the
    // GIL: the buffer is stable, read it in place.
    if (!nonblocking) {
        free_ids_.assign(ids, ids + n);
        ids = free_ids_.data();
    }
    // Validate the whole batch, marking each good id (a repeat sees its mark).
    bool ok = true;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t id = ids[i];
        if (id < 0 || id >= cfg_.num_blocks || table_.hold(id) != BlockHold::Held || (cfg_.null_block && id == 0)) {
            ok = false;
            continue;
        }
        table_.set_hold(id, BlockHold::Marked);
    }
    if (!ok) return reject_free_locked(ids, n, bad);
    const bool emptied = table_.give_back_batch(ids, static_cast<size_t>(n));
    used_ -= n;
    ++counters_.frees;
    // Rule 6's counters: what a lender gives back, by completion, by
    // preemption or by eviction (the verdict in force, not re-judged on the hot path).
    if (preempted > 0 || budget_.lending())
        budget_.count_freed(n * cfg_.block_bytes * cfg_.num_regions, preempted, tokens, evicted);
    commit_retry_at_ = {};  // memory came back: a failed refill may work now
    refresh_budget_locked();
    if (cfg_.reserve_thread) {
        // Wake the thread for work due now, or to start the idle interval
        // once idle pages exceed the reserve's max (it sleeps through it).
        if (emptied && (thread_has_work_locked() ||
                        (idle_tick_at_ == std::chrono::steady_clock::time_point::max() && cfg_.idle_release_s > 0 &&
                         table_.count(PageState::Reserve) > reserve_target_max_locked())))
            cv_.notify_all();
    } else if (nonblocking) {
        // No syscall here: the caller releases them without the GIL.
        if (release_due) *release_due = inline_release_due_locked();
    } else {
        const int64_t r = release_inline_locked();
        if (released) *released = r;
        last_free_releases_.store(r, std::memory_order_relaxed);
    }
    if (cfg_.reserve_thread || (release_due && !*release_due)) last_free_releases_.store(0, std::memory_order_relaxed);
    if (available) *available = available_locked();
    return Status::ok();
}

// A batch with a bad id: unmark the good ones (nothing is freed) and name
// the bad ones, each with why.
Status Space::reject_free_locked(const int64_t* ids, int64_t n, std::vector<int64_t>* bad) {
    std::string why;
    auto reject = [&](int64_t id, const char* reason) {
        if (bad->size() < 16) why += (why.empty() ? "" : "; ") + std::to_string(id) + " " + reason;
        bad->push_back(id);
    };
    // The marks still tell repeats apart: a good id's first occurrence
    // unmarks it, so a later one finds it held.
    for (int64_t i = 0; i < n; ++i) {
        const int64_t id = ids[i];
        if (id < 0 || id >= cfg_.num_blocks) { reject(id, "is out of range"); continue; }
        if (table_.page_of(id) < 0) { reject(id, "straddles a page boundary (never allocated)"); continue; }
        if (cfg_.null_block && id == 0) { reject(id, "is the null block"); continue; }
        const BlockHold h = table_.hold(id);
        if (h == BlockHold::Free) { reject(id, "is not allocated (double free?)"); continue; }
        if (h == BlockHold::Held) { reject(id, "is repeated in this batch"); continue; }  // its mark was taken
        table_.set_hold(id, BlockHold::Held);  // a good id's first occurrence: unmarked, not freed
    }
    if (bad->size() > 16) why += "; and " + std::to_string(bad->size() - 16) + " more";
    return Status::make(Code::Invalid, "free: nothing freed: " + why);
}

int64_t Space::release_inline() {
    if (!check_usable().is_ok()) return 0;
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_ || cfg_.reserve_thread) return 0;
    const int64_t r = release_inline_locked();
    last_free_releases_.store(r, std::memory_order_relaxed);
    return r;
}

bool Space::inline_release_due_locked() const {
    if (table_.reserve().empty()) return false;
    const int64_t lim = budget_.limit_pages();
    const bool over_limit = lim >= 0 && table_.count(PageState::Active) + table_.count(PageState::Reserve) > lim;
    return over_limit || table_.count(PageState::Reserve) > reserve_target_max_locked();
}

// Without a reserve thread, pages beyond the reserve's max (or above the
// limit, or all of them while lending) are given back by the call that
// emptied them.
int64_t Space::release_inline_locked() {
    int64_t released = 0;
    while (inline_release_due_locked()) {
        const int32_t p = table_.reserve().back();
        Status s = do_release(p, consume_fault_locked(FaultKind::Release));
        if (!s.is_ok()) {
            ++counters_.release_failures;
            counters_.last_error = s.message;
            break;  // the page stays idle reserve; books still match memory
        }
        released_locked(p);
        ++counters_.inline_releases;
        ++released;
    }
    if (released) report_locked();
    return released;
}

}  // namespace kvpool
