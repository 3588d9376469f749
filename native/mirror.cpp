// Mirrored spaces: the leader's backend and a rank's RankMemory over one
// shared channel (design: mirror.hpp).
#include "mirror.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>

#include "ledger.hpp"
#include "ledger_detail.hpp"

namespace kvpool {

namespace {
constexpr uint64_t kMagic = 0x6b76706f6f6c4d52ULL;  // "kvpoolMR"
constexpr uint32_t kVersion = 2;
constexpr int kMsgBytes = 200;
constexpr uint64_t kNoPage = 0xffffffffULL;  // a change that is only a wake-up (close)
constexpr double kRetryS = 0.2;              // a rank's pause before it retries a page that failed
using clock = std::chrono::steady_clock;

long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const struct timespec* ts) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

void futex_wait_for(std::atomic<uint32_t>* word, uint32_t seen, double seconds) {
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
bool gone(int32_t pid, uint64_t start) { return ledger_detail::tenant_dead(pid, start); }
// The cheap look (one syscall): no such pid at all.
bool gone_fast(int32_t pid) { return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH; }

// The generation g was reached by an acknowledgement a (wrap-around safe).
bool reached(uint32_t a, uint32_t g) { return static_cast<int32_t>(a - g) >= 0; }

clock::duration seconds(double s) {
    return std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
}

uint64_t random_nonce() {
    uint64_t n = 0;
    if (getrandom(&n, sizeof(n), 0) != static_cast<ssize_t>(sizeof(n))) {
        std::random_device rd;
        n = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(clock::now().time_since_epoch().count());
    }
    return n | 1;  // never 0: 0 is "no channel"
}
}  // namespace

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
                                                   std::to_string(cfg_.timeout_s) + " s (0 < timeout <= 3600)");
        num_pages_ = cfg_.region_bytes / cfg_.page_bytes;
        bytes_ = Channel::bytes_for(num_pages_);
        nonce_ = random_nonce();
        fd_ = memfd_create("kvpool-mirror", MFD_CLOEXEC);
        if (fd_ < 0) return Status::make(Code::Backend, errno_text("memfd_create", errno));
        if (ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) return Status::make(Code::Backend, errno_text("ftruncate", errno));
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
                                                       std::to_string(cfg_.timeout_s) + " s or more");
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
                                                                  std::to_string(cfg_.timeout_s) + " s");
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

// ------------------------------------------------------------------ rank

