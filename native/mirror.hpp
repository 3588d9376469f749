// Mirrored spaces: one engine whose KV cache is split over several ranks
// (tensor / pipeline parallel), each rank's memory held by its own process.
//
// Why: a CUDA VMM mapping belongs to the process that made it, so on a
// multi-GPU engine the scheduler's process cannot commit the pages its
// workers' kernels read; each worker must map its own. (On the CPU one
// process's memfd can be mapped by the others, which is how unmirrored TP
// spaces work; a mirrored space works on the CPU too, one memfd per rank,
// which is how it is tested against real processes without a GPU.)
//
// Design: the page map is the message. The leader (the engine core: the
// space, its budget and its ledger claims) owns a small shared segment,
// the *channel*: a `want` byte per page, a generation word, and one slot per
// rank. A commit or release of page p is
//   1. want[p] = 1 or 0, then the generation + 1 (a shared futex word, woken);
//   2. every attached rank's sync thread (RankMemory) brings its own backend
//      to the map (commit what is wanted, release what is not), writes its
//      result and acknowledges the generation (its own futex word);
//   3. the leader waits for every attached rank's acknowledgement, up to a
//      timeout, and only then answers the space.
// So a page is committed on every rank before the scheduler hands out its
// blocks (a worker never runs a step on an unmapped page), and on none when
// any rank fails: a rank that cannot commit (out of memory) makes the leader
// publish want[p] = 0 again, the others release it, and the commit fails as
// a shortage, which the engine's step sees as a full cache.
// Ranks that stop answering cost a shortage, never a hang: the first
// operation after a rank stops waits up to the timeout; from then on the rank
// is *behind* and every commit and release fails at once (a shortage; the
// space keeps a page whose release failed counted, and retries it) until its
// acknowledgement catches up with the generation. A rank that cannot bring
// its memory to the map (a page it cannot map that is not the current
// operation's) does not acknowledge at all, so it is behind too, and retries
// every 0.2 s. A rank whose process exited (a zombie, or its pid reused:
// slots carry the process start time) holds nothing: it is detached and the
// operation goes on with the others. A rank that attaches late (or again)
// brings its backend to the whole map before it acknowledges anything; the
// leader looks for attached ranks after it publishes, so one attaching
// meanwhile either is waited for or reads the new map. Handles carry the
// channel's random nonce (a stale handle whose fd number now names another
// channel is refused); a forked child's copy of either side is inert.
// The books: the space counts a page for all ranks (page_commit_bytes =
// regions of every rank x page bytes); allocated_bytes() sums what the
// ranks' backends report. A rank stopped in the middle of a release holds
// that one page until it resumes (then the map tells it to let go).
// Trust: the channel is a memfd reached through /proc/<leader>/fd (same
// user, ptrace-mode access); the leader bounds every figure a rank writes.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend.hpp"
#include "status.hpp"

namespace kvpool {

constexpr int kMaxRanks = 64;

struct MirrorConfig {
    int64_t region_bytes = 0;
    int64_t page_bytes = 0;
    std::vector<int64_t> rank_regions;  // regions of each rank, in the space's order
    int device_type = 1;                // DLPack device type of the ranks' memory: 1 CPU, 2 CUDA
    double timeout_s = 5.0;             // how long one operation waits for a rank
};

// The leader's backend: holds no memory itself (region_base() is null).
std::unique_ptr<Backend> make_mirror_backend(const MirrorConfig& cfg, Status* status);

struct RankStats {
    int rank = 0;
    int64_t first_region = 0, num_regions = 0, region_bytes = 0, page_bytes = 0, num_pages = 0;
    int64_t committed_pages = 0, allocated_bytes = 0;
    int64_t commits = 0, releases = 0, failures = 0;
    uint32_t generation = 0;  // the last generation this rank acknowledged
    std::string device;       // the backend's device, e.g. "cpu" or "cuda:1"
    std::string last_error;
};

struct Channel;

// A rank's side: its own backend over its regions, kept equal to the
// leader's map by a sync thread. Everything it needs from the channel's
// header is copied and checked at attach; later it reads only the map, the
// generation and its own slot.
class RankMemory {
public:
    // Attach to the channel behind /proc/<pid>/fd/<fd> as `rank`, with memory
    // on `device` ("cpu" or "cuda:N"); `nonce` must be the channel's (a stale
    // handle whose fd number was reused is refused). nullptr + *status on failure.
    static std::unique_ptr<RankMemory> attach(int pid, int fd, uint64_t nonce, int rank, const std::string& device,
                                              Status* status);
    ~RankMemory();  // unmaps the channel (close() never does: a concurrent sync() may read it)
    RankMemory(const RankMemory&) = delete;
    RankMemory& operator=(const RankMemory&) = delete;

    void* base() const;
    int64_t bytes() const;  // this rank's regions, back to back
    int device_type() const;
    int device_id() const;
    RankStats stats() const;
    // Wait until this rank matches the leader's current generation (after
    // the leader closed: until this rank gave its memory back); false on
    // timeout or once closed. For tests and start-up.
    bool sync(double timeout_s);
    // Give every page back, stop the thread, leave the slot. Idempotent. In
    // a forked child (not the process that attached) it only lets go of its
    // copy: no release, no slot write, no join.
    void close();
    // Closed here, or the leader closed or died and this rank let go.
    bool closed() const {
        return closed_.load(std::memory_order_acquire) || thread_done_.load(std::memory_order_acquire);
    }

private:
    RankMemory() = default;
    bool reconcile_page(int64_t p);
    bool full_pass(int64_t change_page);
    void record_failure(int64_t p, const Status& s);
    void publish_figures();
    void thread_main();
    void release_all();

    Channel* ch_ = nullptr;
    size_t map_bytes_ = 0;
    int rank_ = 0;
    int32_t pid_ = 0;          // this process (a forked child sees another pid)
    int32_t leader_pid_ = 0;   // from the handle, not the header
    uint64_t leader_start_ = 0;
    int64_t first_region_ = 0, num_regions_ = 0, region_bytes_ = 0, page_bytes_ = 0;
    std::string device_;
    std::unique_ptr<Backend> backend_;
    std::vector<uint8_t> have_;  // its size is the page count, fixed at attach
    uint32_t seen_ = 0;
    // A page the map wants could not be committed, or a release failed:
    // look at the whole map again after a pause (never a busy loop).
    bool dirty_ = false;
    std::atomic<int64_t> commits_{0}, releases_{0}, failures_{0};
    mutable std::mutex err_mu_;
    std::string last_error_;
    std::thread thread_;
    std::atomic<bool> stop_{false}, closed_{false}, thread_done_{false};
};

}  // namespace kvpool
