// The pool ledger's segment (ledger.hpp): opening and trusting it, the
// generation word and its futex, snapshots, and claims. Tenants joining,
// leaving and being reaped are in ledger_tenants.cpp; settings in
// ledger_settings.cpp.
#include "ledger.hpp"
#include "ledger_detail.hpp"
#include "sizes.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
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

constexpr int kClaimAttempts = 5;     // racing claims that saw each other retry this often

long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const struct timespec* ts) {
    // The generation word lives in MAP_SHARED memory: the shared futex ops.
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

}  // namespace

using ledger_detail::kSeq;
using ledger_detail::sanitized_name;

// ------------------------------------------------------------------ snapshot

int64_t LedgerSnapshot::claimed_total() const {
    int64_t total = 0;
    for (const auto& r : rows) total += r.claimed + r.pending;
    return total;
}

int64_t LedgerSnapshot::guarantee_of(const TenantRow& t) const {
    int64_t g = 0;
    if (t.guarantee >= 0) {
        g = std::min(t.guarantee, capacity);
    } else {
        int64_t explicit_sum = 0, n_default = 0;
        for (const auto& r : rows) {
            if (r.guarantee >= 0) explicit_sum += std::min(r.guarantee, capacity);
            else ++n_default;
        }
        g = std::max<int64_t>(0, capacity - explicit_sum) / std::max<int64_t>(1, n_default);
    }
    // Never more than the tenant may hold.
    return t.limit >= 0 ? std::min(g, t.limit) : g;
}

const TenantRow* LedgerSnapshot::find(int slot) const {
    for (const auto& r : rows)
        if (r.slot == slot) return &r;
    return nullptr;
}

// ---------------------------------------------------------------------- open

std::shared_ptr<Ledger> Ledger::open(const std::string& name, int64_t capacity, bool create, Status* status) {
    if (!valid_name(name)) {
        *status = Status::make(Code::Invalid, "bad pool name " + quoted_name(name));
        return nullptr;
    }
    if (create && capacity <= 0) {
        *status = Status::make(Code::Invalid, "pool capacity must be > 0 bytes, got " + std::to_string(capacity));
        return nullptr;
    }
    const std::string path = "/dev/shm/kvpool-" + name;
    const size_t size = sizeof(LedgerHeader);
    bool creator = false;
    int fd = -1;
    if (create) {
        // O_EXCL: the segment is ours only if we made it; O_NOFOLLOW: never
        // through a link someone else planted.
        fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd >= 0) creator = true;
        else if (errno != EEXIST) {
            *status = Status::make(Code::Backend, errno_text("open(" + path + ")", errno));
            return nullptr;
        }
    }
    if (fd < 0) {
        fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) {
            const int err = errno;
            *status = Status::make(err == ENOENT ? Code::Closed : Code::Ledger,
                                   err == ENOENT ? "pool '" + name + "' does not exist"
                                                 : errno_text("open(" + path + ")", err) +
                                                       (err == ELOOP ? " (a symbolic link: refused)" : ""));
            return nullptr;
        }
    }
    auto fail = [&](const std::string& why) {
        ::close(fd);
        if (creator) ::unlink(path.c_str());
        *status = Status::make(Code::Ledger, why);
        return std::shared_ptr<Ledger>();
    };
    if (creator) {
        // open() honours the umask: make sure the segment is exactly owner-only.
        if (fchmod(fd, 0600) != 0) return fail(errno_text("fchmod(" + path + ")", errno));
        if (ftruncate(fd, static_cast<off_t>(size)) != 0) return fail(errno_text("ftruncate(" + path + ")", errno));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) return fail(errno_text("fstat(" + path + ")", errno));
    // Trust only a segment this user made, that nobody else can write.
    if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 07777) != 0600) {
        char buf[160];
        std::snprintf(buf, sizeof(buf), " is owned by uid %u with mode %04o (need uid %u, mode 0600, a regular file)",
                      static_cast<unsigned>(st.st_uid), static_cast<unsigned>(st.st_mode & 07777),
                      static_cast<unsigned>(geteuid()));
        return fail("pool '" + name + "' is not ours: " + path + buf + "; refusing to join it");
    }
    if (!creator) {
        // A concurrent creator sizes the file right after creating it.
        for (int i = 0; i < 200 && st.st_size == 0; ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
            if (fstat(fd, &st) != 0) return fail(errno_text("fstat(" + path + ")", errno));
        }
        if (st.st_size != static_cast<off_t>(size))
            return fail("pool '" + name + "' has a ledger of another layout (" + std::to_string(st.st_size) +
                        " bytes, this build reads " + std::to_string(size) + "); remove " + path +
                        " once no engine of that build uses it (rm it: `kvpool pools --gc` removes only ledgers it can read)");
    }
    void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return fail(errno_text("mmap(" + path + ")", errno));
    std::shared_ptr<Ledger> l(new Ledger());
    l->fd_ = fd;  // the ledger owns it from here (slot locks, ledger.hpp); the destructor closes it
    fd = -1;
    l->name_ = name;
    l->hdr_ = static_cast<LedgerHeader*>(m);
    l->my_pidns_ = own_pid_namespace();
    LedgerHeader* h = l->hdr_;
    if (creator) {
        // ftruncate zero-filled every slot (pid 0: free).
        h->version = kLedgerVersion;
        h->header_bytes = static_cast<uint32_t>(size);
        h->capacity = capacity;
        h->magic.store(kLedgerMagic, std::memory_order_release);
    } else {
        for (int i = 0; i < 200 && h->magic.load(std::memory_order_acquire) == 0; ++i)
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        const uint64_t magic = h->magic.load(std::memory_order_acquire);
        if (magic != kLedgerMagic || h->version != kLedgerVersion || h->header_bytes != size || h->capacity <= 0) {
            *status = Status::make(Code::Ledger,
                                   "pool '" + name + "' has a ledger of another layout version (magic " +
                                       std::to_string(magic) + ", version " + std::to_string(h->version) +
                                       ", capacity " + std::to_string(h->capacity) + "; this build reads version " +
                                       std::to_string(kLedgerVersion) + "); remove " + path +
                                       " once no engine of that build uses it (rm it: `kvpool pools --gc` removes only ledgers it can read)");
            return nullptr;  // the destructor unmaps
        }
    }
    *status = Status::ok();
    return l;
}

