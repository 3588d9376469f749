// Status values: every failure of the native core is returned, never thrown
// across the C ABI and never abort()ed. The Python layer maps codes to the
// kvpool.errors hierarchy.
#pragma once
#include <cstring>
#include <string>
#include <utility>

namespace kvpool {

enum class Code : int {
    Ok = 0,
    Shortage = 1,  // expected: not enough blocks/pages/memory right now
    Invalid = 2,   // caller misuse (bad ids, bad arguments)
    Backend = 3,   // a syscall/driver failure that is not a shortage
    Closed = 4,    // the space was closed
    Ledger = 5,    // the pool refused a tenant (duplicate name, no free slot), or is not ours
    Unsatisfiable = 6,  // a request larger than the tenant can ever hold: refused, never queued
    // Internal, never crosses to Python: a non-blocking call (the GIL held)
    // that would have to wait (the space mutex, a page syscall, a page in
    // flight, reaping) returns this before changing anything; the binding
    // retries it blocking with the GIL released.
    WouldBlock = 7,
    // Internal, never crosses to Python: Space::acquire's caller asked it to
    // stop waiting (the binding's signal check raised; the Python error is
    // set and the binding rethrows it).
    Interrupted = 8,
};

struct Status {
    Code code = Code::Ok;
    std::string message;

    static Status ok() { return {}; }
    static Status make(Code c, std::string m) { return Status{c, std::move(m)}; }
    bool is_ok() const { return code == Code::Ok; }
};

// "what: <strerror> (errno N)" for a failed syscall.
inline std::string errno_text(const std::string& what, int err) {
    char buf[256];
    // GNU strerror_r returns a pointer that may or may not be buf.
    const char* msg = strerror_r(err, buf, sizeof(buf));
    return what + ": " + msg + " (errno " + std::to_string(err) + ")";
}

}  // namespace kvpool
