// CPU backend: one memfd per KV space, laid out exactly like the virtual
// regions and mapped once (MAP_SHARED) over a reserved, aligned range.
//
//   memfd / VA:  [ region 0: page 0 | page 1 | ... ][ region 1: page 0 | ... ] ...
//
// One mapping whatever the page count: Linux caps a process at ~65 530
// mappings, so per-page mmaps would not scale. Commit = fallocate the page's
// range in every region (shmem pages are allocated and zeroed at once);
// release = FALLOC_FL_PUNCH_HOLE, which returns the memory to the machine so
// a later commit reads zeros (DESIGN.md invariant 6).
//
// Caveat: touching a hole of a shared memfd mapping silently allocates it.
// The audit (allocated_bytes via st_blocks) is how tests catch that.
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "backend.hpp"

namespace kvpool {
namespace {

// ENOSPC/ENOMEM from tmpfs mean "no memory now": an expected shortage.
Code code_for_errno(int err) {
    return (err == ENOSPC || err == ENOMEM) ? Code::Shortage : Code::Backend;
}

constexpr size_t kAlign = 2u << 20;  // 2 MiB: lets THP back the range if enabled

class CpuBackend final : public Backend {
public:
    CpuBackend(const BackendConfig& cfg) : cfg_(cfg) {}
    ~CpuBackend() override {
        close();
        if (base_ != nullptr) munmap(base_, total_bytes());
    }

    Status open() {
        fd_ = memfd_create("kvpool-space", MFD_CLOEXEC);
        if (fd_ < 0) return Status::make(Code::Backend, errno_text("memfd_create", errno));
        if (ftruncate(fd_, static_cast<off_t>(total_bytes())) != 0)
            return fail_open(errno_text("ftruncate", errno));
        // Reserve an aligned range first, then map the file over it in one go.
        const size_t span = total_bytes() + kAlign;
        void* raw = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (raw == MAP_FAILED) return fail_open(errno_text("mmap(reserve)", errno));
        auto start = reinterpret_cast<uintptr_t>(raw);
        uintptr_t aligned = (start + kAlign - 1) & ~(uintptr_t)(kAlign - 1);
        if (aligned > start) munmap(raw, aligned - start);
        const uintptr_t end = start + span, aligned_end = aligned + total_bytes();
        if (end > aligned_end) munmap(reinterpret_cast<void*>(aligned_end), end - aligned_end);
        void* m = mmap(reinterpret_cast<void*>(aligned), total_bytes(), PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_FIXED, fd_, 0);
        if (m == MAP_FAILED) {
            int err = errno;
            munmap(reinterpret_cast<void*>(aligned), total_bytes());
            return fail_open(errno_text("mmap(memfd)", err));
        }
        base_ = m;
        return Status::ok();
    }

    Status commit(int64_t page) override {
        if (fd_ < 0) return Status::make(Code::Closed, "space is closed");
        for (int64_t r = 0; r < cfg_.num_regions; ++r) {
            if (fallocate(fd_, 0, offset(r, page), cfg_.page_bytes) != 0) {
                const int err = errno;
                // All-or-nothing per page: give back the regions done so far.
                for (int64_t q = 0; q < r; ++q) punch(q, page);
                return Status::make(code_for_errno(err),
                                    errno_text("fallocate(page " + std::to_string(page) + ")", err));
            }
        }
        return Status::ok();
    }

    Status release(int64_t page) override {
        if (fd_ < 0) return Status::make(Code::Closed, "space is closed");
        for (int64_t r = 0; r < cfg_.num_regions; ++r) {
            if (punch(r, page) != 0) {
                const int err = errno;
                return Status::make(Code::Backend,
                                    errno_text("punch-hole(page " + std::to_string(page) + ")", err));
            }
        }
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

    void close() override {
        if (fd_ < 0) return;
        // Give every byte back, then swap the shared mapping for an inert,
        // read-only anonymous one: views that outlive the space read zeros and
        // fault on write instead of silently re-allocating memfd pages.
        fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(total_bytes()));
        if (base_ != nullptr &&
            mmap(base_, total_bytes(), PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) ==
                MAP_FAILED) {
            // Could not swap in the inert mapping: unmap instead, so no write
            // can ever reach the memfd again (stale views then fault).
            munmap(base_, total_bytes());
            base_ = nullptr;
        }
        ::close(fd_);
        fd_ = -1;
    }

    int device_type() const override { return 1; /* kDLCPU */ }

private:
    size_t total_bytes() const { return static_cast<size_t>(cfg_.num_regions * cfg_.region_bytes); }
    off_t offset(int64_t region, int64_t page) const {
        return static_cast<off_t>(region * cfg_.region_bytes + page * cfg_.page_bytes);
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
    int fd_ = -1;
    void* base_ = nullptr;
};

}  // namespace

int64_t cpu_granularity() { return static_cast<int64_t>(sysconf(_SC_PAGESIZE)); }

std::unique_ptr<Backend> make_cpu_backend(const BackendConfig& cfg, Status* status) {
    auto b = std::make_unique<CpuBackend>(cfg);
    *status = b->open();
    if (!status->is_ok()) return nullptr;
    return b;
}

}  // namespace kvpool
