#include "budget.hpp"

#include <algorithm>
#include <limits>
#include <vector>

namespace kvpool {
namespace {

constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

// A tenant's guarantee in force: explicit or default share, never above its limit.
int64_t effective_guarantee(const LedgerSnapshot& s, const TenantRow& r) { return s.guarantee_of(r); }

// The fair-share rules (budget.hpp) on one snapshot: how many bytes `slot`
// may claim now, and whether another tenant waits below its guarantee.
struct Share {
    int64_t room = 0;        // bytes claimable now (limit not applied)
    int64_t free = 0;        // bytes no tenant holds or has pending (what a promised claim may take)
    int64_t guarantee = 0;   // this tenant's guarantee in force
    bool starving = false;   // some other tenant waits below its guarantee
    bool others_waiting = false;  // some other tenant waits at all
    int64_t keep_free = 0;   // what the others not waiting keep free (rule 5)
    bool other_borrower = false;  // some other tenant holds more than its guarantee
    std::string starving_name;
};

// The borrow rule (budget.hpp), the one place it is written: a tenant may
// take up to its deficit (guarantee - claimed) of the free bytes not wanted
// by waiters ahead of it within their guarantees, and, while nobody below
// its guarantee waits, grow past it into the free bytes no earlier waiter
// wants and the others do not keep free (rule 5).
int64_t share_room(int64_t free_bytes, int64_t deficit, int64_t protect_within, int64_t protect_borrow,
                   int64_t keep_free, bool starving) {
    const int64_t within = std::clamp<int64_t>(free_bytes - protect_within, 0, deficit);
    const int64_t room = starving ? within : std::max(within, free_bytes - protect_borrow - keep_free);
    return std::max<int64_t>(0, room);
}

Share judge_share(const LedgerSnapshot& s, int slot) {
    Share out;
    const TenantRow* me = s.find(slot);
    const int64_t mine = me ? me->claimed : 0;
    const uint64_t my_ticket = me && me->wait_ticket ? me->wait_ticket : std::numeric_limits<uint64_t>::max();
    out.guarantee = me ? effective_guarantee(s, *me) : 0;
    int64_t others = 0;
    for (const auto& r : s.rows)
        if (r.slot != slot) others += r.claimed + r.pending;
    const int64_t free_bytes = s.capacity - others - mine;
    const int64_t deficit = std::max<int64_t>(0, out.guarantee - mine);
    int64_t protect_within = 0;  // wanted by waiters ahead of us within guarantees
    int64_t protect_borrow = 0;  // wanted by waiters ahead of a borrower
    int64_t keep_free = 0;       // what tenants not waiting ask borrowers to leave (rule 5)
    for (const auto& r : s.rows) {
        if (r.slot == slot) continue;
        if (r.claimed > effective_guarantee(s, r)) out.other_borrower = true;
        if (r.want <= 0) {
            keep_free += r.keep_free;  // a waiter's want protects it instead
            continue;
        }
        out.others_waiting = true;
        const int64_t their_deficit = effective_guarantee(s, r) - r.claimed;
        if (their_deficit > 0) {
            out.starving = true;
            if (out.starving_name.empty())
                out.starving_name = r.name.empty() ? "in slot " + std::to_string(r.slot) : "'" + r.name + "'";
            // Pool-wide order: furthest below guarantee first, FIFO among equals.
            if (their_deficit > deficit || (their_deficit == deficit && r.wait_ticket < my_ticket))
                protect_within += std::min(r.want, their_deficit);
        } else if (r.wait_ticket < my_ticket) {
            protect_borrow += r.want;  // an earlier borrower: first come
        }
    }
    out.room = share_room(free_bytes, deficit, protect_within, protect_borrow, keep_free, out.starving);
    out.free = std::max<int64_t>(0, free_bytes);
    out.keep_free = keep_free;
    return out;
}

// Rule 6 (budget.hpp), the one place it is written: of the starving
// waiters' need, the urgent part (within their headroom) and what the
// lenders' completions within the bound do not cover of the rest, split
// among the lenders most borrowed first; returns `slot`'s share (0:
// reclaim by completion only).
int64_t judge_preempt_share(const LedgerSnapshot& s, int slot) {
    struct Lender {
        int64_t borrowed;
        int slot;
        int64_t covered;  // of what it borrows, what its completions within the bound free
    };
    std::vector<Lender> lenders;
    int64_t need = 0, urgent = 0, freeing = 0;
    for (const auto& r : s.rows) {
        const int64_t g = effective_guarantee(s, r);
        if (r.want > 0 && r.claimed < g) {
            // A want is what the waiter's last alloc lacked beyond the room
            // it had (Space::alloc): the pool's free bytes are counted in it.
            const int64_t n = std::min(r.want, g - r.claimed);
            need += n;
            // A light tenant (it holds less than its headroom, one request
            // of its largest size: its request's wait is most of its time
            // to first token) wants up to its headroom at once (rule 5): no
            // completion covers that in time. A busier one's next request
            // can wait for completions within the bound.
            if (r.claimed < r.headroom) urgent += std::min(n, r.headroom);
        } else if (r.claimed > g) {
            const int64_t borrowed = r.claimed - g;
            const int64_t covered = std::min(r.freeing, borrowed);
            freeing += covered;
            // A lender that reclaims by completion only is never asked:
            // what its completions cover counts, the rest falls to the others.
            if (r.preempts) lenders.push_back({borrowed, r.slot, covered});
        }
    }
    // The urgent part from anything borrowed; the rest only as far as
    // completions do not cover it, from what they do not free.
    int64_t now = urgent;
    int64_t later = std::max<int64_t>(0, need - urgent - freeing);
    if (now + later <= 0) return 0;
    std::sort(lenders.begin(), lenders.end(), [](const Lender& a, const Lender& b) {
        return a.borrowed != b.borrowed ? a.borrowed > b.borrowed : a.slot < b.slot;
    });
    for (const auto& l : lenders) {
        const int64_t a = std::min(l.borrowed, now);
        now -= a;
        const int64_t b = std::min(std::max<int64_t>(0, l.borrowed - l.covered - a), later);
        later -= b;
        if (l.slot == slot) return a + b;
        if (now + later <= 0) return 0;
    }
    return 0;
}

}  // namespace

void Budget::set_preempts(bool preempts) {
    if (preempts == preempts_) return;
    preempts_ = preempts;
    if (!ledger_) return;
    ledger_->publish_preempts(slot_, preempts);
    ledger_->bump_generation();  // the other lenders' shares change: they judge again
}

Status Budget::publish_freeing(int64_t bytes) {
    if (bytes < 0) return Status::make(Code::Invalid, "freeing_bytes must be >= 0, got " + std::to_string(bytes));
    if (bytes == freeing_bytes_) return Status::ok();
    freeing_bytes_ = bytes;
    if (ledger_) ledger_->publish_freeing(slot_, bytes);
    return Status::ok();
}

int64_t Budget::judge_preempt() {
    const int64_t v = ledger_ && lending_ ? judge_preempt_share(ledger_->snapshot(false), slot_) : 0;
    if (v != preempt_bytes_) {
        preempt_bytes_ = v;
        ledger_->publish_preempt(slot_, v);
    }
    return v;
}

void Budget::count_freed(int64_t bytes, int64_t requests, int64_t tokens, bool evicted) {
    if (requests > 0) {
        const bool asked = preempt_bytes_ > 0;
        preempt_asked_ += asked;
        preempted_ += requests;
        recomputed_ += tokens;
        reclaimed_preemption_ += bytes;
        if (ledger_)
            ledger_->count_preemption(slot_, asked, static_cast<uint64_t>(requests), static_cast<uint64_t>(tokens),
                                      static_cast<uint64_t>(bytes));
    } else if (lending_ && evicted) {
        reclaimed_eviction_ += bytes;
        if (ledger_) ledger_->count_reclaimed_eviction(slot_, static_cast<uint64_t>(bytes));
    } else if (lending_) {
        reclaimed_completion_ += bytes;
        if (ledger_) ledger_->count_reclaimed_completion(slot_, static_cast<uint64_t>(bytes));
    }
}

Budget::Budget(std::shared_ptr<Ledger> ledger, int slot, int64_t page_commit_bytes, int64_t private_limit_bytes)
    : ledger_(std::move(ledger)), slot_(slot), pcb_(std::max<int64_t>(1, page_commit_bytes)) {
    if (ledger_) refresh(true);
    else limit_bytes_ = private_limit_bytes < 0 ? -1 : private_limit_bytes;
}

int64_t Budget::limit_pages() const { return limit_bytes_ < 0 ? -1 : limit_bytes_ / pcb_; }

int64_t Budget::max_pages() const {
    int64_t cap = ledger_ ? ledger_->capacity() : -1;
    if (limit_bytes_ >= 0) cap = cap < 0 ? limit_bytes_ : std::min(cap, limit_bytes_);
    return cap < 0 ? -1 : cap / pcb_;
}

void Budget::judge(const LedgerSnapshot& s) {
    const Share sh = judge_share(s, slot_);
    guarantee_bytes_ = sh.guarantee;
    starving_ = sh.starving;
    others_waiting_ = sh.others_waiting;
    headroom_short_ = sh.free < sh.keep_free;
    relend();
    publish_keep_free();
}

void Budget::publish_keep_free() {
    if (!ledger_) return;
    const int64_t kf = std::clamp<int64_t>(guarantee_bytes_ - claimed_pages_ * pcb_, 0, headroom_bytes_);
    if (kf == keep_free_) return;
    keep_free_ = kf;
    ledger_->publish_headroom(slot_, headroom_bytes_, kf);
}

Status Budget::set_headroom(int64_t bytes) {
    if (bytes < 0) return Status::make(Code::Invalid, "headroom_bytes must be >= 0, got " + std::to_string(bytes));
    if (!ledger_) return Status::make(Code::Invalid, "headroom_bytes needs a pool: a private space has no neighbours");
    headroom_bytes_ = bytes;
    keep_free_ = -1;  // publish the setting even if keep_free is unchanged
    publish_keep_free();
    ledger_->bump_generation();  // borrowers judge again: they may have to give it back
    return Status::ok();
}

void Budget::relend() {
    const bool above = ledger_ && claimed_pages_ * pcb_ > guarantee_bytes_;
    const bool lending = above && starving_;
    const bool restoring = above && headroom_short_ && !lending;
    if (lending != lending_ || restoring != restoring_) {
        lending_ = lending;
        restoring_ = restoring;
        ledger_->publish_lending(slot_, lending ? 1 : restoring ? 2 : 0);
    }
}

bool Budget::refresh(bool force) {
    if (!ledger_) return false;
    const uint32_t gen = ledger_->generation();
    if (!force && gen == seen_generation_) return false;
    seen_generation_ = gen;
    const int64_t old_limit = limit_bytes_, old_g = guarantee_bytes_;
    const bool old_lending = lending_, old_restoring = restoring_;
    int64_t l, lr, g, gr;
    // A writer stopped inside the seqlock: keep the settings read last.
    if (ledger_->read_settings(slot_, &l, &lr, &g, &gr)) {
        limit_bytes_ = l;
        limit_revision_ = lr;
        guarantee_setting_ = g;
        guarantee_revision_ = gr;
    }
    judge(ledger_->snapshot(false));
    return limit_bytes_ != old_limit || guarantee_bytes_ != old_g || lending_ != old_lending ||
           restoring_ != old_restoring;
}

bool Budget::claim(int64_t pages, std::string* why, bool promised) {
    if (pages <= 0) return true;
    const int64_t bytes = pages * pcb_;
    const int64_t lim = limit_pages();
    if (lim >= 0 && claimed_pages_ + pages > lim) {
        *why = "tenant limit " + std::to_string(limit_bytes_) + " bytes holds " + std::to_string(lim) +
               " page commits, " + std::to_string(claimed_pages_) + " claimed";
        return false;
    }
    if (!ledger_) {
        claimed_pages_ += pages;
        return true;
    }
    bool took_headroom = false;  // this claim leaves less free than the others keep
    auto admit = [&](const LedgerSnapshot& s, std::string* w) {
        const Share sh = judge_share(s, slot_);
        guarantee_bytes_ = sh.guarantee;
        starving_ = sh.starving;
        others_waiting_ = sh.others_waiting;
        if (bytes <= (promised ? sh.free : sh.room)) {
            // What this tenant itself asks to keep free once the claim is in.
            const int64_t mine_after =
                std::clamp<int64_t>(sh.guarantee - claimed_pages_ * pcb_ - bytes, 0, headroom_bytes_);
            took_headroom = sh.other_borrower && sh.free - bytes < sh.keep_free + mine_after;
            headroom_short_ = sh.free - bytes < sh.keep_free;
            return true;
        }
        if (sh.starving && (claimed_pages_ * pcb_ + bytes > sh.guarantee))
            *w = "lending: tenant " + sh.starving_name + " waits below its guarantee (this tenant holds " +
                 std::to_string(claimed_pages_ * pcb_) + " bytes, guarantee " + std::to_string(sh.guarantee) + ")";
        else
            *w = "pool '" + ledger_->name() + "' can give this tenant " + std::to_string(sh.room) +
                 " bytes now (waiting tenants come first) for a claim of " + std::to_string(bytes);
        return false;
    };
    const bool ok = ledger_->claim(slot_, bytes, admit, why);
    if (ok) claimed_pages_ += pages;
    relend();
    publish_keep_free();
    // Growing within its guarantee, this tenant took memory others keep
    // free: the borrowers must look again and give it back (rule 5).
    if (ok && took_headroom) ledger_->bump_generation();
    return ok;
}

void Budget::release(int64_t pages) {
    if (pages <= 0) return;
    claimed_pages_ -= pages;
    if (ledger_) ledger_->release(slot_, pages * pcb_);
    // Restoring the others' headroom: judge again, so it ends as soon as
    // what they keep free is back.
    if (ledger_ && restoring_) judge(ledger_->snapshot(false));
    relend();
    publish_keep_free();
}

int64_t Budget::room_pages(bool promised, int64_t releasing) const {
    int64_t room = kUnlimited;
    const int64_t lim = limit_pages();
    // `releasing` of the claimed pages are on their way back: count the room
    // they leave once back (under a limit: lim - the claims that stay).
    if (lim >= 0) room = std::max<int64_t>(0, lim - (claimed_pages_ - releasing));
    if (ledger_) {
        // Nobody waits anywhere (the quiet read, no snapshot): the same rule
        // with no waiter to protect. As in judge_share, the releasing pages
        // still count as claimed here and are added back below.
        int64_t free_bytes = 0, keep_free = 0, pool_room = 0;
        if (ledger_->quiet_free_bytes(slot_, &free_bytes, &keep_free)) {
            const int64_t deficit = std::max<int64_t>(0, guarantee_bytes_ - claimed_pages_ * pcb_);
            pool_room = promised ? std::max<int64_t>(0, free_bytes)
                                 : share_room(free_bytes, deficit, 0, 0, keep_free, false);
        } else {
            const Share sh = judge_share(ledger_->snapshot(false), slot_);
            pool_room = promised ? sh.free : sh.room;
        }
        room = std::min(room, pool_room / pcb_ + releasing);
    }
    return room;
}

namespace {
Status set_private(int64_t bytes, int64_t revision, int64_t* value, int64_t* rev, LimitResult* result) {
    if (revision < 0) revision = *rev + 1;
    if (revision > kMaxRevision)
        return Status::make(Code::Invalid, "revision must be in [0, 2**53], got " + std::to_string(revision));
    if (revision < *rev) *result = LimitResult::Stale;
    else if (revision == *rev) *result = *value == bytes ? LimitResult::Same : LimitResult::Conflict;
    else {
        *value = bytes;
        *rev = revision;
        *result = LimitResult::Applied;
    }
    return Status::ok();
}
}  // namespace

Status Budget::set_limit(int64_t bytes, int64_t revision, LimitResult* result) {
    if (bytes < -1) return Status::make(Code::Invalid, "limit_bytes must be >= 0, or -1 for none");
    if (!ledger_) return set_private(bytes < 0 ? -1 : bytes, revision, &limit_bytes_, &limit_revision_, result);
    // revision -1 (the next one) is resolved by the ledger, inside its seqlock.
    Status s = ledger_->set_limit(slot_, bytes, revision < 0 ? -1 : revision, result);
    if (s.is_ok()) refresh(true);
    return s;
}

Status Budget::set_guarantee(int64_t bytes, int64_t revision, LimitResult* result) {
    if (bytes < -1) return Status::make(Code::Invalid, "guarantee_bytes must be >= 0, or -1 for the default share");
    if (!ledger_) return Status::make(Code::Invalid, "a guarantee needs a pool: a private space has the whole budget");
    Status s = ledger_->set_guarantee(slot_, bytes, revision < 0 ? -1 : revision, result);
    if (s.is_ok()) refresh(true);
    return s;
}

void Budget::publish_want(int64_t pages) {
    pages = std::max<int64_t>(0, pages);
    if (pages == want_pages_) return;
    want_pages_ = pages;
    if (ledger_) ledger_->publish_want(slot_, pages * pcb_);
}

void Budget::report(bool limit_deferred, int32_t waiting, int64_t reserve_pages) {
    if (ledger_) ledger_->report(slot_, limit_deferred ? 1 : 0, limit_revision_, waiting, reserve_pages);
}

BudgetFigures Budget::figures() const {
    BudgetFigures f;
    f.pooled = pooled();
    f.limit_bytes = limit_bytes_;
    f.limit_revision = limit_revision_;
    f.guarantee_bytes = ledger_ ? guarantee_bytes_ : 0;
    f.guarantee_setting = guarantee_setting_;
    f.guarantee_revision = guarantee_revision_;
    f.claimed_bytes = claimed_pages_ * pcb_;
    f.borrowed_bytes = ledger_ ? std::max<int64_t>(0, f.claimed_bytes - guarantee_bytes_) : 0;
    f.want_bytes = want_pages_ * pcb_;
    f.lending = lending_;
    f.restoring = restoring_;
    f.headroom_bytes = headroom_bytes_;
    f.keep_free_bytes = ledger_ ? std::max<int64_t>(0, keep_free_) : 0;
    f.pool_capacity = ledger_ ? ledger_->capacity() : -1;
    f.freeing_bytes = freeing_bytes_;
    f.preempt_bytes = preempt_bytes_;
    f.preempts = preempts_;
    f.preemptions_asked = preempt_asked_;
    f.requests_preempted = preempted_;
    f.tokens_recomputed = recomputed_;
    f.reclaimed_by_completion_bytes = reclaimed_completion_;
    f.reclaimed_by_preemption_bytes = reclaimed_preemption_;
    f.reclaimed_by_eviction_bytes = reclaimed_eviction_;
    return f;
}

}  // namespace kvpool
