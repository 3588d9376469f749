// A mirrored space's rank: RankMemory, its own backend kept equal to the
// leader's page map by a sync thread (design: mirror.hpp).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "mirror_channel.hpp"

namespace kvpool {
using namespace mirror_detail;

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
