// A mirrored space's leader: the backend of the engine core's space, which
// publishes the page map and waits for the ranks (design: mirror.hpp).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "memfd.hpp"
#include "mirror_channel.hpp"

namespace kvpool {
using namespace mirror_detail;

// ------------------------------------------------------------------ leader

namespace {

class MirrorBackend final : public Backend {
public:
    explicit MirrorBackend(const MirrorConfig& cfg) : cfg_(cfg), n_(static_cast<int>(cfg.rank_regions.size())) {}
    ~MirrorBackend() override { close(); }

    Status open() {
        if (n_ < 1 || n_ > kMaxRanks || cfg_.page_bytes <= 0 || cfg_.region_bytes <= 0 ||
            cfg_.region_bytes % cfg_.page_bytes != 0 || !(cfg_.timeout_s > 0 && cfg_.timeout_s <= 3600) ||
            std::any_of(cfg_.rank_regions.begin(), cfg_.rank_regions.end(), [](int64_t r) { return r <= 0; }))
            return Status::make(Code::Invalid, "invalid mirrored space: " + std::to_string(n_) +
                                                   " ranks (1.." + std::to_string(kMaxRanks) +
                                                   ", each with at least one region), timeout " +
                                                   seconds_text(cfg_.timeout_s) + " (0 < timeout <= 3600)");
        num_pages_ = cfg_.region_bytes / cfg_.page_bytes;
        bytes_ = Channel::bytes_for(num_pages_);
        nonce_ = random_nonce();
        // Sealed against resizing, as the KV memfd (memfd.hpp): a rank maps it
        // through /proc, and so could any same-user process.
        if (Status st = create_sealed_memfd("kvpool-mirror", bytes_, &fd_); !st.is_ok()) return st;
        void* m = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
        if (m == MAP_FAILED) return Status::make(Code::Backend, errno_text("mmap (mirror channel)", errno));
        ch_ = new (m) Channel();  // zero-filled file: every word starts at 0
        ch_->magic = kMagic;
        ch_->version = kVersion;
        ch_->num_ranks = n_;
        ch_->nonce = nonce_;
        ch_->region_bytes = cfg_.region_bytes;
        ch_->page_bytes = cfg_.page_bytes;
        ch_->num_pages = num_pages_;
        ch_->device_type = cfg_.device_type;
        ch_->leader_pid = static_cast<int32_t>(getpid());
        int64_t first = 0;
        for (int r = 0; r < n_; ++r) {
            ch_->first_region[r] = first;
            ch_->rank_regions[r] = cfg_.rank_regions[r];
            first += cfg_.rank_regions[r];
        }
        known_pid_.assign(n_, 0);
        behind_.assign(n_, false);
        return Status::ok();
    }

    Status commit(int64_t page) override { return op(page, true); }
    Status release(int64_t page) override { return op(page, false); }

    int64_t allocated_bytes() const override {
        std::lock_guard<std::mutex> g(map_mu_);  // never waits for an operation in flight
        if (!ch_) return 0;
        int64_t total = 0;
        for (int r = 0; r < n_; ++r) {
            if (ch_->ranks[r].pid.load(std::memory_order_acquire) == 0) continue;
            // A rank's figure, bounded by what its regions can hold.
            const int64_t most = cfg_.rank_regions[r] * cfg_.region_bytes;
            total += std::clamp<int64_t>(ch_->ranks[r].allocated_bytes.load(std::memory_order_relaxed), 0, most);
        }
        return total;
    }
    void* region_base(int64_t) const override { return nullptr; }  // the memory lives in the ranks
    int device_type() const override { return cfg_.device_type; }
    int mirror_fd() const override { return fd_; }
    uint64_t mirror_nonce() const override { return nonce_; }

    void close() override {
        std::lock_guard<std::mutex> g(mu_);
        if (ch_) {
            ch_->closed.store(1, std::memory_order_seq_cst);
            publish_locked(-1, false);  // wakes every rank; they give their memory back
        }
        std::lock_guard<std::mutex> m(map_mu_);
        unmap();
    }
    void abandon() override {
        // A forked child's copy: never writes the channel (the parent's) and
        // takes no lock (an operation may have held one at the fork).
        unmap();
    }

