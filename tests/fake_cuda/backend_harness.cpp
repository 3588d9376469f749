// Drives a Backend directly, below the bindings, for what Python cannot reach
// through kvpool._native: Backend::abandon() in a forked child, and the
// CPU backend's commit/release cost beside the raw syscalls of the old design
// (one shared mapping, fallocate / punch-hole) in the same run.
//
//   backend_harness cpu-fork      child abandons its copy; parent's memory intact
//   backend_harness cuda-fork     same over the (fake) driver: the child makes no driver call
//   backend_harness bench-cpu N   commit/release per page, new vs old design (JSON)
//   backend_harness cuda-calls    driver calls per open / commit / release / close (fake driver)
//
// Exit status 0 and a last line "ok" (or the JSON) on success; a message on
// stderr and status 1 otherwise. Built by tests/test_memory.py with the
// native sources (no Python, no nanobind).
#include <dlfcn.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backend.hpp"

using kvpool::Backend;
using kvpool::BackendConfig;
using kvpool::Status;

namespace {

int die(const std::string& msg) {
    std::fprintf(stderr, "harness: %s\n", msg.c_str());
    return 1;
}

double now_us() {
    using namespace std::chrono;
    return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

bool filled(const void* p, size_t n, unsigned char v) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i)
        if (b[i] != v) return false;
    return true;
}

int cpu_fork() {
    const BackendConfig cfg{2, 4 * 65536, 65536};
    Status st;
    auto b = kvpool::make_cpu_backend(cfg, &st);
    if (!b) return die(st.message);
    if (!b->commit(0).is_ok() || !b->commit(1).is_ok()) return die("commit failed");
    char* r0 = static_cast<char*>(b->region_base(0));
    char* r1 = static_cast<char*>(b->region_base(1));
    std::memset(r0, 0x11, 65536);
    std::memset(r1 + 65536, 0x22, 65536);
    const int64_t before = b->allocated_bytes();
    const pid_t pid = fork();
    if (pid < 0) return die("fork failed");
    if (pid == 0) {
        // The child's copy: drop it the way a forked KVSpace must.
        b->abandon();
        if (!filled(r0, 4096, 0)) _exit(2);  // inert: reads zeros in this process
        if (b->commit(2).code != kvpool::Code::Closed) _exit(3);
        b.reset();  // destruction after abandon frees nothing either
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        return die("child failed, status " + std::to_string(status));
    if (!filled(r0, 65536, 0x11) || !filled(r1 + 65536, 65536, 0x22)) return die("parent's data changed");
    if (b->allocated_bytes() != before || before != 2 * 2 * 65536)
        return die("parent's memory changed: " + std::to_string(b->allocated_bytes()) + " of " + std::to_string(before));
    if (!b->release(0).is_ok()) return die("parent cannot release");
    std::puts("ok");
    return 0;
}

int cuda_fork() {
    const char* path = std::getenv("KVPOOL_LIBCUDA");
    if (!path) return die("KVPOOL_LIBCUDA is not set");
    const BackendConfig cfg{2, 4 * 16384, 16384};
    Status st;
    auto b = kvpool::make_cuda_backend(cfg, 0, &st);
    if (!b) return die(st.message);
    if (!b->commit(0).is_ok()) return die("commit failed");
    void* lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    auto calls = lib ? reinterpret_cast<long (*)(const char*)>(dlsym(lib, "fake_cuda_calls")) : nullptr;
    if (!calls) return die("not the fake driver");
    const pid_t pid = fork();
    if (pid < 0) return die("fork failed");
    if (pid == 0) {
        const long before = calls("");
        b->abandon();
        if (b->commit(1).code != kvpool::Code::Closed) _exit(3);
        b.reset();
        _exit(calls("") == before ? 0 : 4);  // not one driver call after fork
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        return die("child failed, status " + std::to_string(status));
    if (b->allocated_bytes() != 2 * 16384) return die("parent's books changed");
    if (!b->release(0).is_ok()) return die("parent cannot release");
    std::puts("ok");
    return 0;
}

// Per page: R regions of P bytes. New design = the backend (fallocate + map +
// prefault; release = map anonymous back + punch). Old design = one shared
// mapping of the memfd, fallocate per region, punch per region; its first
// writes then fault the page in, timed separately ("touch").
int bench_cpu(int n) {
    const int64_t P = 2 << 20, R = 4;
    const BackendConfig cfg{R, n * P, P};
    Status st;
    auto b = kvpool::make_cpu_backend(cfg, &st);
    if (!b) return die(st.message);
    double t0 = now_us();
    for (int p = 0; p < n; ++p)
        if (!b->commit(p).is_ok()) return die("commit failed");
    double t1 = now_us();
    for (int p = 0; p < n; ++p)
        for (int64_t r = 0; r < R; ++r)
            std::memset(static_cast<char*>(b->region_base(r)) + p * P, 1, static_cast<size_t>(P));
    double t2 = now_us();
    for (int p = 0; p < n; ++p)
        if (!b->release(p).is_ok()) return die("release failed");
    double t3 = now_us();
    const std::string mode = b->describe();
    b.reset();

    const int fd = memfd_create("bench-old", MFD_CLOEXEC);
    const size_t total = static_cast<size_t>(R * n * P);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(total)) != 0) return die("memfd");
    char* m = static_cast<char*>(mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    if (m == MAP_FAILED) return die("mmap");
    auto off = [&](int64_t r, int p) { return static_cast<off_t>(r * n * P + p * P); };
    double u0 = now_us();
    for (int p = 0; p < n; ++p)
        for (int64_t r = 0; r < R; ++r)
            if (fallocate(fd, 0, off(r, p), P) != 0) return die("fallocate");
    double u1 = now_us();
    for (int p = 0; p < n; ++p)
        for (int64_t r = 0; r < R; ++r) std::memset(m + off(r, p), 1, static_cast<size_t>(P));
    double u2 = now_us();
    for (int p = 0; p < n; ++p)
        for (int64_t r = 0; r < R; ++r)
            if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off(r, p), P) != 0) return die("punch");
    double u3 = now_us();
    munmap(m, total);
    close(fd);
    std::printf(
        "{\"pages\": %d, \"regions\": %lld, \"page_bytes\": %lld, \"backend\": \"%s\",\n"
        " \"new_commit_us\": %.1f, \"new_first_write_us\": %.1f, \"new_release_us\": %.1f,\n"
        " \"old_commit_us\": %.1f, \"old_first_write_us\": %.1f, \"old_release_us\": %.1f}\n",
        n, static_cast<long long>(R), static_cast<long long>(P), mode.c_str(), (t1 - t0) / n, (t2 - t1) / n,
        (t3 - t2) / n, (u1 - u0) / n, (u2 - u1) / n, (u3 - u2) / n);
    return 0;
}

