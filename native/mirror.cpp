// Mirrored spaces: the leader's backend and a rank's RankMemory over one
// shared channel (design: mirror.hpp).
#include "mirror.hpp"

#include "ledger_detail.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
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

namespace kvpool {

namespace {
constexpr uint64_t kMagic = 0x6b76706f6f6c4d52ULL;  // "kvpoolMR"
constexpr uint32_t kVersion = 1;
constexpr int kMsgBytes = 200;
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

// A rank or leader that exited (a zombie counts: its memory is freed). Reads
// /proc: for waits that already took a while, not for every operation.
bool pid_gone(int32_t pid) { return ledger_detail::tenant_dead(pid, 0); }
// The cheap look (one syscall): no such pid at all.
bool pid_gone_fast(int32_t pid) { return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH; }

// The generation g was reached by an acknowledgement a (wrap-around safe).
bool reached(uint32_t a, uint32_t g) { return static_cast<int32_t>(a - g) >= 0; }
}  // namespace

struct RankSlot {
    std::atomic<int32_t> pid;   // 0: no rank attached
    std::atomic<uint32_t> ack;  // futex word: the generation this rank's memory matches
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
    explicit MirrorBackend(const MirrorConfig& cfg) : cfg_(cfg) {}
    ~MirrorBackend() override { close(); }

    Status open() {
        const int64_t n = static_cast<int64_t>(cfg_.rank_regions.size());
        if (n < 1 || n > kMaxRanks || cfg_.page_bytes <= 0 || cfg_.region_bytes <= 0 ||
            cfg_.region_bytes % cfg_.page_bytes != 0 || !(cfg_.timeout_s > 0 && cfg_.timeout_s <= 3600) ||
            std::any_of(cfg_.rank_regions.begin(), cfg_.rank_regions.end(), [](int64_t r) { return r <= 0; }))
            return Status::make(Code::Invalid, "invalid mirrored space: " + std::to_string(n) +
                                                   " ranks (1.." + std::to_string(kMaxRanks) +
                                                   ", each with at least one region), timeout " +
                                                   std::to_string(cfg_.timeout_s) + " s (0 < timeout <= 3600)");
        num_pages_ = cfg_.region_bytes / cfg_.page_bytes;
        bytes_ = Channel::bytes_for(num_pages_);
        fd_ = memfd_create("kvpool-mirror", MFD_CLOEXEC);
        if (fd_ < 0) return Status::make(Code::Backend, errno_text("memfd_create", errno));
        if (ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) return Status::make(Code::Backend, errno_text("ftruncate", errno));
        void* m = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
        if (m == MAP_FAILED) return Status::make(Code::Backend, errno_text("mmap (mirror channel)", errno));
        ch_ = new (m) Channel();  // zero-filled file: every word starts at 0
        ch_->magic = kMagic;
        ch_->version = kVersion;
        ch_->num_ranks = static_cast<int32_t>(n);
        ch_->region_bytes = cfg_.region_bytes;
        ch_->page_bytes = cfg_.page_bytes;
        ch_->num_pages = num_pages_;
        ch_->device_type = cfg_.device_type;
        ch_->leader_pid = static_cast<int32_t>(getpid());
        int64_t first = 0;
        for (int64_t r = 0; r < n; ++r) {
            ch_->first_region[r] = first;
            ch_->rank_regions[r] = cfg_.rank_regions[r];
            first += cfg_.rank_regions[r];
        }
        known_pid_.assign(n, 0);
        behind_.assign(n, false);
        return Status::ok();
    }

    Status commit(int64_t page) override { return op(page, true); }
    Status release(int64_t page) override { return op(page, false); }

    int64_t allocated_bytes() const override {
        std::lock_guard<std::mutex> g(map_mu_);  // never waits for an operation in flight
        if (!ch_) return 0;
        int64_t total = 0;
        for (int r = 0; r < ch_->num_ranks; ++r)
            if (ch_->ranks[r].pid.load(std::memory_order_acquire) != 0)
                total += std::max<int64_t>(0, ch_->ranks[r].allocated_bytes.load(std::memory_order_relaxed));
        return total;
    }
    void* region_base(int64_t) const override { return nullptr; }  // the memory lives in the ranks
    int device_type() const override { return cfg_.device_type; }
    int mirror_fd() const override { return fd_; }