    std::string describe() const override {
        std::lock_guard<std::mutex> g(map_mu_);
        int attached = 0;
        if (ch_)
            for (int r = 0; r < n_; ++r) attached += ch_->ranks[r].pid.load() != 0;
        char buf[160];
        std::snprintf(buf, sizeof(buf), "mirrored over %d ranks (%d attached), rank timeout %.3g s", n_, attached,
                      cfg_.timeout_s);
        return buf;
    }
    std::string last_error() const override {
        std::lock_guard<std::mutex> g(err_mu_);
        return last_error_;
    }

private:
    void unmap() {
        if (ch_) munmap(ch_, bytes_);
        ch_ = nullptr;
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }

    // want[page] = on, then the next generation (page -1: no change, a
    // wake-up). The generation is counted here, not read back from the
    // channel a rank can write.
    uint32_t publish_locked(int64_t page, bool on) {
        if (page >= 0) ch_->want()[page].store(on ? 1 : 0, std::memory_order_relaxed);
        const uint32_t g = ++gen_;
        const uint64_t page_bits = page >= 0 ? static_cast<uint64_t>(page) & kNoPage : kNoPage;
        ch_->change.store((static_cast<uint64_t>(g) << 32) | page_bits, std::memory_order_release);
        // seq_cst: ordered before the slot reads that follow (a rank that
        // attaches now either is seen by them or sees this generation).
        ch_->gen.store(g, std::memory_order_seq_cst);
        futex(&ch_->gen, FUTEX_WAKE, INT_MAX, nullptr);
        return g;
    }

    std::string who(int r, int32_t pid) const {
        return "rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ")";
    }

    bool rank_gone(int r, int32_t pid) const {
        return gone(pid, ch_->ranks[r].start_time.load(std::memory_order_acquire));
    }

    // A rank whose process is gone holds no memory: leave its slot free.
    void detach_locked(int r, int32_t pid) {
        int32_t expected = pid;
        if (ch_->ranks[r].pid.compare_exchange_strong(expected, 0))
            ch_->ranks[r].start_time.store(0, std::memory_order_release);
        known_pid_[r] = 0;
        behind_[r] = false;
    }

    // Note a slot's current pid; a new one (attached, re-attached, detached)
    // is not behind. Returns the pid.
    int32_t look_locked(int r) {
        const int32_t pid = ch_->ranks[r].pid.load(std::memory_order_seq_cst);
        if (pid != known_pid_[r]) {
            known_pid_[r] = pid;
            behind_[r] = false;
        }
        return pid;
    }

    Status op(int64_t page, bool on) {
        std::lock_guard<std::mutex> g(mu_);
        if (!ch_) return Status::make(Code::Closed, "mirrored space closed");
        if (page < 0 || page >= num_pages_)
            return Status::make(Code::Invalid, "page " + std::to_string(page) + " out of range");
        const std::string what = std::string(on ? "commit" : "release") + "(page " + std::to_string(page) + "): ";
        // A rank still behind fails the operation before anything changes.
        for (int r = 0; r < n_; ++r) {
            const int32_t pid = look_locked(r);
            if (pid == 0 || !behind_[r]) continue;
            if (gone_fast(pid) || rank_gone(r, pid)) {
                detach_locked(r, pid);
            } else if (reached(ch_->ranks[r].ack.load(std::memory_order_acquire), gen_)) {
                behind_[r] = false;
            } else {
                return fail_locked(Code::Shortage, what + who(r, pid) + " is behind: it has not answered for " +
                                                       seconds_text(cfg_.timeout_s) + " or more");
            }
        }
        const uint32_t gen = publish_locked(page, on);
        Status s = await_locked(gen, page, on, clock::now() + seconds(cfg_.timeout_s));
        if (on && !s.is_ok()) {
            // Roll back: no rank keeps a page the space does not count.
            const uint32_t back = publish_locked(page, false);
            Status r = await_locked(back, page, false, clock::now() + seconds(cfg_.timeout_s));
            if (!r.is_ok()) s.message += "; rollback: " + r.message;
            return fail_locked(s.code, s.message);
        }
        if (!on && !s.is_ok()) {
            // The map says released; a rank that did not follow holds the
            // page until it answers (mirror.hpp: a rank stopped mid-release).
            std::lock_guard<std::mutex> e(err_mu_);
            last_error_ = s.message;
            return Status::ok();
        }
        return s;
    }

