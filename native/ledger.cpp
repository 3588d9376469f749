#include "ledger.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

namespace kvpool {
namespace {

long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const struct timespec* ts) {
    // The generation word lives in MAP_SHARED memory: use the shared futex ops.
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

bool pid_alive(int32_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

}  // namespace

bool valid_pool_name(const std::string& name) {
    if (name.empty() || name.size() > 64) return false;
    auto alnum = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); };
    if (!alnum(name[0])) return false;
    for (char c : name)
        if (!alnum(c) && c != '.' && c != '_' && c != '-') return false;
    return true;
}

namespace {
// State letter and start time of a process from /proc/<pid>/stat ('?' and 0
// when it cannot be read).
std::pair<char, uint64_t> process_stat(int32_t pid) {
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    FILE* f = std::fopen(path, "r");
    if (!f) return {'?', 0};
    char buf[1024];
    size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[n] = 0;
    // Field 2 (comm) may contain spaces and parentheses: skip to the last ')'.
    const char* p = std::strrchr(buf, ')');
    if (!p || p[1] != ' ') return {'?', 0};
    const char state = p[2];
    int field = 2;
    for (++p; *p && field < 22; ++p)
        if (*p == ' ') ++field;
    return {state, std::strtoull(p, nullptr, 10)};
}
}  // namespace

uint64_t process_start_time(int32_t pid) { return process_stat(pid).second; }

std::shared_ptr<Ledger> Ledger::open(const std::string& name, int64_t capacity, bool create, Status* status) {
    if (!valid_pool_name(name)) {
        *status = Status::make(Code::Invalid, "bad pool name '" + name + "'");
        return nullptr;
    }
    const std::string shm = "/kvpool-" + name;
    bool creator = false;
    int fd = -1;
    if (create) {
        fd = shm_open(shm.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd >= 0) creator = true;
        else if (errno != EEXIST) {
            *status = Status::make(Code::Backend, errno_text("shm_open(" + shm + ")", errno));
            return nullptr;
        }
    }
    if (fd < 0) {
        fd = shm_open(shm.c_str(), O_RDWR | O_CLOEXEC, 0);
        if (fd < 0) {
            const int err = errno;
            *status = Status::make(err == ENOENT ? Code::Closed : Code::Backend,
                                   err == ENOENT ? "pool '" + name + "' does not exist"
                                                 : errno_text("shm_open(" + shm + ")", err));
            return nullptr;
        }
    }
    const size_t size = sizeof(LedgerHeader);
    if (creator) {
        // shm_open honours the umask: make sure the segment is owner-only.
        fchmod(fd, 0600);
        if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
            const int err = errno;
            ::close(fd);
            shm_unlink(shm.c_str());
            *status = Status::make(Code::Backend, errno_text("ftruncate(" + shm + ")", err));
            return nullptr;
        }
    } else {
        // Wait briefly for a concurrent creator to size and initialize it.
        struct stat st;
        for (int i = 0; i < 200; ++i) {
            if (fstat(fd, &st) == 0 && st.st_size >= static_cast<off_t>(sizeof(uint64_t) * 2)) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        if (fstat(fd, &st) != 0 || st.st_size != static_cast<off_t>(size)) {
            ::close(fd);
            *status = Status::make(Code::Invalid, "pool '" + name + "' has a ledger of another layout (" +
                                                      std::to_string(st.st_size) + " bytes, expected " +
                                                      std::to_string(size) + "); remove /dev/shm" + shm);
            return nullptr;
        }
    }
    void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int map_err = errno;
    ::close(fd);
    if (m == MAP_FAILED) {
        *status = Status::make(Code::Backend, errno_text("mmap(" + shm + ")", map_err));
        return nullptr;
    }
    std::shared_ptr<Ledger> l(new Ledger());
    l->name_ = name;
    l->hdr_ = static_cast<LedgerHeader*>(m);
    LedgerHeader* h = l->hdr_;
    if (creator) {
        pthread_mutexattr_t a;
        pthread_mutexattr_init(&a);
        pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&h->mutex, &a);
        pthread_mutexattr_destroy(&a);
        h->version = kLedgerVersion;
        h->header_bytes = static_cast<uint32_t>(size);
        h->capacity = capacity;
        h->committed_total.store(0);
        h->generation.store(0);
        for (auto& t : h->tenants) t.pid.store(0);
        h->magic.store(kLedgerMagic, std::memory_order_release);
    } else {
        for (int i = 0; i < 200 && h->magic.load(std::memory_order_acquire) == 0; ++i)
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        const uint64_t magic = h->magic.load(std::memory_order_acquire);
        if (magic != kLedgerMagic || h->version != kLedgerVersion || h->header_bytes != size) {
            *status = Status::make(Code::Invalid,
                                   "pool '" + name + "' has a ledger of another layout version (magic " +
                                       std::to_string(magic) + ", version " + std::to_string(h->version) +
                                       ", this build reads version " + std::to_string(kLedgerVersion) +
                                       "); remove /dev/shm" + shm + " once no engine uses it");
            return nullptr;  // the destructor unmaps
        }
    }
    *status = Status::ok();
    return l;
}