// Driver calls per operation, counted by the fake: R = 16 regions, 64 pages.
int cuda_calls() {
    const char* path = std::getenv("KVPOOL_LIBCUDA");
    void* lib = path ? dlopen(path, RTLD_NOW) : nullptr;
    auto calls = lib ? reinterpret_cast<long (*)(const char*)>(dlsym(lib, "fake_cuda_calls")) : nullptr;
    if (!calls) return die("KVPOOL_LIBCUDA must name the fake driver");
    const int64_t P = 16384, R = 16, pages = 64, n = 8;
    const BackendConfig cfg{R, pages * P, P};
    long c0 = calls("");
    Status st;
    auto b = kvpool::make_cuda_backend(cfg, 0, &st);
    if (!b) return die(st.message);
    long c1 = calls("");
    for (int p = 0; p < n; ++p)
        if (!b->commit(p).is_ok()) return die("commit failed");
    long c2 = calls("");
    for (int p = 0; p < n; ++p)
        if (!b->release(p).is_ok()) return die("release failed");
    long c3 = calls("");
    b.reset();
    long c4 = calls("");
    std::printf("{\"regions\": %lld, \"pages\": %lld, \"open\": %ld, \"commit_per_page\": %.1f, "
                "\"release_per_page\": %.1f, \"close\": %ld}\n",
                static_cast<long long>(R), static_cast<long long>(pages), c1 - c0, double(c2 - c1) / n,
                double(c3 - c2) / n, c4 - c3);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "cpu-fork") return cpu_fork();
    if (cmd == "cuda-fork") return cuda_fork();
    if (cmd == "cuda-calls") return cuda_calls();
    if (cmd == "bench-cpu") return bench_cpu(argc > 2 ? std::atoi(argv[2]) : 64);
    return die("usage: backend_harness cpu-fork | cuda-fork | bench-cpu [pages]");
}