    Status fail_locked(Code code, const std::string& msg) {
        std::lock_guard<std::mutex> e(err_mu_);
        last_error_ = msg;
        return Status::make(code, msg);
    }

    // Waits for every rank attached now (after the publish: one attaching
    // meanwhile either is seen here or read this generation's map) to
    // acknowledge `gen`; the first failure wins the status. A rank that did
    // not answer in time is behind; one that exited is detached and skipped
    // (it holds nothing; a new process catches up when it attaches).
    Status await_locked(uint32_t gen, int64_t page, bool on, clock::time_point deadline) {
        Status result;
        const std::string what = std::string(on ? "commit" : "release") + "(page " + std::to_string(page) + "): ";
        for (int r = 0; r < n_; ++r) {
            const int32_t pid = look_locked(r);
            if (pid == 0 || behind_[r]) continue;
            RankSlot& s = ch_->ranks[r];
            bool waited = false;  // look in /proc only once an answer is slow
            for (;;) {
                const uint32_t a = s.ack.load(std::memory_order_acquire);
                if (reached(a, gen)) {
                    if (s.fail_gen.load(std::memory_order_acquire) == gen &&
                        s.fail_page.load(std::memory_order_relaxed) == page && result.is_ok()) {
                        char msg[kMsgBytes + 1];
                        std::memcpy(msg, s.fail_msg, kMsgBytes);
                        msg[kMsgBytes] = '\0';
                        // A rank writes Shortage or Backend; anything else is garbage.
                        const Code c = s.fail_code.load(std::memory_order_relaxed) == static_cast<int>(Code::Shortage)
                                           ? Code::Shortage
                                           : Code::Backend;
                        result = Status::make(c, what + who(r, pid) + ": " + msg);
                    }
                    break;
                }
                if (s.pid.load(std::memory_order_acquire) != pid || (waited && rank_gone(r, pid))) {
                    detach_locked(r, pid);
                    break;
                }
                const auto now = clock::now();
                if (now >= deadline) {
                    behind_[r] = true;
                    if (result.is_ok())
                        result = Status::make(Code::Shortage, what + who(r, pid) + " did not answer within " +
                                                                  seconds_text(cfg_.timeout_s));
                    break;
                }
                const double left = std::chrono::duration<double>(deadline - now).count();
                futex_wait_for(&s.ack, a, std::min(left, 0.1));  // 0.1 s: re-check the rank is alive
                waited = true;
            }
        }
        return result;
    }

    MirrorConfig cfg_;
    const int n_;
    // mu_: one operation at a time (held while it waits for the ranks).
    // map_mu_: ch_ for the readers that must not wait for an operation
    // (figures); unmapping takes both.
    mutable std::mutex mu_, map_mu_, err_mu_;
    std::string last_error_;
    Channel* ch_ = nullptr;
    int fd_ = -1;
    size_t bytes_ = 0;
    int64_t num_pages_ = 0;
    uint64_t nonce_ = 0;
    uint32_t gen_ = 0;
    std::vector<int32_t> known_pid_;
    std::vector<bool> behind_;
};

}  // namespace

std::unique_ptr<Backend> make_mirror_backend(const MirrorConfig& cfg, Status* status) {
    auto b = std::make_unique<MirrorBackend>(cfg);
    *status = b->open();
    if (!status->is_ok()) return nullptr;
    return b;
}


}  // namespace kvpool