std::unique_ptr<RankMemory> RankMemory::attach(int pid, int fd, uint64_t nonce, int rank, const std::string& device,
                                               Status* status) {
    auto fail = [&](Code c, const std::string& m) {
        *status = Status::make(c, m);
        return std::unique_ptr<RankMemory>();
    };
    if (pid <= 0 || fd < 0 || nonce == 0)
        return fail(Code::Invalid, "invalid rank handle: pid " + std::to_string(pid) + ", fd " + std::to_string(fd));
    if (rank < 0 || rank >= kMaxRanks) return fail(Code::Invalid, "rank " + std::to_string(rank) + " out of range");
    int dtype = 0, dev = 0;
    if (device == "cpu") {
        dtype = 1;
    } else if (device.rfind("cuda:", 0) == 0) {
        dtype = 2;
        dev = std::atoi(device.c_str() + 5);
    } else {
        return fail(Code::Invalid, "unknown device '" + device + "'");
    }
    const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
    const uint64_t leader_start = process_start_time(pid);
    const int cfd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NONBLOCK);
    if (cfd < 0) return fail(Code::Backend, errno_text("open " + path + " (the leader's mirror channel)", errno));
    struct stat st;
    if (fstat(cfd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<size_t>(st.st_size) < sizeof(Channel)) {
        ::close(cfd);
        return fail(Code::Invalid, path + " is not a kvpool mirror channel");
    }
    const size_t size = static_cast<size_t>(st.st_size);
    void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, cfd, 0);
    ::close(cfd);
    if (m == MAP_FAILED) return fail(Code::Backend, errno_text("mmap " + path, errno));
    Channel* ch = static_cast<Channel*>(m);
    auto bad = [&](const std::string& why) {
        munmap(m, size);
        return fail(Code::Invalid, path + ": " + why);
    };
    if (ch->magic != kMagic || ch->version != kVersion) return bad("not a kvpool mirror channel of this version");
    if (ch->nonce != nonce) return bad("another mirrored space than the handle's (the handle is stale)");
    const int64_t region_bytes = ch->region_bytes, page_bytes = ch->page_bytes, num_pages = ch->num_pages;
    const int num_ranks = ch->num_ranks;
    if (num_ranks < 1 || num_ranks > kMaxRanks || page_bytes <= 0 || region_bytes <= 0 ||
        region_bytes % page_bytes != 0 || num_pages != region_bytes / page_bytes ||
        Channel::bytes_for(num_pages) > size)
        return bad("inconsistent channel header");
    if (rank >= num_ranks)
        return bad("rank " + std::to_string(rank) + " out of range: the space has " + std::to_string(num_ranks) + " ranks");
    if (ch->device_type != dtype)
        return bad(std::string("the space's ranks are on ") + (ch->device_type == 2 ? "cuda" : "cpu") + ", not " + device);
    const int64_t regions = ch->rank_regions[rank], first = ch->first_region[rank];
    if (regions <= 0 || regions > (INT64_MAX / 4) / region_bytes || first < 0) return bad("inconsistent rank regions");

    std::unique_ptr<RankMemory> rm(new RankMemory());
    rm->map_bytes_ = size;
    rm->rank_ = rank;
    rm->pid_ = static_cast<int32_t>(getpid());
    rm->leader_pid_ = pid;
    rm->leader_start_ = leader_start;
    rm->first_region_ = first;
    rm->num_regions_ = regions;
    rm->region_bytes_ = region_bytes;
    rm->page_bytes_ = page_bytes;
    rm->device_ = device;
    // Claim the slot: free, or left by a process that is gone.
    RankSlot& slot = ch->ranks[rank];
    int32_t expected = 0;
    if (!slot.pid.compare_exchange_strong(expected, rm->pid_)) {
        const bool dead = expected != rm->pid_ && gone(expected, slot.start_time.load());
        // Taking over a dead rank's slot: its start time goes first, so
        // that no reader pairs this pid with the old process's start time.
        if (dead) slot.start_time.store(0, std::memory_order_seq_cst);
        if (!dead || !slot.pid.compare_exchange_strong(expected, rm->pid_)) {
            munmap(m, size);
            return fail(Code::Ledger, "rank " + std::to_string(rank) + " is attached already (pid " + std::to_string(expected) + ")");
        }
    }
    slot.start_time.store(process_start_time(rm->pid_), std::memory_order_release);
    rm->ch_ = ch;  // from here close() gives the slot back
    BackendConfig bc{regions, region_bytes, page_bytes};
    Status s;
    rm->backend_ = dtype == 1 ? make_cpu_backend(bc, &s) : make_cuda_backend(bc, dev, &s);
    if (!rm->backend_) {
        rm->close();
        *status = s;
        return nullptr;
    }
    rm->have_.assign(static_cast<size_t>(num_pages), 0);
    // Read after the claim (seq_cst): a leader that published before it is
    // in this map; one that publishes after it waits for this rank.
    const uint32_t g = ch->gen.load(std::memory_order_seq_cst);
    if (!rm->full_pass(-1)) {
        std::string why;
        {
            std::lock_guard<std::mutex> e(rm->err_mu_);
            why = rm->last_error_;
        }
        rm->close();
        *status = Status::make(Code::Shortage, "rank " + std::to_string(rank) +
                                                   " cannot map the pages the space holds: " + why);
        return nullptr;
    }
    rm->seen_ = g;
    rm->publish_figures();
    slot.ack.store(g, std::memory_order_release);
    futex(&slot.ack, FUTEX_WAKE, INT_MAX, nullptr);
    try {
        rm->thread_ = std::thread([p = rm.get()] { p->thread_main(); });
    } catch (const std::system_error& e) {
        rm->close();
        *status = Status::make(Code::Backend, std::string("cannot start the rank's sync thread: ") + e.what());
        return nullptr;
    }
    *status = Status::ok();
    return rm;
}