    void close() override {
        std::lock_guard<std::mutex> g(mu_);
        if (!ch_) return;
        ch_->closed.store(1, std::memory_order_release);
        publish_locked(-1, false);  // wakes every rank; they give their memory back
        unmap_locked();
    }
    void abandon() override {
        // A forked child's copy: never writes the channel (the parent's).
        std::lock_guard<std::mutex> g(mu_);
        unmap_locked();
    }

    std::string describe() const override {
        std::lock_guard<std::mutex> g(map_mu_);
        int attached = 0;
        if (ch_)
            for (int r = 0; r < ch_->num_ranks; ++r) attached += ch_->ranks[r].pid.load() != 0;
        char buf[160];
        std::snprintf(buf, sizeof(buf), "mirrored over %zu ranks (%d attached), rank timeout %.3g s",
                      cfg_.rank_regions.size(), attached, cfg_.timeout_s);
        return buf;
    }
    std::string last_error() const override {
        std::lock_guard<std::mutex> g(err_mu_);
        return last_error_;
    }

private:
    void unmap_locked() {
        std::lock_guard<std::mutex> m(map_mu_);
        if (ch_) munmap(ch_, bytes_);
        ch_ = nullptr;
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }

    // want[page] = on, then the next generation (page -1: no change, a wake-up).
    uint32_t publish_locked(int64_t page, bool on) {
        if (page >= 0) ch_->want()[page].store(on ? 1 : 0, std::memory_order_relaxed);
        const uint32_t g = ch_->gen.load(std::memory_order_relaxed) + 1;
        const uint64_t page_bits = page >= 0 ? static_cast<uint64_t>(page) & 0xffffffffULL : 0xffffffffULL;
        ch_->change.store((static_cast<uint64_t>(g) << 32) | page_bits, std::memory_order_release);
        ch_->gen.store(g, std::memory_order_release);
        futex(&ch_->gen, FUTEX_WAKE, INT_MAX, nullptr);
        return g;
    }

    std::string who(int r, int32_t pid) const {
        return "rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ")";
    }

    // A rank whose process is gone holds no memory: leave its slot free.
    void detach_locked(int r, int32_t pid) {
        int32_t expected = pid;
        ch_->ranks[r].pid.compare_exchange_strong(expected, 0);
        known_pid_[r] = 0;
        behind_[r] = false;
    }

