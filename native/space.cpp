#include "space.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <limits>

#include "geometry.hpp"

namespace kvpool {
namespace {
constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

std::string fault_text(const char* what, int64_t page, int err) {
    return std::string(what) + "(page " + std::to_string(page) + "): injected fault: " +
           std::strerror(err) + " (errno " + std::to_string(err) + ")";
}
}  // namespace

Space::Space(const SpaceConfig& cfg, std::unique_ptr<Backend> backend, std::shared_ptr<Ledger> ledger, int slot)
    : cfg_(cfg),
      backend_(std::move(backend)),
      ledger_(std::move(ledger)),
      slot_(slot),
      pcb_(cfg.num_regions * cfg.page_bytes) {}

std::unique_ptr<Space> Space::create(const SpaceConfig& cfg, std::unique_ptr<Backend> backend,
                                     std::shared_ptr<Ledger> ledger, int slot, Status* status) {
    if (cfg.page_bytes <= 0 || cfg.block_bytes <= 0 || cfg.num_blocks <= 0 || cfg.num_regions <= 0 ||
        cfg.block_bytes > cfg.page_bytes || cfg.reserve_min < 0 || cfg.reserve_max < cfg.reserve_min) {
        *status = Status::make(Code::Invalid,
                               "invalid space configuration: page_bytes=" + std::to_string(cfg.page_bytes) +
                                   " block_bytes=" + std::to_string(cfg.block_bytes) + " num_blocks=" +
                                   std::to_string(cfg.num_blocks) + " num_regions=" + std::to_string(cfg.num_regions) +
                                   " reserve=(" + std::to_string(cfg.reserve_min) + ", " +
                                   std::to_string(cfg.reserve_max) + "); need all sizes > 0, "
                                   "block_bytes <= page_bytes and 0 <= min <= max");
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
        return Status::make(Code::Invalid, "space too large");
    pages_.resize(static_cast<size_t>(np));
    held_.assign(static_cast<size_t>(N), 0);
    for (int64_t p = 0; p < np; ++p) {
        const BlockRange r = page_block_range(P, B, N, p);
        Page& pg = pages_[p];
        pg.first = r.first;
        pg.cap = static_cast<int32_t>(r.size());
        pg.free_off.reserve(pg.cap);
        // Stack order: pop yields ascending ids on a fresh page.
        for (int32_t i = pg.cap - 1; i >= 0; --i) pg.free_off.push_back(i);
        capacity_ += pg.cap;
        max_cap_ = std::max(max_cap_, pg.cap);
    }
    bucket_head_.assign(static_cast<size_t>(max_cap_) + 1, -1);
    bucket_bits_.assign(static_cast<size_t>(max_cap_) / 64 + 1, 0);
    for (int64_t p = np - 1; p >= 0; --p)
        if (pages_[p].cap > 0) free_push(static_cast<int32_t>(p));

    efd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd_ < 0) return Status::make(Code::Backend, std::string("eventfd: ") + std::strerror(errno));

    if (cfg_.null_block) {
        // Block 0 is held from the start and never handed out; its page is
        // pinned (committed for the space's lifetime). The first alloc of a
        // fresh space always yields block 0: page 0 holds floor(P/B) blocks,
        // the most any page holds, and is first in its capacity bucket.
        int64_t id = -1, avail = 0;
        Status s = alloc(1, &id, &avail);
        if (!s.is_ok()) return s;
        std::lock_guard<std::mutex> lk(mu_);
        pages_[0].pinned = true;
        used_ -= 1;  // the null block is not a user block
        counters_.allocs -= 1;
    }
    if (cfg_.reserve_thread) thread_ = std::thread([this] { thread_main(); });
    if (ledger_) watcher_ = std::thread([this] { watcher_main(); });
    return Status::ok();
}

Space::~Space() { close(); }

// ---------------------------------------------------------------- buckets
// ACTIVE pages with free blocks sit in bucket_head_[nfree] (doubly linked),
// with a bitmap of non-empty buckets: best-fit is one bit scan, O(cap/64).

void Space::bucket_insert(int32_t p) {
    Page& pg = pages_[p];
    const int32_t k = pg.nfree;
    pg.prev = -1;
    pg.next = bucket_head_[k];
    if (pg.next >= 0) pages_[pg.next].prev = p;
    bucket_head_[k] = p;
    bucket_bits_[k / 64] |= (uint64_t{1} << (k % 64));
}

void Space::bucket_remove(int32_t p) {
    Page& pg = pages_[p];
    const int32_t k = pg.nfree;
    if (pg.prev >= 0) pages_[pg.prev].next = pg.next;
    else bucket_head_[k] = pg.next;
    if (pg.next >= 0) pages_[pg.next].prev = pg.prev;
    pg.prev = pg.next = -1;
    if (bucket_head_[k] < 0) bucket_bits_[k / 64] &= ~(uint64_t{1} << (k % 64));
}

int32_t Space::bucket_find_ge(int32_t k) const {
    if (k < 1) k = 1;
    if (k > max_cap_) return -1;
    size_t w = static_cast<size_t>(k) / 64;
    uint64_t bits = bucket_bits_[w] & (~uint64_t{0} << (k % 64));
    while (true) {
        if (bits) return static_cast<int32_t>(w * 64 + __builtin_ctzll(bits));
        if (++w >= bucket_bits_.size()) return -1;
        bits = bucket_bits_[w];
    }
}

int32_t Space::bucket_find_max() const {
    for (size_t w = bucket_bits_.size(); w-- > 0;) {
        uint64_t bits = bucket_bits_[w];
        if (w == 0) bits &= ~uint64_t{1};  // bucket 0 holds nothing
        if (bits) return static_cast<int32_t>(w * 64 + 63 - __builtin_clzll(bits));
    }
    return -1;
}

void Space::free_push(int32_t p) {
    const int32_t cap = pages_[p].cap;
    auto it = std::find_if(free_by_cap_.begin(), free_by_cap_.end(),
                           [cap](const auto& e) { return e.first <= cap; });
    if (it == free_by_cap_.end() || it->first != cap) it = free_by_cap_.insert(it, {cap, {}});
    it->second.push_back(p);
}

void Space::free_remove(int32_t p) {
    for (auto it = free_by_cap_.begin(); it != free_by_cap_.end(); ++it) {
        if (it->first != pages_[p].cap) continue;
        auto& v = it->second;
        // Planned pages come from the back of their bucket: search from there.
        auto pos = std::find(v.rbegin(), v.rend(), p);
        if (pos != v.rend()) v.erase(pos.base() - 1);
        if (v.empty()) free_by_cap_.erase(it);  // the thread relies on non-empty buckets
        return;
    }
}

// ------------------------------------------------------------- accounting

int64_t Space::limit_pages_locked() const {
    int64_t lim = cfg_.limit_pages;
    if (ledger_) {
        const int64_t bytes = ledger_->limit(slot_);
        if (bytes >= 0) lim = lim < 0 ? bytes / pcb_ : std::min(lim, bytes / pcb_);
    }
    return lim;
}

// The one limit verdict: committed pages (releasing ones still hold memory;
// committing ones are not counted yet) above `limit_pages`. DEFERRED in
// Python, limit_state 1 in the ledger, SpaceStats::limit_deferred: all read
// this, nothing re-derives it.
bool Space::deferred_under_locked(int64_t limit_pages) const {
    return limit_pages >= 0 && n_active_ + n_reserve_ + n_releasing_ > limit_pages;
}

bool Space::limit_deferred_locked() const { return deferred_under_locked(limit_pages_locked()); }

// Pages the pool would let this tenant claim now (pool room and its limit).
int64_t Space::ledger_room_pages_locked() const {
    return ledger_ ? ledger_->room(slot_) / pcb_ : kUnlimited;
}

// Whether the pool's unclaimed room, rather than this tenant's own limit (its
// local or pool limit), is what keeps a commit out: only then can reaping a
// dead tenant help.
bool Space::pool_is_short_locked() const {
    if (!ledger_) return false;
    const int64_t pool = ledger_->pool_room() / pcb_;
    int64_t own = kUnlimited;
    const int64_t lim = limit_pages_locked();
    if (lim >= 0) own = std::max<int64_t>(0, lim - (n_active_ + n_reserve_ + n_committing_ + n_releasing_));
    const int64_t lim_bytes = ledger_->limit(slot_);
    if (lim_bytes >= 0) {
        // Own claimed bytes, as the ledger's limit check counts them.
        const int64_t claimed = (n_active_ + n_reserve_ + n_committing_ + n_releasing_) * pcb_;
        own = std::min(own, std::max<int64_t>(0, lim_bytes - claimed) / pcb_);
    }
    return pool < own;
}

int64_t Space::headroom_locked() const {
    int64_t h = kUnlimited;
    const int64_t lim = limit_pages_locked();
    if (lim >= 0) h = std::max<int64_t>(0, lim - (n_active_ + n_reserve_ + n_committing_));
    // Pages being released are still claimed in the pool; settled, they are back.
    if (ledger_) h = std::min(h, ledger_room_pages_locked() + n_releasing_);
    return h;
}

int64_t Space::headroom_now_locked() const {
    int64_t h = kUnlimited;
    const int64_t lim = limit_pages_locked();
    // A releasing page still holds its memory: no commit may overshoot the
    // limit while it drains (alloc waits for the release instead).
    if (lim >= 0) h = std::max<int64_t>(0, lim - (n_active_ + n_reserve_ + n_committing_ + n_releasing_));
    if (ledger_) h = std::min(h, ledger_room_pages_locked());
    return h;
}

bool Space::claim_locked(int64_t pages, Status* status) {
    if (!ledger_ || pages == 0) return true;
    *status = ledger_->claim(slot_, pages * pcb_);
    return status->is_ok();
}

void Space::unclaim_locked(int64_t pages) {
    if (ledger_ && pages > 0) ledger_->release(slot_, pages * pcb_);
}

void Space::report_locked() {
    if (!ledger_) return;
    ledger_->report(slot_, limit_deferred_locked() ? 1 : 0, waiting_.load(), n_reserve_);
}

void Space::report_waiting(int32_t waiting) {
    waiting_.store(waiting);
    if (ledger_) {
        std::lock_guard<std::mutex> lk(mu_);
        report_locked();
    }
}

// Idle committed pages (RESERVE, or COMMITTING by the thread) that may be
// handed out: all of them, unless a lowered limit puts some above it. Those
// are on their way back and must not be activated.
int64_t Space::idle_usable_pages_locked() const {
    const int64_t idle = n_reserve_ + n_committing_;
    const int64_t lim = limit_pages_locked();
    if (lim < 0) return idle;
    return std::min(idle, std::max<int64_t>(0, lim - n_active_));
}

int64_t Space::idle_usable_cap_locked() const {
    const int64_t k = idle_usable_pages_locked();
    if (k == n_reserve_ + n_committing_) return reserve_cap_ + committing_cap_;
    // Over the limit (rare): the k largest idle pages.
    std::vector<int32_t> caps;
    caps.reserve(reserve_.size() + committing_pages_.size());
    for (int32_t p : reserve_) caps.push_back(pages_[p].cap);
    for (int32_t p : committing_pages_) caps.push_back(pages_[p].cap);
    std::sort(caps.rbegin(), caps.rend());
    int64_t sum = 0;
    for (int64_t i = 0; i < k; ++i) sum += caps[i];
    return sum;
}

// The settled view: in-flight commits count as reserve, in-flight releases as
// free, so available() never depends on the reserve thread's timing; alloc
// waits for a transition when it needs the page in flight.
int64_t Space::available_locked() const {
    int64_t avail = partial_free_ + idle_usable_cap_locked();
    int64_t k = headroom_locked();
    std::vector<int32_t> rel = releasing_caps_;
    std::sort(rel.rbegin(), rel.rend());
    size_t ri = 0;
    for (const auto& bucket : free_by_cap_) {
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
    std::lock_guard<std::mutex> lk(mu_);
    return closed_ ? 0 : available_locked();
}

// -------------------------------------------------------- fault injection

void Space::inject_fault(FaultKind kind, int64_t nth, int err) {
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

// ---------------------------------------------------------- state changes

void Space::to_reserve_locked(int32_t p) {
    Page& pg = pages_[p];
    pg.state = PageState::Reserve;
    ++n_reserve_;
    reserve_cap_ += pg.cap;
    reserve_.push_back(p);
}

void Space::activate_locked(int32_t p) {
    Page& pg = pages_[p];
    pg.state = PageState::Active;
    --n_reserve_;
    ++n_active_;
    reserve_cap_ -= pg.cap;
    pg.nfree = pg.cap;
    partial_free_ += pg.cap;
    bucket_insert(p);
}

void Space::take_locked(int32_t p, int64_t k, int64_t*& out) {
    Page& pg = pages_[p];
    bucket_remove(p);
    for (int64_t i = 0; i < k; ++i) {
        const int64_t id = pg.first + pg.free_off.back();
        pg.free_off.pop_back();
        held_[id] = 1;
        *out++ = id;
    }
    pg.nfree -= static_cast<int32_t>(k);
    partial_free_ -= k;
    if (pg.nfree > 0) bucket_insert(p);
}

// A RESERVE page (already off reserve_ and its counts) whose release
// succeeded: FREE again, its claim returned to the pool.
void Space::released_locked(int32_t p) {
    pages_[p].state = PageState::Free;
    free_push(p);
    ++counters_.releases;
    unclaim_locked(1);
}

void Space::return_block_locked(int64_t id) {
    const int32_t p = static_cast<int32_t>(block_page(cfg_.page_bytes, cfg_.block_bytes, id));
    Page& pg = pages_[p];
    held_[id] = 0;
    if (pg.nfree > 0) bucket_remove(p);
    pg.free_off.push_back(static_cast<int32_t>(id - pg.first));
    ++pg.nfree;
    ++partial_free_;
    if (pg.nfree == pg.cap && !pg.pinned) {
        // Page emptied: it becomes idle reserve; the thread (or the inline
        // path below) decides whether to keep or release it.
        --n_active_;
        partial_free_ -= pg.cap;
        to_reserve_locked(p);
    } else {
        bucket_insert(p);
    }
}

// ------------------------------------------------------------------ alloc

Status Space::alloc(int64_t n, int64_t* out, int64_t* available, int64_t* committed) {
    std::unique_lock<std::mutex> lk(mu_);
    *available = 0;
    if (committed) *committed = 0;
    if (closed_) return Status::make(Code::Closed, "space is closed");
    if (n < 0) return Status::make(Code::Invalid, "alloc: n must be >= 0, got " + std::to_string(n));
    if (n == 0) return Status::ok();
    if (n > capacity_) {  // checked before `out` is touched: the caller may pass no buffer
        ++counters_.shortages;
        *available = available_locked();
        return Status::make(Code::Shortage, "requested " + std::to_string(n) + " blocks, the space holds " +
                                                std::to_string(capacity_));
    }

    std::vector<int32_t> plan;  // FREE pages this call must commit
    int64_t idle_pages = 0;     // idle pages this call may activate
    while (true) {
        plan.clear();
        idle_pages = idle_usable_pages_locked();
        const bool idle_limited = idle_pages < n_reserve_ + n_committing_;
        // A page the thread is still committing is only usable once it lands.
        const int64_t idle_now = std::min<int64_t>(idle_pages, n_reserve_);
        int64_t usable = partial_free_;
        if (!idle_limited && idle_now == n_reserve_) {
            usable += reserve_cap_;
        } else {
            // Over a lowered limit: hand out only the largest idle pages within
            // it; order the stack so they are consumed first (rare path).
            std::sort(reserve_.begin(), reserve_.end(),
                      [this](int32_t a, int32_t b) { return pages_[a].cap < pages_[b].cap; });
            for (int64_t i = 0; i < idle_now; ++i) usable += pages_[reserve_[reserve_.size() - 1 - i]].cap;
        }
        if (n > usable) {
            int64_t need = n - usable, k = headroom_now_locked();
            for (const auto& bucket : free_by_cap_) {
                for (size_t i = bucket.second.size(); i-- > 0 && need > 0 && k > 0;) {
                    plan.push_back(bucket.second[i]);
                    need -= bucket.first;
                    --k;
                }
                if (need <= 0 || k == 0) break;
            }
            if (need > 0) {
                if (n_committing_ + n_releasing_ > 0 && n <= available_locked()) {
                    cv_.wait(lk);  // a page we need is in flight: wait for it
                    if (closed_) return Status::make(Code::Closed, "space is closed");
                    continue;
                }
                // Short of pool budget: a dead tenant may still hold some. Only
                // then: a shortage under this tenant's own limit cannot be
                // helped by reaping, and reaping reads /proc for every tenant.
                if (k == 0 && pool_is_short_locked() && ledger_->reap(false) > 0) continue;
                ++counters_.shortages;
                *available = available_locked();
                return Status::make(Code::Shortage, "requested " + std::to_string(n) + " blocks, " +
                                                        std::to_string(*available) + " available");
            }
        }
        break;
    }

    // Claim before commit: the pool budget for every planned page in one step.
    {
        Status cs;
        if (!claim_locked(static_cast<int64_t>(plan.size()), &cs)) {
            ++counters_.shortages;
            *available = available_locked();
            return Status::make(Code::Shortage, "requested " + std::to_string(n) + " blocks: " + cs.message);
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
                    free_remove(plan[j]);
                    to_reserve_locked(plan[j]);
                    ++kept;
                }
            }
            unclaim_locked(static_cast<int64_t>(plan.size()) - kept);  // a failed commit returns its claim
            counters_.last_error = s.message;
            if (s.code == Code::Shortage) ++counters_.shortages;
            *available = available_locked();
            return s;
        }
    }
    // Reversed so that the reserve stack hands the new pages out in plan
    // order (ascending ids on a fresh space).
    for (auto it = plan.rbegin(); it != plan.rend(); ++it) {
        const int32_t p = *it;
        free_remove(p);
        to_reserve_locked(p);
        ++counters_.commits;
        ++counters_.inline_commits;
    }

    int64_t remaining = n;
    int64_t* cursor = out;
    // 1. Partially used pages, best fit: the smallest page that completes the
    //    request, else empty the fullest-free page and go on. Filling holes
    //    first keeps the committed page count low.
    while (remaining > 0) {
        int32_t k = bucket_find_ge(static_cast<int32_t>(std::min<int64_t>(remaining, max_cap_ + 1)));
        if (k >= 0) {
            take_locked(bucket_head_[k], remaining, cursor);
            remaining = 0;
            break;
        }
        k = bucket_find_max();
        if (k < 0) break;
        take_locked(bucket_head_[k], k, cursor);
        remaining -= k;
    }
    // 2. Idle committed pages (including the ones committed above).
    while (remaining > 0 && !reserve_.empty()) {
        const int32_t p = reserve_.back();
        reserve_.pop_back();
        activate_locked(p);
        const int64_t k = std::min<int64_t>(remaining, pages_[p].cap);
        take_locked(p, k, cursor);
        remaining -= k;
    }
    if (committed) *committed = static_cast<int64_t>(plan.size());
    // The plan guaranteed enough blocks; anything else is a bookkeeping bug.
    if (remaining != 0) std::abort();
    used_ += n;
    ++counters_.allocs;
    *available = available_locked();
    if (cfg_.reserve_thread && thread_has_work_locked()) cv_.notify_all();
    return Status::ok();
}

// ------------------------------------------------------------------- free

Status Space::free(const int64_t* ids, int64_t n, std::vector<int64_t>* bad, int64_t* released,
                   int64_t* available) {
    std::unique_lock<std::mutex> lk(mu_);
    if (released) *released = 0;
    if (available) *available = 0;
    if (closed_) return Status::make(Code::Closed, "space is closed");
    std::string why;
    std::vector<int64_t> marked;
    marked.reserve(static_cast<size_t>(n));
    auto reject = [&](int64_t id, const char* reason) {
        if (bad->size() < 16) why += (why.empty() ? "" : "; ") + std::to_string(id) + " " + reason;
        bad->push_back(id);
    };
    for (int64_t i = 0; i < n; ++i) {
        const int64_t id = ids[i];
        if (id < 0 || id >= cfg_.num_blocks) { reject(id, "is out of range"); continue; }
        if (block_page(cfg_.page_bytes, cfg_.block_bytes, id) < 0) {
            reject(id, "straddles a page boundary (never allocated)");
            continue;
        }
        if (cfg_.null_block && id == 0) { reject(id, "is the null block"); continue; }
        if (held_[id] == 2) { reject(id, "is repeated in this batch"); continue; }
        if (held_[id] == 0) { reject(id, "is not allocated (double free?)"); continue; }
        held_[id] = 2;
        marked.push_back(id);
    }
    for (int64_t id : marked) held_[id] = 1;
    if (!bad->empty()) {
        if (bad->size() > 16) why += "; and " + std::to_string(bad->size() - 16) + " more";
        return Status::make(Code::Invalid, "free: nothing freed: " + why);
    }
    // Apply the validated copy, never the caller's buffer again: it may
    // change under us (the GIL is released).
    for (int64_t id : marked) return_block_locked(id);
    used_ -= n;
    ++counters_.frees;
    commit_retry_at_ = {};  // memory came back: a failed refill may work now
    if (cfg_.reserve_thread) {
        if (thread_has_work_locked()) cv_.notify_all();
    } else {
        const int64_t r = release_inline_locked();
        if (released) *released = r;
    }
    if (available) *available = available_locked();
    return Status::ok();
}

// Without a reserve thread, pages beyond reserve_max (or above the limit) are
// given back by the call that emptied them.
int64_t Space::release_inline_locked() {
    int64_t released = 0;
    const int64_t lim = limit_pages_locked();
    while (!reserve_.empty()) {
        const bool over_limit = lim >= 0 && n_active_ + n_reserve_ > lim;
        if (!over_limit && n_reserve_ <= cfg_.reserve_max) break;
        const int32_t p = reserve_.back();
        Status s = do_release(p, consume_fault_locked(FaultKind::Release));
        if (!s.is_ok()) {
            ++counters_.release_failures;
            counters_.last_error = s.message;
            break;  // the page stays idle reserve; books still match memory
        }
        reserve_.pop_back();
        --n_reserve_;
        reserve_cap_ -= pages_[p].cap;
        released_locked(p);
        ++counters_.inline_releases;
        ++released;
    }
    if (released) report_locked();
    return released;
}

Status Space::trim(int64_t* released) {
    std::lock_guard<std::mutex> lk(mu_);
    *released = 0;
    if (closed_) return Status::make(Code::Closed, "space is closed");
    Status result = Status::ok();
    std::vector<int32_t> kept;
    while (!reserve_.empty()) {
        const int32_t p = reserve_.back();
        reserve_.pop_back();
        Status s = do_release(p, consume_fault_locked(FaultKind::Release));
        if (!s.is_ok()) {
            ++counters_.release_failures;
            counters_.last_error = s.message;
            if (result.is_ok()) result = s;
            kept.push_back(p);
            continue;
        }
        --n_reserve_;
        reserve_cap_ -= pages_[p].cap;
        released_locked(p);
        ++*released;
    }
    if (*released) report_locked();
    reserve_.insert(reserve_.end(), kept.rbegin(), kept.rend());
    commit_retry_at_ = {};
    cv_.notify_all();
    return result;
}

// A limit changed (here, or in the pool by anyone): give idle pages above it
// back (reserve thread, or inline without one), let a refill that lacked
// room retry, and publish the verdict.
void Space::apply_limit_locked() {
    commit_retry_at_ = {};
    if (cfg_.reserve_thread) cv_.notify_all();
    else release_inline_locked();
    report_locked();
}

Status Space::set_limit(int64_t bytes, int64_t revision, LimitResult* result) {
    std::lock_guard<std::mutex> lk(mu_);
    *result = LimitResult::Applied;
    if (closed_) return Status::make(Code::Closed, "space is closed");
    if (bytes < -1) return Status::make(Code::Invalid, "limit_bytes must be >= 0, or -1 for none");
    if (ledger_) {
        // mu_ before the ledger's lock, as every claim takes them. The ledger
        // stores this space's own verdict with the limit, at once.
        if (revision < 0) revision = ledger_->limit_revision(slot_) + 1;
        int64_t lim = bytes < 0 ? -1 : bytes / pcb_;
        if (cfg_.limit_pages >= 0) lim = lim < 0 ? cfg_.limit_pages : std::min(lim, cfg_.limit_pages);
        Status s = ledger_->set_limit(slot_, bytes, revision, result, deferred_under_locked(lim) ? 1 : 0);
        if (!s.is_ok()) return s;
        if (*result != LimitResult::Applied) return Status::ok();
    } else {
        cfg_.limit_pages = bytes < 0 ? -1 : bytes / pcb_;
    }
    apply_limit_locked();
    signal_eventfd();  // a raised limit is new capacity for whoever waits
    return Status::ok();
}

void Space::limit_setting(int64_t* bytes, int64_t* revision) const {
    *bytes = ledger_ ? ledger_->limit(slot_) : -1;
    *revision = ledger_ ? ledger_->limit_revision(slot_) : -1;
}

Status Space::set_reserve(int64_t min_pages, int64_t max_pages) {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return Status::make(Code::Closed, "space is closed");
    if (min_pages < 0 || max_pages < min_pages)
        return Status::make(Code::Invalid, "reserve needs 0 <= min <= max, got min=" + std::to_string(min_pages) +
                                               " max=" + std::to_string(max_pages));
    cfg_.reserve_min = min_pages;
    cfg_.reserve_max = max_pages;
    apply_limit_locked();  // the same re-balancing: releases above max, refills below min
    return Status::ok();
}

Status Space::page_occupancy(const int64_t* pages, int64_t n, int64_t* used, int64_t* state) {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return Status::make(Code::Closed, "space is closed");
    for (int64_t i = 0; i < n; ++i)
        if (pages[i] < 0 || pages[i] >= num_pages())
            return Status::make(Code::Invalid, "page " + std::to_string(pages[i]) + " is out of range [0, " +
                                                   std::to_string(num_pages()) + ")");
    for (int64_t i = 0; i < n; ++i) {
        const Page& pg = pages_[pages[i]];
        state[i] = static_cast<int64_t>(pg.state);
        used[i] = pg.state == PageState::Active ? pg.cap - pg.nfree : 0;
    }
    return Status::ok();
}

SpaceStats Space::stats() {
    std::lock_guard<std::mutex> lk(mu_);
    SpaceStats s = counters_;
    s.num_blocks = cfg_.num_blocks;
    s.capacity = capacity_;
    s.num_pages = num_pages();
    s.used_blocks = used_;
    s.available = closed_ ? 0 : available_locked();
    s.pages_committing = n_committing_;
    s.pages_reserve = n_reserve_;
    s.pages_active = n_active_;
    s.pages_releasing = n_releasing_;
    s.pages_free = num_pages() - n_active_ - n_reserve_ - n_committing_ - n_releasing_;
    s.page_commit_bytes = cfg_.num_regions * cfg_.page_bytes;
    s.committed_bytes = (n_active_ + n_reserve_ + n_releasing_) * s.page_commit_bytes;
    s.limit_pages = limit_pages_locked();
    s.limit_deferred = limit_deferred_locked();
    return s;
}

int64_t Space::allocated_bytes() {
    std::lock_guard<std::mutex> lk(mu_);
    return backend_->allocated_bytes();
}

// ---------------------------------------------------------- reserve thread
// Keeps between reserve_min and reserve_max idle committed pages, and gives
// pages back while over the limit. It never calls into Python (it has no
// Python state at all) and never holds mu_ across a syscall: it marks the
// page COMMITTING/RELEASING, unlocks, runs the syscall, relocks.

// What the reserve thread wants to do. One definition for the thread and for
// settle(), which must agree on "nothing left to do".
Space::ThreadWork Space::thread_work_locked(std::chrono::steady_clock::time_point now) const {
    ThreadWork w{};
    const int64_t lim = limit_pages_locked();
    const bool over_limit = n_reserve_ > 0 && lim >= 0 && n_active_ + n_reserve_ + n_committing_ > lim;
    w.want_release = over_limit || n_reserve_ > cfg_.reserve_max;
    w.want_commit = n_reserve_ + n_committing_ < cfg_.reserve_min && headroom_now_locked() > 0 &&
                    !free_by_cap_.empty();
    w.release_now = w.want_release && now >= release_retry_at_;
    w.commit_now = w.want_commit && now >= commit_retry_at_;
    return w;
}

bool Space::thread_has_work_locked() const {
    const ThreadWork w = thread_work_locked(std::chrono::steady_clock::now());
    return w.release_now || w.commit_now;
}

void Space::signal_eventfd() {
    const uint64_t one = 1;
    // EAGAIN only if the counter would overflow: the fd is readable anyway.
    ssize_t r = ::write(efd_, &one, sizeof(one));
    (void)r;
}

void Space::thread_main() {
    using clock = std::chrono::steady_clock;
    constexpr auto kRetry = std::chrono::milliseconds(200);
    std::unique_lock<std::mutex> lk(mu_);
    while (!stop_) {
        const ThreadWork work = thread_work_locked(clock::now());
        if (work.release_now) {
            const int32_t p = reserve_.back();
            reserve_.pop_back();
            Page& pg = pages_[p];
            pg.state = PageState::Releasing;
            --n_reserve_;
            reserve_cap_ -= pg.cap;
            ++n_releasing_;
            releasing_caps_.push_back(pg.cap);
            const int err = consume_fault_locked(FaultKind::Release);
            lk.unlock();
            Status s = do_release(p, err);
            lk.lock();
            --n_releasing_;
            releasing_caps_.erase(std::find(releasing_caps_.begin(), releasing_caps_.end(), pg.cap));
            if (s.is_ok()) {
                released_locked(p);
                report_locked();
                signal_eventfd();  // budget came back: a waiter under a limit may fit now
            } else {
                ++counters_.release_failures;
                counters_.last_error = s.message;
                to_reserve_locked(p);
                release_retry_at_ = clock::now() + kRetry;  // notifications do not shorten this
            }
            cv_.notify_all();
            continue;
        }
        if (work.commit_now) {
            Status cs;
            if (!claim_locked(1, &cs)) {
                // The pool is full: wait for budget (a generation change
                // resets this deadline) instead of spinning.
                commit_retry_at_ = clock::now() + kRetry;
                continue;
            }
            auto& bucket = free_by_cap_.front();  // largest capacity first, as available() counts
            const int32_t p = bucket.second.back();
            bucket.second.pop_back();
            if (bucket.second.empty()) free_by_cap_.erase(free_by_cap_.begin());
            Page& pg = pages_[p];
            pg.state = PageState::Committing;
            ++n_committing_;
            committing_cap_ += pg.cap;
            committing_pages_.push_back(p);
            const int err = consume_fault_locked(FaultKind::Commit);
            lk.unlock();
            Status s = do_commit(p, err);
            lk.lock();
            --n_committing_;
            committing_cap_ -= pg.cap;
            committing_pages_.erase(std::find(committing_pages_.begin(), committing_pages_.end(), p));
            if (s.is_ok()) {
                to_reserve_locked(p);
                ++counters_.commits;
                signal_eventfd();
            } else {
                pg.state = PageState::Free;
                free_push(p);
                unclaim_locked(1);
                ++counters_.commit_failures;
                counters_.last_error = s.message;
                // Out of memory or a failing backend: retry later, or sooner
                // if a free/trim/new reserve setting resets the deadline.
                commit_retry_at_ = clock::now() + kRetry;
            }
            cv_.notify_all();
            continue;
        }
        cv_.notify_all();  // wake settle() waiters: nothing to do now
        auto wake_at = clock::time_point::max();
        if (work.want_release) wake_at = std::min(wake_at, release_retry_at_);
        if (work.want_commit) wake_at = std::min(wake_at, commit_retry_at_);
        if (wake_at == clock::time_point::max()) cv_.wait(lk);
        else cv_.wait_until(lk, wake_at);
    }
}

// Cross-process wake-ups: wait on the pool's generation futex; on every
// change (another tenant released budget, an operator set a limit), apply the
// pool's view (release idle pages above a new limit, retry a refill that
// lacked budget) and signal the eventfd so a waiting manager re-dispatches.
void Space::watcher_main() {
    while (true) {
        const uint32_t seen = ledger_->generation();
        {
            std::lock_guard<std::mutex> lk(mu_);
            if (stop_) return;
            apply_limit_locked();  // an operator may have set a limit in the pool
        }
        signal_eventfd();
        ledger_->wait_generation(seen, 1.0);
        // Someone here waits for budget: a tenant that died holding it is
        // reaped by the next lock holder, so be that holder at least once a
        // second rather than wait for another process to take the lock.
        if (waiting_.load() > 0) ledger_->reap(false);
    }
}

bool Space::settle(double timeout_s) {
    std::unique_lock<std::mutex> lk(mu_);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (!closed_ && (n_committing_ > 0 || n_releasing_ > 0 || (cfg_.reserve_thread && thread_has_work_locked()))) {
        cv_.notify_all();
        if (cv_.wait_until(lk, deadline) == std::cv_status::timeout) return false;
    }
    return true;
}

void Space::close() {
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
        ledger_->bump_generation();
        watcher_.join();
    }
    lk.lock();
    backend_->close();  // gives every committed byte back
    if (ledger_) ledger_->unregister_tenant(slot_);  // and its claims to the pool
    if (efd_ >= 0) ::close(efd_);
    efd_ = -1;
    close_done_ = true;
    cv_.notify_all();
}

}  // namespace kvpool
