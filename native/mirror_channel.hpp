// The channel a mirrored space's leader and ranks share (design:
// mirror.hpp), and the helpers both sides use. Private to mirror_leader.cpp
// and mirror_rank.cpp.
#pragma once
#include <linux/futex.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <string>
#include <random>

#include "ledger.hpp"
#include "ledger_detail.hpp"
#include "mirror.hpp"

namespace kvpool {
namespace mirror_detail {
constexpr uint64_t kMagic = 0x6b76706f6f6c4d52ULL;  // "kvpoolMR"
constexpr uint32_t kVersion = 2;
constexpr int kMsgBytes = 200;
constexpr uint64_t kNoPage = 0xffffffffULL;  // a change that is only a wake-up (close)
constexpr double kRetryS = 0.2;              // a rank's pause before it retries a page that failed
using clock = std::chrono::steady_clock;

inline long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const struct timespec* ts) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

inline void futex_wait_for(std::atomic<uint32_t>* word, uint32_t seen, double seconds) {
    if (seconds <= 0) return;
    const double s = std::min(seconds, 3600.0);
    struct timespec ts;
    ts.tv_sec = static_cast<time_t>(s);
    ts.tv_nsec = static_cast<long>((s - static_cast<double>(ts.tv_sec)) * 1e9);
    futex(word, FUTEX_WAIT, seen, &ts);
}

// A process that exited (a zombie counts: its memory is freed) or whose pid
// now names a later process (start time given). Reads /proc: for waits that
// already took a while, not for every operation.
inline bool gone(int32_t pid, uint64_t start) { return ledger_detail::tenant_dead(pid, start); }
// The cheap look (one syscall): no such pid at all.
inline bool gone_fast(int32_t pid) { return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH; }

// The generation g was reached by an acknowledgement a (wrap-around safe).
inline bool reached(uint32_t a, uint32_t g) { return static_cast<int32_t>(a - g) >= 0; }

inline clock::duration seconds(double s) {
    return std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
}

// Seconds as a reader writes them ("5 s", "0.5 s"), for messages.
inline std::string seconds_text(double s) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g s", s);
    return buf;
}

inline uint64_t random_nonce() {
    uint64_t n = 0;
    if (getrandom(&n, sizeof(n), 0) != static_cast<ssize_t>(sizeof(n))) {
        std::random_device rd;
        n = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(clock::now().time_since_epoch().count());
    }
    return n | 1;  // never 0: 0 is "no channel"
}
}  // namespace mirror_detail

using mirror_detail::kMsgBytes;

struct RankSlot {
    std::atomic<int32_t> pid;   // 0: no rank attached
    std::atomic<uint32_t> ack;  // futex word: the generation this rank's memory matches
    std::atomic<uint64_t> start_time;  // the rank's process start time (pid reuse)
    std::atomic<uint32_t> fail_gen;
    std::atomic<int32_t> fail_code;
    std::atomic<int64_t> fail_page;
    std::atomic<int64_t> committed_pages, allocated_bytes;
    char fail_msg[kMsgBytes];
};

struct Channel {
    uint64_t magic;
    uint32_t version;
    int32_t num_ranks;
    uint64_t nonce;
    int64_t region_bytes, page_bytes, num_pages;
    int32_t device_type;
    int32_t leader_pid;
    int64_t first_region[kMaxRanks], rank_regions[kMaxRanks];
    std::atomic<uint32_t> gen;      // futex word: bumped after every change of want[]
    std::atomic<uint32_t> closed;   // the leader closed the space
    std::atomic<uint64_t> change;   // (generation << 32) | page of the latest change
    RankSlot ranks[kMaxRanks];

    std::atomic<uint8_t>* want() { return reinterpret_cast<std::atomic<uint8_t>*>(this + 1); }
    static size_t bytes_for(int64_t num_pages) { return sizeof(Channel) + static_cast<size_t>(num_pages); }
};
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint8_t>::is_always_lock_free,
              "the channel's words are shared between processes");


}  // namespace kvpool
