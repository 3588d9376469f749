// The ledger's settings: a tenant's limit and guarantee with their
// revisions, written by any process (operators) under the slot's seqlock and
// read by every snapshot (ledger.hpp says why nobody waits on it).
#include <sched.h>

#include <atomic>
#include <string>

#include "ledger.hpp"
#include "ledger_detail.hpp"
#include "sizes.hpp"

namespace kvpool {
using ledger_detail::kSeq;

namespace {
constexpr int kSettingSpins = 20000;  // a seqlock writer inside for longer is stopped or dead
constexpr int kReadSpins = 128;       // a reader gives up sooner and keeps its last settings
}  // namespace

bool Ledger::read_settings(int slot, int64_t* limit, int64_t* limit_rev, int64_t* guarantee,
                           int64_t* guarantee_rev) const {
    const SlotSettings& s = hdr_->tenants[slot].settings;
    // Readers retry briefly and otherwise keep what they had (a writer
    // stopped inside must not slow every snapshot of the pool); only
    // writers wait longer.
    for (int i = 0; i < kReadSpins; ++i) {
        const uint64_t s1 = s.seq.load(std::memory_order_acquire);
        if (s1 & 1) {
            if (i > 32) sched_yield();
            continue;
        }
        const int64_t l = s.limit.load(std::memory_order_relaxed), lr = s.limit_revision.load(std::memory_order_relaxed);
        const int64_t g = s.guarantee.load(std::memory_order_relaxed),
                      gr = s.guarantee_revision.load(std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_acquire);
        if (s.seq.load(std::memory_order_relaxed) != s1) continue;
        *limit = l;
        *limit_rev = lr;
        *guarantee = g;
        *guarantee_rev = gr;
        return true;
    }
    return false;
}

Status Ledger::write_setting(int slot, bool guarantee, int64_t bytes, int64_t revision, LimitResult* result) {
    const char* what = guarantee ? "guarantee" : "limit";
    if (slot < 0 || slot >= kMaxTenants) return Status::make(Code::Invalid, "bad tenant slot");
    if (bytes < -1) return Status::make(Code::Invalid, std::string(what) + " must be >= 0 bytes, or -1 for none");
    // revision -1: the next one, read inside the seqlock (a setter racing an
    // operator must not compute it from a stale copy and be judged stale).
    if (revision < -1 || revision > kMaxRevision)
        return Status::make(Code::Invalid, std::string(what) + " revision must be in [0, 2**53], got " +
                                               std::to_string(revision));
    TenantSlot& t = hdr_->tenants[slot];
    SlotSettings& s = t.settings;
    uint64_t seq = 0;
    bool entered = false;
    for (int i = 0; i < kSettingSpins && !entered; ++i) {
        seq = s.seq.load(kSeq);
        if (!(seq & 1) && s.seq.compare_exchange_weak(seq, seq + 1, kSeq)) entered = true;
        else if (i > 64) sched_yield();
    }
    if (!entered)
        return Status::make(Code::Ledger, "pool '" + name_ + "': the settings of tenant slot " + std::to_string(slot) +
                                              " are held by a stopped or dead writer; try again");
    std::atomic<int64_t>& value = guarantee ? s.guarantee : s.limit;
    std::atomic<int64_t>& rev = guarantee ? s.guarantee_revision : s.limit_revision;
    const int64_t cur = rev.load(kSeq);
    if (revision < 0) revision = cur + 1;
    Status st = Status::ok();
    if (revision > kMaxRevision) {
        s.seq.store(seq + 2, std::memory_order_release);
        return Status::make(Code::Invalid, std::string(what) + " revision would pass 2**53");
    }
    if (revision < cur) *result = LimitResult::Stale;
    else if (revision == cur) *result = value.load(kSeq) == bytes ? LimitResult::Same : LimitResult::Conflict;
    else {
        const int64_t old = value.exchange(bytes, kSeq);
        *result = LimitResult::Applied;
        if (guarantee && bytes >= 0) {
            // Explicit guarantees may not add up to more than the capacity.
            // Checked after the write (SC), so of two racing setters at least
            // one sees the other; an over-promise is rolled back.
            int64_t sum = 0;
            for (int i = 0; i < kMaxTenants; ++i) {
                const TenantSlot& o = hdr_->tenants[i];
                if (o.pid.load(kSeq) <= 0 || o.live.load(kSeq) != 1) continue;
                const int64_t g = o.settings.guarantee.load(kSeq);
                if (g >= 0) sum += g;
            }
            if (sum > hdr_->capacity) {
                value.store(old, kSeq);
                st = Status::make(Code::Invalid, "a guarantee of " + format_size_exact(bytes) + " does not fit pool '" +
                                                     name_ + "': explicit guarantees would hold " +
                                                     format_size_exact(sum) + " of its " +
                                                     format_size_exact(hdr_->capacity));
            }
        }
        if (st.is_ok()) rev.store(revision, kSeq);
    }
    s.seq.store(seq + 2, std::memory_order_release);
    if (st.is_ok() && *result == LimitResult::Applied) bump_generation();
    return st;
}

Status Ledger::set_limit(int slot, int64_t bytes, int64_t revision, LimitResult* result) {
    return write_setting(slot, false, bytes, revision, result);
}

Status Ledger::set_guarantee(int slot, int64_t bytes, int64_t revision, LimitResult* result) {
    return write_setting(slot, true, bytes, revision, result);
}

}  // namespace kvpool
