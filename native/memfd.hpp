// One way to make a memory file another process may map: memfd_create, sized
// once, then sealed against any later change of size.
//
// Why sealed (round 3, memfd_unsealed.py): every same-user process can open
// /proc/<pid>/fd/<n> (vLLM's TP workers do, by design). Unsealed, one
// ftruncate(0) from such a process killed the engine with SIGBUS at its next
// touch of KV memory. F_SEAL_SHRINK | F_SEAL_GROW refuse every resize (and a
// fallocate past the end) with EPERM; F_SEAL_SEAL stops anyone adding
// F_SEAL_WRITE, which would make our own punch-hole releases fail. What seals
// cannot stop: fallocate *inside* the file by a process that opened it. That
// memory shows in the file's st_blocks, which the accounting audit compares
// with the page table.
#pragma once
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <string>

#include "status.hpp"

namespace kvpool {

// Sets *fd to a new memfd of `bytes` bytes (zero-filled, nothing allocated),
// sealed against resizing. On failure *fd is -1 and nothing is left open.
inline Status create_sealed_memfd(const char* name, int64_t bytes, int* fd) {
    *fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (*fd < 0) return Status::make(Code::Backend, errno_text("memfd_create", errno));
    std::string what;
    if (ftruncate(*fd, static_cast<off_t>(bytes)) != 0)
        what = "ftruncate";
    else if (fcntl(*fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        what = "fcntl(F_ADD_SEALS)";
    if (what.empty()) return Status::ok();
    const int err = errno;
    ::close(*fd);
    *fd = -1;
    return Status::make(Code::Backend, errno_text(what, err));
}

}  // namespace kvpool