Ledger::~Ledger() {
    if (hdr_) munmap(hdr_, sizeof(LedgerHeader));
    if (fd_ >= 0) ::close(fd_);
}

void Ledger::bump_generation() {
    hdr_->generation.fetch_add(1, std::memory_order_acq_rel);
    futex(&hdr_->generation, FUTEX_WAKE, INT32_MAX, nullptr);
}

void Ledger::wait_generation(uint32_t seen, double timeout_s) const {
    struct timespec ts;
    const struct timespec* tsp = nullptr;
    if (timeout_s >= 0) {
        ts.tv_sec = static_cast<time_t>(timeout_s);
        ts.tv_nsec = static_cast<long>((timeout_s - static_cast<double>(ts.tv_sec)) * 1e9);
        tsp = &ts;
    }
    futex(&hdr_->generation, FUTEX_WAIT, seen, tsp);
}

// ------------------------------------------------------------------ reading

LedgerSnapshot Ledger::snapshot(bool names) const {
    LedgerSnapshot s;
    s.capacity = hdr_->capacity;
    s.generation = generation();
    const uint32_t exit = hdr_->last_exit.load(kSeq);  // anything unknown (a hostile write) reads as None
    s.last_exit = exit == 1 ? LastExit::Left : exit == 2 ? LastExit::Died : LastExit::None;
    s.rows.reserve(8);
    for (int i = 0; i < kMaxTenants; ++i) {
        const TenantSlot& t = hdr_->tenants[i];
        const int32_t pid = t.pid.load(kSeq);
        if (pid <= 0 || t.live.load(kSeq) != 1) continue;
        TenantRow r;
        r.slot = i;
        r.pid = pid;
        r.visible = t.pidns.load(kSeq) == my_pidns_;
        if (names) r.name = sanitized_name(t.name, i);
        // Clamped to [0, capacity]: a corrupted or hostile row must not wrap a sum.
        r.claimed = std::clamp<int64_t>(t.claimed.load(kSeq), 0, s.capacity);
        r.pending = std::clamp<int64_t>(t.pending.load(kSeq), 0, s.capacity);
        r.want = std::clamp<int64_t>(t.want.load(kSeq), 0, s.capacity);
        r.wait_ticket = t.wait_ticket.load(kSeq);
        r.waiting = t.waiting.load(kSeq);
        r.limit_state = t.limit_state.load(kSeq);
        r.lending = t.lending.load(kSeq) == 1 ? 1 : 0;
        r.restoring = t.lending.load(kSeq) == 2 ? 1 : 0;
        r.reserve_pages = t.reserve_pages.load(kSeq);
        r.headroom = std::clamp<int64_t>(t.headroom.load(kSeq), 0, s.capacity);
        r.keep_free = std::clamp<int64_t>(t.keep_free.load(kSeq), 0, s.capacity);
        r.allocs = t.allocs.load(std::memory_order_relaxed);
        r.shortages = t.shortages.load(std::memory_order_relaxed);
        r.freeing = std::clamp<int64_t>(t.freeing.load(kSeq), 0, s.capacity);
        r.preempt_bytes = std::clamp<int64_t>(t.preempt_bytes.load(kSeq), 0, s.capacity);
        r.preempts = t.no_preempt.load(kSeq) != 1;  // anything else (a hostile write) reads as preempting
        r.preempt_asked = t.preempt_asked.load(std::memory_order_relaxed);
        r.preempted = t.preempted.load(std::memory_order_relaxed);
        r.recomputed_tokens = t.recomputed_tokens.load(std::memory_order_relaxed);
        r.reclaimed_completion = t.reclaimed_completion.load(std::memory_order_relaxed);
        r.reclaimed_preemption = t.reclaimed_preemption.load(std::memory_order_relaxed);
        r.reclaimed_eviction = t.reclaimed_eviction.load(std::memory_order_relaxed);
        // A writer stopped inside the seqlock: use what is there (a torn
        // setting misjudges one tenant's share; waiting forever is worse).
        if (!read_settings(i, &r.limit, &r.limit_revision, &r.guarantee, &r.guarantee_revision)) {
            r.limit = t.settings.limit.load();
            r.limit_revision = t.settings.limit_revision.load();
            r.guarantee = t.settings.guarantee.load();
            r.guarantee_revision = t.settings.guarantee_revision.load();
        }
        // The owner's verdict lags a limit another process just set (the
        // owner may be stopped): until it has judged this revision, readers
        // judge from the claimed bytes (one verdict for every reader).
        if (t.judged_revision.load(kSeq) != r.limit_revision)
            r.limit_state = r.limit >= 0 && r.claimed > r.limit ? 1 : 0;
        s.rows.push_back(std::move(r));
    }
    return s;
}

