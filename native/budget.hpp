// A tenant's budget: the one native owner of its limit (max), guarantee
// (min), their revisions and verdicts, its claims and its headroom — the same
// object for pooled and private spaces. The space asks it "may I claim k
// pages", "how many could I claim", "am I lending"; Python only forwards.
//
// Fair share (ARCHITECTURE.md). Every tenant has a guarantee: an explicit one, or
// an equal share of what explicit guarantees leave, among the live tenants
// on the default (recomputed as tenants join and leave, so N engines with no
// settings are never worse off than an N-way static split).
//   1. A tenant below its guarantee may always grow to it; memory other
//      waiters further below their guarantee (or equally far, earlier) wait
//      for is theirs first.
//   2. While a tenant below its guarantee waits, every tenant above its own
//      is a lender: it does not grow (its claims are refused), its allocs
//      are refused so freed blocks do not go back to its own waiters, and
//      its emptied pages go back to the pool at once (the space does that).
//   3. Above their guarantees tenants borrow first-come from memory no one
//      waits for (bytes earlier waiters want are theirs).
//   4. Admission: nothing larger than min(limit, capacity) through the page
//      formula is ever queued (max_pages()).
//   5. Headroom: a tenant may ask borrowers to leave up to `headroom` bytes
//      of its unused guarantee free (keep_free = min(headroom, guarantee -
//      claimed)), so its next request is granted at once instead of after a
//      borrower's step gives memory back (a borrower preempts only at its
//      next step). Growing past one's own guarantee never takes memory
//      other tenants keep free; growing within it always may, and then
//      every borrower *restores* it until that much is free again: as a
//      lender it does not grow, its allocs are refused and its emptied pages
//      go back, but its engine is not asked to preempt (lending() stays
//      false): the memory comes back as its requests finish.
//   6. Reclaim by completion first (issue 31). A lender first stops growing
//      and admitting (rule 2): memory its running requests free goes to the
//      waiter. Each tenant publishes `freeing`, the bytes its running
//      requests will free within the reclaim bound (its engine knows how
//      many decode steps each has left and which pages then empty). On a
//      snapshot, each tenant waiting below its guarantee needs
//      n = min(want, guarantee - claimed) (a want is what its last alloc
//      lacked beyond the room it had, so free bytes are counted in it). If
//      it holds less than its headroom (a light engine: its next request's
//      wait is most of its time to first token, rule 5), up to its headroom
//      of n is urgent: no completion covers it in time. The deficit is the
//      urgent part plus what the lenders' freeing (each counted up to what
//      it borrows) does not cover of the rest; only that is preempted, split among the lenders most borrowed
//      first (slot order among equals): the urgent part from anything a
//      lender borrows, the rest from what it borrows beyond its freeing.
//      A lender's share is its verdict preempt_bytes (0: reclaim by
//      completion only). Every lender computes the same split from the
//      same rows, so no lender preempts what another was asked for. A
//      waiter's want is republished against the room there is whenever its
//      manager asks available() (Space::republish_want_locked), so memory
//      freed lowers the deficit at once. A lender whose engine never acts
//      on the verdict (set_preempts(false): SGLang, whose requests share
//      pages a token at a time) is left out of the split: its freeing
//      still counts, and the rest of the deficit falls to the lenders that
//      preempt (none: the waiter waits for completions).
// The verdicts are judged on a ledger snapshot at every claim; the space's
// hot path reads the cached lending verdict, refreshed when the pool's
// generation moves (every want appearing or going, every setting, join and
// leave bumps it).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "ledger.hpp"
#include "status.hpp"

namespace kvpool {

// The figures of a budget, as bound to Python (BudgetStats).
struct BudgetFigures {
    bool pooled = false;
    int64_t limit_bytes = -1;        // in force, -1 = none
    int64_t limit_revision = 0;
    int64_t guarantee_bytes = 0;     // in force (explicit or the default share); 0 without a pool
    int64_t guarantee_setting = -1;  // explicit guarantee, -1 = the default share
    int64_t guarantee_revision = 0;
    int64_t claimed_bytes = 0;
    int64_t borrowed_bytes = 0;      // claimed above the guarantee
    int64_t want_bytes = 0;          // what its waiting requests need (published)
    bool lending = false;            // above its guarantee while a tenant below its own waits
    bool restoring = false;          // above its guarantee while the others' keep_free is not free (rule 5)
    int64_t headroom_bytes = 0;      // of its unused guarantee, asked to be kept free (rule 5)
    int64_t keep_free_bytes = 0;     // what that asks now: min(headroom, guarantee - claimed)
    int64_t pool_capacity = -1;      // -1 without a pool
    // Rule 6 (issue 31): reclaim by completion first.
    int64_t freeing_bytes = 0;       // published: what its running requests free within the bound
    int64_t preempt_bytes = 0;       // verdict while lending: bytes to preempt now (0: by completion only)
    bool preempts = true;            // its engine acts on the verdict (false: by completion only)
    int64_t preemptions_asked = 0;   // verdicts with preempt_bytes > 0 its engine acted on
    int64_t requests_preempted = 0;
    int64_t tokens_recomputed = 0;   // of the preempted requests: prompt and generated tokens to prefill again
    int64_t reclaimed_by_completion_bytes = 0;  // block bytes freed while lending, by requests finishing
    int64_t reclaimed_by_preemption_bytes = 0;  // block bytes freed by preemption
    int64_t reclaimed_by_eviction_bytes = 0;    // block bytes freed while lending, cached blocks dropped
};

class Budget {
public:
    Budget(std::shared_ptr<Ledger> ledger, int slot, int64_t page_commit_bytes, int64_t private_limit_bytes);