RankMemory::~RankMemory() {
    close();
    if (ch_) munmap(ch_, map_bytes_);
}

void* RankMemory::base() const { return backend_ ? backend_->region_base(0) : nullptr; }
int64_t RankMemory::bytes() const { return num_regions_ * region_bytes_; }
int RankMemory::device_type() const { return backend_ ? backend_->device_type() : 1; }
int RankMemory::device_id() const { return backend_ ? backend_->device_id() : 0; }

void RankMemory::record_failure(int64_t p, const Status& s) {
    failures_.fetch_add(1, std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> g(err_mu_);
        last_error_ = s.message;
    }
    RankSlot& slot = ch_->ranks[rank_];
    std::snprintf(slot.fail_msg, kMsgBytes, "%s", s.message.c_str());
    slot.fail_code.store(static_cast<int>(s.code == Code::Shortage ? Code::Shortage : Code::Backend),
                         std::memory_order_relaxed);
    slot.fail_page.store(p, std::memory_order_relaxed);
    slot.fail_gen.store(ch_->gen.load(std::memory_order_relaxed), std::memory_order_release);
}

// Brings page p to the map; false if a page the map wants could not be
// committed. A release that fails is retried later (dirty_).
bool RankMemory::reconcile_page(int64_t p) {
    if (p < 0 || p >= static_cast<int64_t>(have_.size())) return true;
    const bool on = ch_->want()[p].load(std::memory_order_relaxed) != 0;
    if (on == (have_[p] != 0)) return true;
    Status s = on ? backend_->commit(p) : backend_->release(p);
    if (s.is_ok()) {
        have_[p] = on ? 1 : 0;
        (on ? commits_ : releases_).fetch_add(1, std::memory_order_relaxed);
        return true;
    }
    record_failure(p, s);
    if (!on) dirty_ = true;
    return !on;
}

// Every page to the map. True when every page the map wants is mapped,
// except possibly `change_page` (the current operation's page: its failure
// is recorded for the leader, which rolls it back). False: a page the map
// wants is missing, so this rank does not match any generation yet.
bool RankMemory::full_pass(int64_t change_page) {
    bool ok = true;
    for (int64_t p = 0; p < static_cast<int64_t>(have_.size()); ++p)
        if (!reconcile_page(p) && p != change_page) ok = false;
    return ok;
}

void RankMemory::publish_figures() {
    RankSlot& slot = ch_->ranks[rank_];
    int64_t n = 0;
    for (uint8_t h : have_) n += h;
    slot.committed_pages.store(n, std::memory_order_relaxed);
    slot.allocated_bytes.store(backend_->allocated_bytes(), std::memory_order_relaxed);
}

void RankMemory::thread_main() {
    struct Done {
        std::atomic<bool>& flag;
        ~Done() { flag.store(true, std::memory_order_release); }
    } done{thread_done_};
    RankSlot& slot = ch_->ranks[rank_];
    auto retry_at = clock::time_point::min();
    while (!stop_.load(std::memory_order_acquire)) {
        if (ch_->closed.load(std::memory_order_acquire)) {
            release_all();  // the engine closed the space: it needs none of this memory
            return;
        }
        const uint32_t g = ch_->gen.load(std::memory_order_acquire);
        const bool due = dirty_ && clock::now() >= retry_at;
        if (g != seen_ || due) {
            const uint64_t c = ch_->change.load(std::memory_order_acquire);
            const bool tagged = static_cast<uint32_t>(c >> 32) == g;
            const int64_t page = tagged && (c & kNoPage) != kNoPage ? static_cast<int64_t>(c & kNoPage) : -1;
            bool matches;
            if (!dirty_ && g == seen_ + 1 && tagged) {
                (void)reconcile_page(page);  // its failure is for the leader to roll back
                matches = true;
            } else {
                dirty_ = false;
                matches = full_pass(page);
            }
            publish_figures();
            if (!matches) {
                // A page the map wants is missing: no acknowledgement (the
                // leader sees this rank behind) until a retry maps it.
                dirty_ = true;
            } else {
                seen_ = g;
                slot.ack.store(g, std::memory_order_release);
                futex(&slot.ack, FUTEX_WAKE, INT_MAX, nullptr);
            }
            if (dirty_) retry_at = clock::now() + seconds(kRetryS);
            if (g != seen_ && matches) continue;
        }
        const double wait = dirty_ ? std::max(0.001, std::min(
                                         kRetryS, std::chrono::duration<double>(retry_at - clock::now()).count()))
                                   : 0.2;  // 0.2 s: notice a leader that died without closing
        futex_wait_for(&ch_->gen, g, wait);
        if (ch_->gen.load(std::memory_order_acquire) == g && gone(leader_pid_, leader_start_)) {
            release_all();
            return;
        }
    }
}