Ledger::~Ledger() {
    if (hdr_) munmap(hdr_, sizeof(LedgerHeader));
}

Status Ledger::lock() {
    const int r = pthread_mutex_lock(&hdr_->mutex);
    if (r == EOWNERDEAD) {
        // The previous holder died inside the critical section, possibly
        // between the slot's store and the total's: reap it, then recount
        // the total from the live slots (each slot store is single).
        pthread_mutex_consistent(&hdr_->mutex);
        reap_locked(true);
        recount_locked();
        return Status::ok();
    }
    if (r != 0) return Status::make(Code::Backend, errno_text("pthread_mutex_lock(ledger)", r));
    return Status::ok();
}

void Ledger::unlock() { pthread_mutex_unlock(&hdr_->mutex); }

void Ledger::recount_locked() {
    int64_t total = 0;
    for (const auto& t : hdr_->tenants)
        if (t.pid.load(std::memory_order_acquire) != 0) total += t.committed.load();
    hdr_->committed_total.store(total);
}

void Ledger::bump_generation() {
    hdr_->generation.fetch_add(1, std::memory_order_acq_rel);
    futex(&hdr_->generation, FUTEX_WAKE, INT32_MAX, nullptr);
}

int Ledger::reap_locked(bool check_start_time) {
    int reaped = 0;
    for (auto& t : hdr_->tenants) {
        const int32_t pid = t.pid.load(std::memory_order_acquire);
        if (pid == 0) continue;
        bool dead = !pid_alive(pid);
        if (!dead) {
            // A killed process stays a zombie until its parent waits for it,
            // but its memory is already gone: zombies are dead tenants too.
            const auto [state, start] = process_stat(pid);
            dead = state == 'Z' || state == 'X' ||
                   (check_start_time && t.start_time != 0 && start != 0 && start != t.start_time);
        }
        if (!dead) continue;
        hdr_->committed_total.fetch_sub(t.committed.load());
        t.committed.store(0);
        t.pid.store(0, std::memory_order_release);
        ++reaped;
    }
    if (reaped) bump_generation();
    return reaped;
}

int Ledger::reap(bool check_start_time) {
    if (!lock().is_ok()) return 0;
    const int r = reap_locked(check_start_time);
    unlock();
    return r;
}

Status Ledger::register_tenant(const std::string& name, int64_t limit_bytes, int* slot) {
    Status s = lock();
    if (!s.is_ok()) return s;
    reap_locked(true);
    const int32_t me = static_cast<int32_t>(getpid());
    for (const auto& t : hdr_->tenants) {
        if (t.pid.load() != 0 && name == t.name) {
            unlock();
            return Status::make(Code::Invalid, "pool '" + name_ + "' already has a live tenant named '" + name + "'");
        }
    }
    for (int i = 0; i < kMaxTenants; ++i) {
        TenantSlot& t = hdr_->tenants[i];
        if (t.pid.load() != 0) continue;
        t.start_time = process_start_time(me);
        std::memset(t.name, 0, sizeof(t.name));
        std::strncpy(t.name, name.c_str(), sizeof(t.name) - 1);
        t.committed.store(0);
        t.limit.store(limit_bytes < 0 ? -1 : limit_bytes);
        t.limit_revision.store(0);
        t.limit_state.store(0);
        t.waiting.store(0);
        t.reserve_pages.store(0);
        t.pid.store(me, std::memory_order_release);
        *slot = i;
        unlock();
        return Status::ok();
    }
    unlock();
    return Status::make(Code::Shortage, "pool '" + name_ + "' has no free tenant slot (max " +
                                            std::to_string(kMaxTenants) + ")");
}

void Ledger::unregister_tenant(int slot) {
    if (!lock().is_ok()) return;
    TenantSlot& t = hdr_->tenants[slot];
    if (t.pid.load() == static_cast<int32_t>(getpid())) {
        hdr_->committed_total.fetch_sub(t.committed.load());
        t.committed.store(0);
        t.pid.store(0, std::memory_order_release);
        bump_generation();
    }
    unlock();
}