bool Ledger::anyone_waiting(int slot) const {
    for (int i = 0; i < kMaxTenants; ++i) {
        if (i == slot) continue;
        const TenantSlot& t = hdr_->tenants[i];
        if (t.pid.load(std::memory_order_acquire) > 0 &&
            (t.waiting.load(std::memory_order_acquire) > 0 || t.want.load(std::memory_order_acquire) > 0))
            return true;
    }
    return false;
}

// ------------------------------------------------------------------- claims

bool Ledger::claim_once(int slot, int64_t bytes, bool (*admit)(void*, const LedgerSnapshot&, std::string*), void* ctx,
                        std::string* why) {
    TenantSlot& me = hdr_->tenants[slot];
    for (int attempt = 0; attempt < kClaimAttempts; ++attempt) {
        me.pending.store(bytes, kSeq);
        if (stop_mid_claim_) {
            stop_mid_claim_ = false;
            raise(SIGSTOP);  // test hook: stopped with the claim pending
        }
        const LedgerSnapshot s = snapshot(false);
        const int64_t total = s.claimed_total();
        const bool fits = total <= s.capacity;
        if (fits && admit(ctx, s, why)) {
            me.claimed.fetch_add(bytes, kSeq);  // counted twice for a moment: conservative
            me.pending.store(0, kSeq);
            return true;
        }
        me.pending.store(0, kSeq);
        if (fits) return false;  // the policy said no; *why says why
        int64_t others_pending = 0;
        for (const auto& r : s.rows)
            if (r.slot != slot) others_pending += r.pending;
        if (total - others_pending <= s.capacity && attempt + 1 < kClaimAttempts) {
            // Only claims in flight were in the way: they settle in a moment.
            sched_yield();
            continue;
        }
        const int64_t free_bytes = s.capacity - (total - bytes);
        *why = "pool '" + name_ + "' has " + format_size_exact(std::max<int64_t>(0, free_bytes)) +
               " free for a claim of " + format_size_exact(bytes);
        return false;
    }
    *why = "pool '" + name_ + "': claim of " + format_size_exact(bytes) + " lost to concurrent claims";
    return false;
}