    Status op(int64_t page, bool on) {
        std::lock_guard<std::mutex> g(mu_);
        if (!ch_) return Status::make(Code::Closed, "mirrored space closed");
        if (page < 0 || page >= num_pages_)
            return Status::make(Code::Invalid, "page " + std::to_string(page) + " out of range");
        const char* what = on ? "commit" : "release";
        // Who takes part: attached ranks that are alive and not behind.
        std::vector<int> live;
        for (int r = 0; r < ch_->num_ranks; ++r) {
            RankSlot& s = ch_->ranks[r];
            const int32_t pid = s.pid.load(std::memory_order_acquire);
            if (pid != known_pid_[r]) {  // attached, re-attached or detached since the last operation
                known_pid_[r] = pid;
                behind_[r] = false;
            }
            if (pid == 0) continue;
            if (pid_gone_fast(pid)) {
                detach_locked(r, pid);
                continue;
            }
            if (behind_[r]) {
                if (reached(s.ack.load(std::memory_order_acquire), ch_->gen.load(std::memory_order_relaxed))) {
                    behind_[r] = false;
                } else {
                    return fail_locked(Code::Shortage, std::string(what) + "(page " + std::to_string(page) + "): " +
                                                           who(r, pid) + " is behind: it has not answered for " +
                                                           std::to_string(cfg_.timeout_s) + " s or more");
                }
            }
            live.push_back(r);
        }
        const uint32_t gen = publish_locked(page, on);
        Status s = await_locked(gen, live, page, on, clock::now() + to_duration(cfg_.timeout_s));
        if (on && !s.is_ok()) {
            // Roll back: no rank keeps a page the space does not count.
            const uint32_t back = publish_locked(page, false);
            Status r = await_locked(back, live, page, false, clock::now() + to_duration(cfg_.timeout_s));
            if (!r.is_ok()) s.message += "; rollback: " + r.message;
            return fail_locked(s.code, s.message);
        }
        if (!on && !s.is_ok()) {
            // The map says released; the ranks that did not follow hold the
            // page until they answer (mirror.hpp: a rank stopped mid-release).
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

    static clock::duration to_duration(double s) {
        return std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
    }

    // Waits for every rank in `live` to acknowledge `gen`; the first failure
    // wins the status. Marks a rank that did not answer in time as behind.
    Status await_locked(uint32_t gen, const std::vector<int>& live, int64_t page, bool on, clock::time_point deadline) {
        Status result;
        const std::string what = std::string(on ? "commit" : "release") + "(page " + std::to_string(page) + "): ";
        for (int r : live) {
            if (behind_[r]) continue;  // timed out earlier in this operation: not waited for twice
            RankSlot& s = ch_->ranks[r];
            const int32_t pid = known_pid_[r];
            bool waited = false;  // look in /proc only once an answer is slow
            for (;;) {
                const uint32_t a = s.ack.load(std::memory_order_acquire);
                if (reached(a, gen)) {
                    if (s.fail_gen.load(std::memory_order_acquire) == gen &&
                        s.fail_page.load(std::memory_order_relaxed) == page && result.is_ok()) {
                        char msg[kMsgBytes + 1];
                        std::memcpy(msg, s.fail_msg, kMsgBytes);
                        msg[kMsgBytes] = '\0';
                        int code = s.fail_code.load(std::memory_order_relaxed);
                        // A rank writes Shortage or Backend; anything else is garbage.
                        const Code c = code == static_cast<int>(Code::Shortage) ? Code::Shortage : Code::Backend;
                        result = Status::make(c, what + who(r, pid) + ": " + msg);
                    }
                    break;
                }
                if (s.pid.load(std::memory_order_acquire) != pid || (waited && pid_gone(pid))) {
                    detach_locked(r, pid);
                    if (on && result.is_ok())
                        result = Status::make(Code::Shortage, what + who(r, pid) + " exited");
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
    // mu_: one operation at a time (held while it waits for the ranks).
    // map_mu_: ch_ for the readers that must not wait for an operation
    // (figures); unmapping takes both.
    mutable std::mutex mu_, map_mu_, err_mu_;
    std::string last_error_;
    Channel* ch_ = nullptr;
    int fd_ = -1;
    size_t bytes_ = 0;
    int64_t num_pages_ = 0;
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

std::unique_ptr<RankMemory> RankMemory::attach(int pid, int fd, int rank, const std::string& device,
                                               Status* status) {
    auto fail = [&](Code c, const std::string& m) {
        *status = Status::make(c, m);
        return std::unique_ptr<RankMemory>();
    };
    if (pid <= 0 || fd < 0) return fail(Code::Invalid, "invalid rank handle: pid " + std::to_string(pid) + ", fd " + std::to_string(fd));
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
    const int cfd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (cfd < 0) return fail(Code::Backend, errno_text("open " + path + " (the leader's mirror channel)", errno));
    struct stat st;
    if (fstat(cfd, &st) != 0 || static_cast<size_t>(st.st_size) < sizeof(Channel)) {
        ::close(cfd);
        return fail(Code::Invalid, path + " is not a kvpool mirror channel (too small)");
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
    if (ch->num_ranks < 1 || ch->num_ranks > kMaxRanks || ch->page_bytes <= 0 || ch->region_bytes <= 0 ||
        ch->region_bytes % ch->page_bytes != 0 || ch->num_pages != ch->region_bytes / ch->page_bytes ||
        Channel::bytes_for(ch->num_pages) > size)
        return bad("inconsistent channel header");
    if (rank >= ch->num_ranks)
        return bad("rank " + std::to_string(rank) + " out of range: the space has " + std::to_string(ch->num_ranks) + " ranks");
    if (ch->device_type != dtype)
        return bad(std::string("the space's ranks are on ") + (ch->device_type == 2 ? "cuda" : "cpu") + ", not " + device);
    const int64_t regions = ch->rank_regions[rank];
    if (regions <= 0 || regions > (INT64_MAX / 2) / ch->region_bytes) return bad("inconsistent rank regions");

    std::unique_ptr<RankMemory> rm(new RankMemory());
    rm->ch_ = ch;
    rm->map_bytes_ = size;
    rm->rank_ = rank;
    rm->pid_ = static_cast<int32_t>(getpid());
    rm->leader_pid_ = ch->leader_pid;
    rm->device_ = device;
    // Claim the slot: free, or left by a process that is gone.
    RankSlot& slot = ch->ranks[rank];
    int32_t expected = 0;
    if (!slot.pid.compare_exchange_strong(expected, rm->pid_)) {
        if (expected == rm->pid_ || !pid_gone(expected) || !slot.pid.compare_exchange_strong(expected, rm->pid_)) {
            rm->ch_ = nullptr;
            munmap(m, size);
            return fail(Code::Ledger, "rank " + std::to_string(rank) + " is attached already (pid " + std::to_string(expected) + ")");
        }
    }
    BackendConfig bc{regions, ch->region_bytes, ch->page_bytes};
    Status s;
    rm->backend_ = dtype == 1 ? make_cpu_backend(bc, &s) : make_cuda_backend(bc, dev, &s);
    if (!rm->backend_) {
        slot.pid.store(0, std::memory_order_release);
        rm->ch_ = nullptr;
        munmap(m, size);
        *status = s;
        return nullptr;
    }
    rm->have_.assign(static_cast<size_t>(ch->num_pages), 0);
    const uint32_t g = ch->gen.load(std::memory_order_acquire);
    s = rm->catch_up(g, true);
    if (!s.is_ok()) {
        rm->close();
        *status = s;
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

RankMemory::~RankMemory() { close(); }

void* RankMemory::base() const { return backend_ ? backend_->region_base(0) : nullptr; }
int64_t RankMemory::bytes() const { return ch_ ? ch_->rank_regions[rank_] * ch_->region_bytes : 0; }
int RankMemory::device_type() const { return backend_ ? backend_->device_type() : 1; }
int RankMemory::device_id() const { return backend_ ? backend_->device_id() : 0; }

// Bring every page to the map: commit what is wanted, release what is not.
// At attach (first) a failed commit fails the attach; later it is recorded
// for the leader, whose operation on that page then fails and rolls back.
Status RankMemory::catch_up(uint32_t gen, bool first) {
    auto* want = ch_->want();
    for (int64_t p = 0; p < ch_->num_pages; ++p) {
        const bool on = want[p].load(std::memory_order_relaxed) != 0;
        if (on == (have_[p] != 0)) continue;
        if (first && on) {
            Status s = backend_->commit(p);
            if (!s.is_ok()) return Status::make(s.code, "rank " + std::to_string(rank_) + " cannot commit page " +
                                                            std::to_string(p) + " the space holds: " + s.message);
            have_[p] = 1;
            ++commits_;
        } else {
            (void)gen;
            reconcile_page(p);
        }
    }
    return Status::ok();
}

void RankMemory::reconcile_page(int64_t p) {
    if (p < 0 || p >= ch_->num_pages) return;
    const bool on = ch_->want()[p].load(std::memory_order_relaxed) != 0;
    if (on == (have_[p] != 0)) return;
    Status s = on ? backend_->commit(p) : backend_->release(p);
    if (s.is_ok()) {
        have_[p] = on ? 1 : 0;
        (on ? commits_ : releases_).fetch_add(1, std::memory_order_relaxed);
        return;
    }
    ++failures_;
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
    if (!on) dirty_ = true;  // a release that failed is retried at the next wake-up
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
    while (!stop_.load(std::memory_order_acquire)) {
        if (ch_->closed.load(std::memory_order_acquire)) {
            release_all();  // the engine closed the space: so is its need for this memory
            break;
        }
        const uint32_t g = ch_->gen.load(std::memory_order_acquire);
        if (g != seen_ || dirty_) {
            const uint64_t c = ch_->change.load(std::memory_order_acquire);
            const bool one = !dirty_ && g == seen_ + 1 && static_cast<uint32_t>(c >> 32) == g;
            dirty_ = false;
            if (one) {
                if ((c & 0xffffffffULL) != 0xffffffffULL) reconcile_page(static_cast<int64_t>(c & 0xffffffffULL));
            } else {
                (void)catch_up(g, false);
            }
            seen_ = g;
            publish_figures();
            slot.ack.store(g, std::memory_order_release);
            futex(&slot.ack, FUTEX_WAKE, INT_MAX, nullptr);
            continue;
        }
        futex_wait_for(&ch_->gen, g, 0.2);  // 0.2 s: notice a leader that died without closing
        if (ch_->gen.load(std::memory_order_acquire) == g && pid_gone(leader_pid_)) {
            release_all();
            break;
        }
    }
}

void RankMemory::release_all() {
    if (!backend_) return;
    for (size_t p = 0; p < have_.size(); ++p) {
        if (!have_[p]) continue;
        if (backend_->release(static_cast<int64_t>(p)).is_ok()) {
            have_[p] = 0;
            ++releases_;
        }
    }
    publish_figures();
}

bool RankMemory::sync(double timeout_s) {
    if (!ch_ || closed()) return false;
    const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                             std::chrono::duration<double>(std::max(0.0, std::min(timeout_s, 1e6))));
    RankSlot& slot = ch_->ranks[rank_];
    for (;;) {
        const uint32_t a = slot.ack.load(std::memory_order_acquire);
        // After the leader closed: once this rank gave its memory back.
        if (ch_->closed.load(std::memory_order_acquire) ? thread_done_.load(std::memory_order_acquire)
                                                          : reached(a, ch_->gen.load(std::memory_order_acquire)))
            return true;
        const auto now = clock::now();
        if (now >= deadline) return false;
        futex_wait_for(&slot.ack, a, std::min(0.05, std::chrono::duration<double>(deadline - now).count()));
    }
}

RankStats RankMemory::stats() const {
    RankStats s;
    s.rank = rank_;
    s.device = device_;
    s.commits = commits_.load(std::memory_order_relaxed);
    s.releases = releases_.load(std::memory_order_relaxed);
    s.failures = failures_.load(std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> g(err_mu_);
        s.last_error = last_error_;
    }
    if (!ch_) return s;
    const RankSlot& slot = ch_->ranks[rank_];
    s.first_region = ch_->first_region[rank_];
    s.num_regions = ch_->rank_regions[rank_];
    s.region_bytes = ch_->region_bytes;
    s.page_bytes = ch_->page_bytes;
    s.num_pages = ch_->num_pages;
    s.committed_pages = slot.committed_pages.load(std::memory_order_relaxed);
    s.allocated_bytes = backend_ ? backend_->allocated_bytes() : 0;
    s.generation = slot.ack.load(std::memory_order_acquire);
    return s;
}

void RankMemory::close() {
    if (closed_.exchange(true)) return;
    stop_.store(true, std::memory_order_release);
    if (thread_.joinable()) {
        if (ch_) futex(&ch_->gen, FUTEX_WAKE, INT_MAX, nullptr);
        thread_.join();
    }
    if (ch_) {
        release_all();
        int32_t mine = pid_;
        ch_->ranks[rank_].pid.compare_exchange_strong(mine, 0);
        futex(&ch_->ranks[rank_].ack, FUTEX_WAKE, INT_MAX, nullptr);
        munmap(ch_, map_bytes_);
        ch_ = nullptr;
    }
    if (backend_) backend_->close();
}

}  // namespace kvpool
