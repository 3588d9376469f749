// CPU backend: one memfd per KV space, laid out exactly like the virtual
// regions, behind one reserved, aligned address range.
//
//   memfd / VA:  [ region 0: page 0 | page 1 | ... ][ region 1: page 0 | ... ] ...
//   uncommitted slice (r, p):  private anonymous, read-only
//   committed slice (r, p):    the memfd's own range, MAP_SHARED | MAP_FIXED, read-write
//
// Why uncommitted pages are not simply holes of one shared mapping (issue 10,
// D6): touching a hole of a shared memfd mapping silently allocates it, so one
// read of an uncommitted block allocated 64 KiB and k.sum() over a view the
// whole virtual size, none of it in the books, and trim() gave none of it
// back. A read of private anonymous read-only memory maps the kernel's shared
// zero page instead: it reads zeros, allocates no memory (only page-table
// entries), and a stray write faults instead of aliasing (ARCHITECTURE.md
// invariant 9).
//
// Commit = fallocate the page's range in every region (shmem allocates and
// zeroes at once; ENOSPC/ENOMEM is a shortage), map it over the slice and
// prefault it (MADV_POPULATE_WRITE: the ~512 minor faults of a 2 MiB page are
// taken here, on the reserve thread, not by the engine's first write).
// Release = map the read-only anonymous range back over the slice, then
// FALLOC_FL_PUNCH_HOLE, which returns the memory to the machine, so a later
// commit reads zeros (invariant 6). Unmapping first means no access can
// re-allocate the range between the punch and the unmap.
//
// The mapping cap: Linux caps a process at vm.max_map_count (~65 530)
// mappings. Adjacent committed slices merge into one mapping (same file,
// contiguous offsets, since the file is laid out like the VA) and so do
// adjacent anonymous ones, so the count is the number of runs of alike
// slices along the VA, not the number of pages. It is modelled exactly here
// (runs_) and summed over every CPU space of the process; a commit that
// would take the sum past the budget (half of vm.max_map_count, or
// $KVPOOL_MAX_MAPPINGS, read when a space opens) is refused as a shortage
// naming the cap, before the kernel would refuse it (ENOMEM, or worse, a
// failed unmap inside a release). Releases may go past the budget: it is
// the headroom that keeps them from failing.
//
// fork() (issue 10, D6/D7): a child inherits every mapping, so a child that
// only read its inherited view of a page the parent has since released
// (punched) would allocate that page of the parent's memfd again, outside
// the books. A pthread_atfork child handler therefore turns every CPU space
// of the process inert in the child before fork() returns there: one
// read-only anonymous mapping over the whole range (stale views read zeros
// and fault on write, like after close), the memfd closed, the model reset.
// Why not MADV_DONTFORK on the shared slices instead: each commit maps a new
// slice and could only mark it after the mmap, so a fork in that window would
// still hand the child the mapping; and a child whose range is simply not
// mapped could see an unrelated mapping land there, which a later
// abandon()/destructor would then overwrite or unmap. The handler leaves the
// range reserved and ours. Every backend's mutex is taken in the prepare
// handler, so no commit or release is inside its model update at the fork
// and the child never inherits a held mutex.
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "backend.hpp"
#include "memfd.hpp"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels say EINVAL and we skip the prefault
#endif

