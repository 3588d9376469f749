// Physical memory for one KV space. A backend knows regions and pages only:
// commit(page) makes the page's byte range resident in every region,
// release(page) gives it back. Both are all-or-nothing per page and report
// failures as Status values (errno text included), never by aborting.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "status.hpp"

namespace kvpool {

struct BackendConfig {
    int64_t num_regions;
    int64_t region_bytes;  // num_pages * page_bytes
    int64_t page_bytes;
};

class Backend {
public:
    virtual ~Backend() = default;
    virtual Status commit(int64_t page) = 0;
    virtual Status release(int64_t page) = 0;
    // Bytes really allocated behind the space (for audits), or -1 if unknown.
    virtual int64_t allocated_bytes() const = 0;
    virtual void* region_base(int64_t region) const = 0;
    // Give everything back and make the address range inert. Idempotent.
    virtual void close() = 0;
    virtual int device_type() const = 0;  // DLPack device type
    virtual int device_id() const { return 0; }
    // A file descriptor another process may map to see the same memory
    // (the CPU memfd), or -1 when the backend has none.
    virtual int share_fd() const { return -1; }
    // A mirrored space's channel (mirror.hpp), which each rank's process
    // attaches to; -1 for a backend that holds its own memory.
    virtual int mirror_fd() const { return -1; }
    // The channel's random identity, which a rank's handle must carry.
    virtual uint64_t mirror_nonce() const { return 0; }
    // For a copy inherited across fork(): make this process's view of the
    // range inert without giving anything back (never punches holes, never
    // calls the driver: the memory is the parent's). After it, commit and
    // release return Closed and destruction frees nothing. Idempotent.
    virtual void abandon() = 0;
    // How this backend commits (for stats() / the log), e.g. the CUDA
    // backend's choice of one allocation per region or offset slices.
    virtual std::string describe() const { return ""; }
    // The last failure that did not fail its operation (a release that went
    // through but could not put the zero page back, a handle that could not
    // be freed and is held until close): "" when none.
    virtual std::string last_error() const { return ""; }
};

// Smallest commit granularity the CPU backend accepts (the base page size).
int64_t cpu_granularity();

// Creates the CPU backend; on failure returns nullptr and fills *status.
std::unique_ptr<Backend> make_cpu_backend(const BackendConfig& cfg, Status* status);

// The CUDA backend (driver loaded at run time); nullptr + *status on failure.
std::unique_ptr<Backend> make_cuda_backend(const BackendConfig& cfg, int device, Status* status);
// Why CUDA cannot be used here ("" when it can); loads the driver on first call.
std::string cuda_unavailable_reason();
// Free and total bytes of a CUDA device (cuMemGetInfo).
Status cuda_mem_info(int device, int64_t* free_bytes, int64_t* total_bytes);

}  // namespace kvpool