Status Ledger::claim(int slot, int64_t bytes) {
    Status s = lock();
    if (!s.is_ok()) return s;
    TenantSlot& t = hdr_->tenants[slot];
    auto fits = [&] {
        const int64_t lim = t.limit.load();
        return hdr_->committed_total.load() + bytes <= hdr_->capacity &&
               (lim < 0 || t.committed.load() + bytes <= lim);
    };
    if (!fits() && (reap_locked(true) == 0 || !fits())) {  // a dead tenant may have held the room
        const int64_t room_pool = hdr_->capacity - hdr_->committed_total.load();
        const int64_t lim = t.limit.load();
        std::string why = "pool '" + name_ + "' has " + std::to_string(room_pool) + " bytes free for a claim of " +
                          std::to_string(bytes);
        if (lim >= 0)
            why += " (tenant limit " + std::to_string(lim) + ", committed " + std::to_string(t.committed.load()) + ")";
        unlock();
        return Status::make(Code::Shortage, why);
    }
    t.committed.fetch_add(bytes);
    hdr_->committed_total.fetch_add(bytes);
    unlock();
    return Status::ok();
}

void Ledger::release(int slot, int64_t bytes) {
    if (bytes <= 0 || !lock().is_ok()) return;
    TenantSlot& t = hdr_->tenants[slot];
    t.committed.fetch_sub(bytes);
    if (crash_mid_release_) raise(SIGKILL);  // test hook: die between the two stores
    hdr_->committed_total.fetch_sub(bytes);
    bump_generation();  // wake waiters in every process: budget came back
    unlock();
}

int64_t Ledger::room(int slot) const {
    const TenantSlot& t = hdr_->tenants[slot];
    int64_t r = hdr_->capacity - hdr_->committed_total.load(std::memory_order_acquire);
    const int64_t lim = t.limit.load(std::memory_order_acquire);
    if (lim >= 0) r = std::min(r, lim - t.committed.load(std::memory_order_acquire));
    return std::max<int64_t>(0, r);
}

int64_t Ledger::pool_room() const {
    return std::max<int64_t>(0, hdr_->capacity - hdr_->committed_total.load(std::memory_order_acquire));
}

Status Ledger::set_limit(int slot, int64_t bytes, int64_t revision, LimitResult* result, int32_t verdict) {
    Status s = lock();
    if (!s.is_ok()) return s;
    TenantSlot& t = hdr_->tenants[slot];
    const int64_t cur = t.limit_revision.load();
    if (revision < cur) *result = LimitResult::Stale;
    else if (revision == cur) *result = t.limit.load() == bytes ? LimitResult::Same : LimitResult::Conflict;
    else {
        t.limit.store(bytes);
        t.limit_revision.store(revision);
        if (verdict < 0) verdict = bytes >= 0 && t.committed.load() > bytes ? 1 : 0;
        t.limit_state.store(verdict);
        bump_generation();
        *result = LimitResult::Applied;
    }
    unlock();
    return Status::ok();
}

Status Ledger::set_limit_by_name(const std::string& tenant, int64_t bytes, int64_t revision, LimitResult* result) {
    int slot = -1;
    {
        Status s = lock();
        if (!s.is_ok()) return s;
        reap_locked(true);
        for (int i = 0; i < kMaxTenants; ++i)
            if (hdr_->tenants[i].pid.load() != 0 && tenant == hdr_->tenants[i].name) slot = i;
        unlock();
    }
    if (slot < 0) return Status::make(Code::Invalid, "pool '" + name_ + "' has no tenant '" + tenant + "'");
    if (revision < 0) revision = limit_revision(slot) + 1;
    return set_limit(slot, bytes, revision, result);
}

void Ledger::report(int slot, int32_t limit_state, int32_t waiting, int64_t reserve_pages) {
    TenantSlot& t = hdr_->tenants[slot];
    t.limit_state.store(limit_state);
    t.waiting.store(waiting);
    t.reserve_pages.store(reserve_pages);
}

std::vector<TenantInfo> Ledger::tenants() {
    std::vector<TenantInfo> out;
    if (!lock().is_ok()) return out;
    reap_locked(true);
    for (int i = 0; i < kMaxTenants; ++i) {
        const TenantSlot& t = hdr_->tenants[i];
        const int32_t pid = t.pid.load();
        if (pid == 0) continue;
        out.push_back({i, pid, std::string(t.name, strnlen(t.name, kNameBytes)), t.committed.load(),
                       t.limit.load(), t.limit_revision.load(), t.limit_state.load(), t.waiting.load(),
                       t.reserve_pages.load()});
    }
    unlock();
    return out;
}

void Ledger::wait_generation(uint32_t seen, double timeout_s) {
    struct timespec ts;
    ts.tv_sec = static_cast<time_t>(timeout_s);
    ts.tv_nsec = static_cast<long>((timeout_s - static_cast<double>(ts.tv_sec)) * 1e9);
    futex(&hdr_->generation, FUTEX_WAIT, seen, &ts);
}

}  // namespace kvpool