void Ledger::release(int slot, int64_t bytes) {
    if (bytes <= 0) return;
    TenantSlot& me = hdr_->tenants[slot];
    me.claimed.fetch_sub(bytes, kSeq);
    // Wake other processes only if someone waits for budget: another tenant,
    // or this one (a waiter freeing its way below its guarantee makes the
    // borrowers lenders: they must look again), or a borrower restoring the
    // others' headroom (what comes back may end that).
    if (me.want.load(kSeq) > 0 || anyone_waiting(slot) || anyone_restoring(slot)) bump_generation();
}

bool Ledger::quiet_free_bytes(int slot, int64_t* free_bytes, int64_t* keep_free) const {
    int64_t used = 0, keep = 0;
    for (int i = 0; i < kMaxTenants; ++i) {
        const TenantSlot& t = hdr_->tenants[i];
        if (t.pid.load(kSeq) <= 0 || t.live.load(kSeq) != 1) continue;
        if (i != slot && t.want.load(kSeq) > 0) return false;
        const int64_t cap = hdr_->capacity;
        used += std::clamp<int64_t>(t.claimed.load(kSeq), 0, cap) +
                (i == slot ? 0 : std::clamp<int64_t>(t.pending.load(kSeq), 0, cap));
        if (i != slot) keep += std::clamp<int64_t>(t.keep_free.load(kSeq), 0, cap);
    }
    *free_bytes = hdr_->capacity - used;
    *keep_free = std::min(keep, hdr_->capacity);
    return true;
}

void Ledger::report(int slot, int32_t limit_state, int64_t judged_revision, int32_t waiting, int64_t reserve_pages) {
    TenantSlot& t = hdr_->tenants[slot];
    t.judged_revision.store(judged_revision, std::memory_order_release);
    t.limit_state.store(limit_state, std::memory_order_release);
    t.waiting.store(waiting, std::memory_order_release);
    t.reserve_pages.store(reserve_pages, std::memory_order_release);
}

void Ledger::publish_want(int slot, int64_t want_bytes) {
    TenantSlot& t = hdr_->tenants[slot];
    want_bytes = std::max<int64_t>(0, want_bytes);
    if (want_bytes > 0 && t.wait_ticket.load() == 0)
        t.wait_ticket.store(hdr_->tickets.fetch_add(1, kSeq) + 1, kSeq);
    const int64_t old = t.want.exchange(want_bytes, kSeq);
    if (want_bytes == 0) t.wait_ticket.store(0, kSeq);
    if ((old == 0) != (want_bytes == 0)) bump_generation();  // lenders start or stop lending
}

void Ledger::publish_lending(int slot, int32_t state) {
    hdr_->tenants[slot].lending.store(state, std::memory_order_release);
}

bool Ledger::anyone_restoring(int slot) const {
    for (int i = 0; i < kMaxTenants; ++i)
        if (i != slot && hdr_->tenants[i].pid.load(std::memory_order_acquire) > 0 &&
            hdr_->tenants[i].lending.load(std::memory_order_acquire) == 2)
            return true;
    return false;
}

void Ledger::publish_headroom(int slot, int64_t headroom_bytes, int64_t keep_free_bytes) {
    TenantSlot& t = hdr_->tenants[slot];
    t.headroom.store(headroom_bytes, kSeq);
    t.keep_free.store(keep_free_bytes, kSeq);
}

}  // namespace kvpool