void RankMemory::release_all() {
    if (!backend_) return;
    for (size_t p = 0; p < have_.size(); ++p) {
        if (!have_[p]) continue;
        if (backend_->release(static_cast<int64_t>(p)).is_ok()) {
            have_[p] = 0;
            releases_.fetch_add(1, std::memory_order_relaxed);
        }
    }
    publish_figures();
}

bool RankMemory::sync(double timeout_s) {
    if (!ch_ || closed_.load(std::memory_order_acquire)) return false;
    const auto deadline = clock::now() + seconds(std::max(0.0, std::min(timeout_s, 1e6)));
    RankSlot& slot = ch_->ranks[rank_];
    for (;;) {
        const uint32_t a = slot.ack.load(std::memory_order_acquire);
        // After the leader closed: once this rank gave its memory back.
        if (ch_->closed.load(std::memory_order_acquire) ? thread_done_.load(std::memory_order_acquire)
                                                          : reached(a, ch_->gen.load(std::memory_order_acquire)))
            return true;
        if (thread_done_.load(std::memory_order_acquire)) return true;  // the leader died: nothing to follow
        const auto now = clock::now();
        if (now >= deadline) return false;
        futex_wait_for(&slot.ack, a, std::min(0.05, std::chrono::duration<double>(deadline - now).count()));
    }
}

RankStats RankMemory::stats() const {
    RankStats s;
    s.rank = rank_;
    s.device = device_;
    s.first_region = first_region_;
    s.num_regions = num_regions_;
    s.region_bytes = region_bytes_;
    s.page_bytes = page_bytes_;
    s.num_pages = static_cast<int64_t>(have_.size());
    s.commits = commits_.load(std::memory_order_relaxed);
    s.releases = releases_.load(std::memory_order_relaxed);
    s.failures = failures_.load(std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> g(err_mu_);
        s.last_error = last_error_;
    }
    if (!ch_) return s;
    const RankSlot& slot = ch_->ranks[rank_];
    s.committed_pages = slot.committed_pages.load(std::memory_order_relaxed);
    s.allocated_bytes = backend_ ? backend_->allocated_bytes() : 0;
    s.generation = slot.ack.load(std::memory_order_acquire);
    return s;
}

void RankMemory::close() {
    if (closed_.exchange(true)) return;
    if (static_cast<int32_t>(getpid()) != pid_) {
        // A forked child's copy: the thread and the memory are the parent's.
        if (thread_.joinable()) thread_.detach();
        if (backend_) backend_->abandon();
        return;
    }
    stop_.store(true, std::memory_order_release);
    if (thread_.joinable()) {
        if (ch_) futex(&ch_->gen, FUTEX_WAKE, INT_MAX, nullptr);
        thread_.join();
    }
    if (ch_) {
        release_all();
        int32_t mine = pid_;
        if (ch_->ranks[rank_].pid.load() == mine) ch_->ranks[rank_].start_time.store(0, std::memory_order_seq_cst);
        ch_->ranks[rank_].pid.compare_exchange_strong(mine, 0);
        futex(&ch_->ranks[rank_].ack, FUTEX_WAKE, INT_MAX, nullptr);
        // The channel stays mapped until the destructor: a concurrent
        // sync() or stats() may still read it.
    }
    if (backend_) backend_->close();
}

}  // namespace kvpool
