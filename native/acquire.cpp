// Space::acquire: the one bounded wait of every synchronous caller (the vLLM
// block pool when another tenant took the memory its free count promised,
// the SGLang allocator on a miss). Before it, each adapter had its own
// polling loop with its own wall-clock deadline (30 s, 5 s): on a busy
// machine a peer that was merely slow — its requests finishing one by one —
// outlasted the deadline and the engine failed its step.
//
// The rule: waiting is bounded by what other processes *do*, not by how
// long they take. While any other tenant makes progress (claims or frees
// memory, is granted an alloc, joins, leaves, changes a setting: anything
// that moves the pool toward giving this request memory), the wait goes on;
// once nobody has moved for `stall_s`, the pool is stalled (a stopped or
// hung peer holds the memory) and the caller gets a Shortage it can act on.
// A peer waiting in its own acquire is not progress (its retries touch
// neither its claim nor its grant count), so two waiters starved by a third,
// stopped tenant both give up instead of keeping each other waiting.
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include "space.hpp"

namespace kvpool {
namespace {
constexpr double kSliceS = 0.1;  // the longest sleep between signal checks

inline void mix(uint64_t* h, uint64_t v) {  // FNV-1a over 64-bit words
    *h ^= v;
    *h *= 1099511628211ull;
}

std::string seconds_text(double s) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.3g s", s);
    return buf;
}
}  // namespace

uint64_t Space::progress_mark_locked() const {
    uint64_t h = 1469598103934665603ull;
    mix(&h, static_cast<uint64_t>(counters_.frees));  // another thread of this process freed
    const std::shared_ptr<Ledger>& ledger = budget_.ledger();
    if (!ledger) return h;
    const LedgerSnapshot snap = ledger->snapshot(/*names=*/false);
    mix(&h, snap.generation);
    for (const TenantRow& r : snap.rows) {
        if (r.slot == budget_.slot()) continue;
        mix(&h, static_cast<uint64_t>(r.slot));
        mix(&h, static_cast<uint64_t>(static_cast<uint32_t>(r.pid)));
        mix(&h, static_cast<uint64_t>(r.claimed));
        mix(&h, r.allocs);
    }
    return h;
}

void Space::wait_wakeup(double seconds) {
    struct pollfd p {};
    p.fd = efd_;
    p.events = POLLIN;
    const int ms = static_cast<int>(std::ceil(std::max(0.0, seconds) * 1000.0));
    if (::poll(&p, 1, ms) > 0) {
        uint64_t count = 0;
        ssize_t r = ::read(efd_, &count, sizeof(count));  // consume: the next wait sleeps again
        (void)r;
    }
}

Status Space::acquire(int64_t n, int64_t* out, int64_t* available, const AcquireWait& wait) {
    using clock = std::chrono::steady_clock;
    *available = 0;
    if (!(wait.stall_s > 0) || std::isnan(wait.timeout_s) || wait.timeout_s < 0)
        return Status::make(Code::Invalid, "acquire: stall must be > 0 and timeout >= 0");
    const clock::time_point start = clock::now();
    clock::time_point moved = start;  // when others last made progress
    uint64_t mark = 0;
    int32_t reported = -1;  // what the caller reported before this wait (-1: not waiting yet)
    int64_t shortages_before = -1;
    Status st;
    while (true) {
        {
            std::unique_lock<std::mutex> lk(mu_, std::defer_lock);
            st = enter_locked(lk, /*nonblocking=*/false);
            if (!st.is_ok()) break;  // closed meanwhile
            if (shortages_before < 0) shortages_before = counters_.shortages;
            st = alloc_locked(lk, n, out, available, nullptr, /*nonblocking=*/false, wait.promised);
            if (st.code != Code::Shortage) break;
            const clock::time_point now = clock::now();
            const uint64_t m = progress_mark_locked();
            if (reported < 0 || m != mark) moved = now;
            mark = m;
            const double idle = std::chrono::duration<double>(now - moved).count();
            const double total = std::chrono::duration<double>(now - start).count();
            if (idle >= wait.stall_s || total >= wait.timeout_s) {
                const bool stalled = idle >= wait.stall_s;
                st = Status::make(Code::Shortage,
                                  stalled ? "the pool stalled: no other tenant claimed, freed or was granted memory "
                                            "for " + seconds_text(idle) + " (a stopped or hung peer holds it)"
                                          : "gave up after " + seconds_text(total));
                break;
            }
        }
        if (reported < 0) {
            // Say so in the ledger, so borrowers lend: one waiting request,
            // unless the caller already reports its own.
            reported = waiting_.load();
            if (reported == 0) report_waiting(1);
        }
        const double idle = std::chrono::duration<double>(clock::now() - moved).count();
        const double total = std::chrono::duration<double>(clock::now() - start).count();
        wait_wakeup(std::min({kSliceS, wait.stall_s - idle, wait.timeout_s - total}));
        if (wait.interrupted && wait.interrupted()) {
            st = Status{Code::Interrupted, std::string()};
            break;
        }
    }
    if (reported == 0) report_waiting(0);
    if (st.code == Code::Closed || st.code == Code::Interrupted) return st;
    {
        // One answer, counted once, as alloc counts its own: the retries of
        // one wait are not shortages a reader should see.
        std::lock_guard<std::mutex> lk(mu_);
        if (closed_) return st;  // the slot may be given back already
        if (shortages_before >= 0)
            counters_.shortages = shortages_before + (st.code == Code::Shortage || st.code == Code::Unsatisfiable);
        if (st.is_ok() ? n > 0 : st.code == Code::Shortage || st.code == Code::Unsatisfiable)
            budget_.count_alloc(st.is_ok());
    }
    return st;
}

}  // namespace kvpool