    bool pooled() const { return ledger_ != nullptr; }
    const std::shared_ptr<Ledger>& ledger() const { return ledger_; }
    int slot() const { return slot_; }

    // Claim before commit: `pages` more, judged by the limit, the pool and
    // the fair-share rules in one step. On false *why says which said no.
    // `promised`: the caller was told these pages were there before another
    // tenant started waiting (space.hpp, Space::alloc); only the limit and
    // the pool's free bytes judge it, not the waiters' protections.
    bool claim(int64_t pages, std::string* why, bool promised = false);
    void release(int64_t pages);
    int64_t claimed_pages() const { return claimed_pages_; }

    // Pages claim() would grant now (with `promised`, as claim(.., true) would).
    // `releasing`: pages of this tenant's claims in flight back to the pool,
    // counted as returned (the settled view available() reports).
    int64_t room_pages(bool promised = false, int64_t releasing = 0) const;
    // Cap on committed pages from the limit in force (-1 = none).
    int64_t limit_pages() const;
    // The most pages this tenant can ever hold: min(limit, capacity) (-1 = no bound).
    int64_t max_pages() const;
    bool lending() const { return lending_; }
    // Rule 5: the pool has less free than the others keep free and this
    // tenant borrows: it gives back as a lender does, without preempting.
    bool restoring() const { return restoring_; }
    // Lending or restoring: what the space acts on (no growth, allocs
    // refused, idle and emptied pages back to the pool).
    bool gives_back() const { return lending_ || restoring_; }
    // Another tenant waits below its guarantee: idle pages are a luxury then,
    // and every tenant gives its reserve back (rule 1 of ARCHITECTURE.md "Fair share").
    bool starving() const { return starving_; }
    // Another tenant of the pool waits for memory: idle pages above the
    // reserve's max go back at once rather than after the idle interval.
    bool others_waiting() const { return others_waiting_; }

    // Cheap: whether the pool changed since the last refresh.
    uint32_t seen_generation() const { return seen_generation_; }
    bool stale() const { return ledger_ && ledger_->generation() != seen_generation_; }
    // Re-reads settings and pressure from the ledger (if its generation moved,
    // or always with force). Returns true if the limit, the guarantee or the
    // lending verdict changed.
    bool refresh(bool force = false);

    // Settings, revisioned (revision < 0: the next one). Private budgets keep
    // the same rules locally.
    Status set_limit(int64_t bytes, int64_t revision, LimitResult* result);
    Status set_guarantee(int64_t bytes, int64_t revision, LimitResult* result);
    // Rule 5: bytes of its unused guarantee this tenant asks borrowers to
    // leave free (0: none). Owner-written, not revisioned: the engine knows
    // how much its next step can ask for.
    Status set_headroom(int64_t bytes);

    // What waiting requests need beyond what is claimed (0: nothing waits).
    void publish_want(int64_t pages);
    int64_t want_pages() const { return want_pages_; }
    void report(bool limit_deferred, int32_t waiting, int64_t reserve_pages);
    // One alloc answered (granted or refused), counted in the ledger for
    // readers (kvpool metrics); private budgets have no readers to tell.
    void count_alloc(bool granted) {
        if (ledger_) ledger_->count_alloc(slot_, granted);
    }

    BudgetFigures figures() const;

    // Rule 6. Publishes what this tenant's running requests free within the
    // reclaim bound (bytes >= 0, else Invalid; a private budget keeps it).
    Status publish_freeing(int64_t bytes);
    int64_t freeing_bytes() const { return freeing_bytes_; }
    // Rule 6: whether this tenant's engine acts on the verdict (false: it
    // reclaims by completion only, and the judges ask the other lenders).
    void set_preempts(bool preempts);
    // Judges the preemption verdict on a fresh snapshot (0 unless lending)
    // and publishes it; returns it.
    int64_t judge_preempt();
    int64_t preempt_bytes() const { return preempt_bytes_; }
    // Blocks freed: `bytes` of them by a preemption of `requests` requests
    // with `tokens` to recompute (requests > 0), else, counted only while
    // lending (memory the pool reclaims), cached blocks dropped (`evicted`)
    // or by completions.
    void count_freed(int64_t bytes, int64_t requests, int64_t tokens, bool evicted = false);

private:
    void judge(const LedgerSnapshot& s);  // updates guarantee_, starving_, lending_
    void relend();
    // Publishes keep_free (rule 5) when it changed: after every claim,
    // release, judgement and headroom setting.
    void publish_keep_free();

    std::shared_ptr<Ledger> ledger_;
    int slot_ = -1;
    int64_t pcb_ = 1;  // bytes per page commit
    int64_t claimed_pages_ = 0;
    int64_t want_pages_ = 0;
    // Settings in force (cached from the ledger, or private).
    int64_t limit_bytes_ = -1, limit_revision_ = 0;
    int64_t guarantee_setting_ = -1, guarantee_revision_ = 0;
    // Verdicts of the last judgement.
    int64_t guarantee_bytes_ = 0;
    bool starving_ = false;  // another tenant waits below its guarantee
    bool others_waiting_ = false;
    bool lending_ = false;
    bool headroom_short_ = false;  // the pool has less free than the others keep free
    bool restoring_ = false;
    int64_t headroom_bytes_ = 0;
    int64_t keep_free_ = 0;  // as published
    uint32_t seen_generation_ = 0;
    // Rule 6: published freeing, the last verdict, and the owner's counters.
    int64_t freeing_bytes_ = 0;
    bool preempts_ = true;
    int64_t preempt_bytes_ = 0;
    int64_t preempt_asked_ = 0, preempted_ = 0, recomputed_ = 0;
    int64_t reclaimed_completion_ = 0, reclaimed_preemption_ = 0, reclaimed_eviction_ = 0;
};

}  // namespace kvpool