namespace kvpool {
namespace {

// ENOSPC/ENOMEM from tmpfs mean "no memory now": an expected shortage.
Code code_for_errno(int err) {
    return (err == ENOSPC || err == ENOMEM) ? Code::Shortage : Code::Backend;
}

constexpr size_t kAlign = 2u << 20;  // 2 MiB: lets THP back the range if enabled

// Modelled mappings of every CPU space in this process (see the header).
std::atomic<int64_t> g_mappings{0};

int64_t mapping_budget() {
    const char* env = std::getenv("KVPOOL_MAX_MAPPINGS");
    if (env && *env) return std::strtoll(env, nullptr, 10);
    int64_t cap = 65530;
    if (FILE* f = std::fopen("/proc/sys/vm/max_map_count", "r")) {
        long long v = 0;
        if (std::fscanf(f, "%lld", &v) == 1 && v > 0) cap = v;
        std::fclose(f);
    }
    return cap / 2;
}

void* map_inert(void* at, size_t n) {
    return mmap(at, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
}

class CpuBackend;

// Every open CPU backend of the process, for the fork handlers (see the
// header). Lock order: g_registry_mu, then a backend's mu_.
std::mutex g_registry_mu;
std::vector<CpuBackend*> g_registry;
std::once_flag g_atfork_once;
void before_fork();
void after_fork_parent();
void after_fork_child();

class CpuBackend final : public Backend {
public:
    CpuBackend(const BackendConfig& cfg) : cfg_(cfg), npages_(cfg.region_bytes / cfg.page_bytes) {}
    ~CpuBackend() override {
        {
            std::lock_guard<std::mutex> lock(g_registry_mu);
            g_registry.erase(std::remove(g_registry.begin(), g_registry.end(), this), g_registry.end());
        }
        close();
        if (base_ != nullptr) munmap(base_, total_bytes());
        g_mappings.fetch_sub(runs_);
    }

    Status open() {
        budget_ = mapping_budget();
        // Sealed against resizing: a peer that opens it through /proc cannot
        // truncate our KV memory under us (memfd.hpp).
        if (Status st = create_sealed_memfd("kvpool-space", total_bytes(), &fd_); !st.is_ok()) return st;
        // Reserve an aligned, read-only anonymous range: the inert state of
        // every slice (reads see the zero page, writes fault).
        const size_t span = total_bytes() + kAlign;
        void* raw = mmap(nullptr, span, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (raw == MAP_FAILED) return fail_open(errno_text("mmap(reserve)", errno));
        auto start = reinterpret_cast<uintptr_t>(raw);
        uintptr_t aligned = (start + kAlign - 1) & ~(uintptr_t)(kAlign - 1);
        if (aligned > start) munmap(raw, aligned - start);
        const uintptr_t end = start + span, aligned_end = aligned + total_bytes();
        if (end > aligned_end) munmap(reinterpret_cast<void*>(aligned_end), end - aligned_end);
        base_ = reinterpret_cast<void*>(aligned);
        mapped_.assign(static_cast<size_t>(cfg_.num_regions * npages_), 0);
        runs_ = 1;
        g_mappings.fetch_add(runs_);
        std::call_once(g_atfork_once, [] { pthread_atfork(before_fork, after_fork_parent, after_fork_child); });
        std::lock_guard<std::mutex> lock(g_registry_mu);
        g_registry.push_back(this);
        return Status::ok();
    }

    // The fork handlers' halves (see the header). lock_for_fork/unlock_after_fork
    // bracket the fork in the parent; in the child, inherit() runs instead of
    // the unlock, with only the forking thread alive.
    void lock_for_fork() { mu_.lock(); }
    void unlock_after_fork() { mu_.unlock(); }
    void inherit() {
        // The child's view of the range becomes inert: the parent's memfd is
        // mapped nowhere in the child and the child holds no reference to it.
        // If the remap fails the range is left as it is; the fd is closed
        // regardless, so nothing more of the parent's memory can be reached.
        if (base_ != nullptr) map_inert(base_, total_bytes());
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
        std::fill(mapped_.begin(), mapped_.end(), 0);
        const int64_t now = base_ != nullptr ? 1 : 0;
        g_mappings.fetch_add(now - runs_);
        runs_ = now;
        mu_.unlock();
    }

    Status commit(int64_t page) override {
        if (fd_ < 0) return Status::make(Code::Closed, "space is closed");
        {
            std::lock_guard<std::mutex> lock(mu_);
            const int64_t delta = flip_locked(page, 1);
            if (delta > 0 && g_mappings.load() + delta > budget_) {
                flip_locked(page, 0);
                return Status::make(Code::Shortage,
                                    "committing page " + std::to_string(page) + " would take this process to " +
                                        std::to_string(g_mappings.load() + delta) +
                                        " memory mappings, past kvpool's budget of " + std::to_string(budget_) +
                                        " (half of vm.max_map_count, or $KVPOOL_MAX_MAPPINGS): free or trim pages "
                                        "so committed pages form longer runs, or raise vm.max_map_count");
            }
            g_mappings.fetch_add(delta);
        }
        for (int64_t r = 0; r < cfg_.num_regions; ++r) {
            std::string what;
            int err = 0;
            if (fallocate(fd_, 0, offset(r, page), cfg_.page_bytes) != 0) {
                err = errno;
                what = "fallocate";
            } else if (mmap(slice(r, page), page_len(), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_,
                            offset(r, page)) == MAP_FAILED) {
                err = errno;
                what = "mmap";
                punch(r, page);
            } else if (populate_ && madvise(slice(r, page), page_len(), MADV_POPULATE_WRITE) != 0 && errno == EINVAL) {
                populate_ = false;  // kernel older than 5.14: the first writes fault the page in instead
            }
            if (err != 0) {
                // All-or-nothing per page: give back the regions done so far.
                for (int64_t q = 0; q < r; ++q) {
                    map_inert(slice(q, page), page_len());
                    punch(q, page);
                }
                std::lock_guard<std::mutex> lock(mu_);
                g_mappings.fetch_add(flip_locked(page, 0));
                return Status::make(code_for_errno(err),
                                    errno_text(what + "(page " + std::to_string(page) + ")", err));
            }
        }
        return Status::ok();
    }

    Status release(int64_t page) override {
        if (fd_ < 0) return Status::make(Code::Closed, "space is closed");
        for (int64_t r = 0; r < cfg_.num_regions; ++r) {
            if (map_inert(slice(r, page), page_len()) == MAP_FAILED) {
                const int err = errno;
                // The page stays committed: put the memfd back where it was
                // taken away (its memory is still there).
                for (int64_t q = 0; q < r; ++q) map_file(q, page);
                return Status::make(Code::Backend,
                                    errno_text("mmap(release page " + std::to_string(page) + ")", err));
            }
        }
        for (int64_t r = 0; r < cfg_.num_regions; ++r) {
            if (punch(r, page) != 0) {
                const int err = errno;
                // Still committed: map it back (re-allocating what was
                // punched, so the audit matches the books).
                for (int64_t q = 0; q < cfg_.num_regions; ++q) {
                    if (q < r) fallocate(fd_, 0, offset(q, page), cfg_.page_bytes);
                    map_file(q, page);
                }
                return Status::make(Code::Backend,
                                    errno_text("punch-hole(page " + std::to_string(page) + ")", err));
            }
        }
        std::lock_guard<std::mutex> lock(mu_);
        g_mappings.fetch_add(flip_locked(page, 0));
        return Status::ok();
    }

    int64_t allocated_bytes() const override {
        if (fd_ < 0) return 0;
        struct stat st;
        if (fstat(fd_, &st) != 0) return -1;
        return static_cast<int64_t>(st.st_blocks) * 512;
    }

    int share_fd() const override { return fd_; }
    void* region_base(int64_t region) const override {
        return static_cast<char*>(base_) + region * cfg_.region_bytes;
    }
    std::string describe() const override {
        std::lock_guard<std::mutex> lock(mu_);
        return "cpu: memfd, " + std::to_string(runs_) + " mappings (" + std::to_string(g_mappings.load()) +
               " in this process, budget " + std::to_string(budget_) + ")" +
               (populate_ ? ", commits prefaulted" : "");
    }

    void close() override { drop(/*give_back=*/true); }
    void abandon() override { drop(/*give_back=*/false); }

    int device_type() const override { return 1; /* kDLCPU */ }

private:
    // Leaves the range inert: one read-only anonymous mapping over all of it,
    // so views that outlive the space read zeros and fault on write instead of
    // silently re-allocating memfd pages. give_back punches the whole file
    // first; a forked child (abandon) must not: the memory is its parent's.
    void drop(bool give_back) {
        if (fd_ < 0) return;
        if (give_back) fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(total_bytes()));
        if (base_ != nullptr && map_inert(base_, total_bytes()) == MAP_FAILED) {
            // Could not swap in the inert mapping: unmap instead, so no write
            // can ever reach the memfd again (stale views then fault).
            munmap(base_, total_bytes());
            base_ = nullptr;
        }
        ::close(fd_);
        fd_ = -1;
        std::lock_guard<std::mutex> lock(mu_);
        std::fill(mapped_.begin(), mapped_.end(), 0);
        const int64_t now = base_ != nullptr ? 1 : 0;
        g_mappings.fetch_add(now - runs_);
        runs_ = now;
    }

    // Sets every region's slice of `page` to `state` in the model and returns
    // the change in the number of mappings (runs of alike slices along the VA).
    int64_t flip_locked(int64_t page, uint8_t state) {
        const int64_t n = static_cast<int64_t>(mapped_.size()), before = runs_;
        for (int64_t r = 0; r < cfg_.num_regions; ++r) {
            const int64_t i = r * npages_ + page;
            if (mapped_[i] == state) continue;
            for (int64_t j : {i - 1, i + 1}) {
                if (j < 0 || j >= n) continue;
                runs_ += (mapped_[j] != state) - (mapped_[j] != mapped_[i]);
            }
            mapped_[i] = state;
        }
        return runs_ - before;
    }
    size_t total_bytes() const { return static_cast<size_t>(cfg_.num_regions * cfg_.region_bytes); }
    size_t page_len() const { return static_cast<size_t>(cfg_.page_bytes); }
    void* slice(int64_t region, int64_t page) const {
        return static_cast<char*>(base_) + region * cfg_.region_bytes + page * cfg_.page_bytes;
    }
    off_t offset(int64_t region, int64_t page) const {
        return static_cast<off_t>(region * cfg_.region_bytes + page * cfg_.page_bytes);
    }
    void map_file(int64_t region, int64_t page) {
        mmap(slice(region, page), page_len(), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_,
             offset(region, page));
    }
    int punch(int64_t region, int64_t page) {
        return fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset(region, page), cfg_.page_bytes);
    }
    Status fail_open(std::string msg) {
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
        return Status::make(Code::Backend, std::move(msg));
    }

    BackendConfig cfg_;
    int64_t npages_;
    int fd_ = -1;
    void* base_ = nullptr;
    std::atomic<bool> populate_{true};  // cleared once if the kernel lacks MADV_POPULATE_WRITE
    int64_t budget_ = 0;
    mutable std::mutex mu_;        // the mapping model: the reserve thread and inline commits race on it
    std::vector<uint8_t> mapped_;  // per slice, in VA order: 1 = the memfd is mapped there
    int64_t runs_ = 0;             // mappings of this space (runs of alike slices)
};

void before_fork() {
    g_registry_mu.lock();
    for (CpuBackend* b : g_registry) b->lock_for_fork();
}
void after_fork_parent() {
    for (CpuBackend* b : g_registry) b->unlock_after_fork();
    g_registry_mu.unlock();
}
void after_fork_child() {
    for (CpuBackend* b : g_registry) b->inherit();
    g_registry_mu.unlock();
}

}  // namespace

int64_t cpu_granularity() { return static_cast<int64_t>(sysconf(_SC_PAGESIZE)); }

std::unique_ptr<Backend> make_cpu_backend(const BackendConfig& cfg, Status* status) {
    auto b = std::make_unique<CpuBackend>(cfg);
    *status = b->open();
    if (!status->is_ok()) return nullptr;
    return b;
}

}  // namespace kvpool
