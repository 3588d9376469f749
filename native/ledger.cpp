#include "ledger.hpp"

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

constexpr auto kSeq = std::memory_order_seq_cst;
constexpr int kClaimAttempts = 5;     // racing claims that saw each other retry this often
constexpr int kSettingSpins = 20000;  // a seqlock writer inside for longer is stopped or dead
constexpr int kReadSpins = 128;       // a reader gives up sooner and keeps its last settings

long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const struct timespec* ts) {
    // The generation word lives in MAP_SHARED memory: the shared futex ops.
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

bool alnum(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }
bool name_char(char c) { return alnum(c) || c == '.' || c == '_' || c == '-'; }

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

// A process of this PID namespace that is gone: no such pid, a zombie (its
// memory is already freed), or the pid reused by a process that started later.
bool tenant_dead(int32_t pid, uint64_t start_time) {
    if (pid <= 0) return false;
    if (kill(pid, 0) != 0 && errno == ESRCH) return true;
    const auto [state, start] = process_stat(pid);
    if (state == 'Z' || state == 'X') return true;
    if (state == '?') return kill(pid, 0) != 0 && errno == ESRCH;  // exited between the two looks
    return start_time != 0 && start != 0 && start != start_time;
}

// A stored name as text a reader can print (issue 10). A valid name is
// shown as it is. Anything else is a corrupted or hostile slot: it is shown as
// "?slot<N>", followed by ":<prefix>" when the bytes start with name
// characters (at most 16 of them), so the row stays short and recognisable
// (once 71 '?' for 71 bad bytes), no two corrupt slots look alike, and the
// leading '?' keeps it from ever equalling a valid tenant's name.
constexpr size_t kCorruptPrefix = 16;
std::string sanitized_name(const char* raw, int slot) {
    const std::string s(raw, strnlen(raw, kNameBytes));  // kNameBytes long: no NUL, too long to be valid
    if (valid_name(s)) return s;
    size_t prefix = 0;
    while (prefix < s.size() && prefix < kCorruptPrefix && name_char(s[prefix])) ++prefix;
    return "?slot" + std::to_string(slot) + (prefix > 0 ? ":" + s.substr(0, prefix) : "");
}

}  // namespace

bool valid_name(const std::string& name) {
    if (name.empty() || name.size() > static_cast<size_t>(kMaxNameLen) || !alnum(name[0])) return false;
    return std::all_of(name.begin(), name.end(), name_char);
}

std::string quoted_name(const std::string& name) {
    constexpr size_t kShown = 80;  // characters of the escaped text; past it, "..." and the length
    static const char hex[] = "0123456789abcdef";
    std::string out = "'";
    size_t i = 0;
    for (; i < name.size() && out.size() <= kShown; ++i) {
        const unsigned char c = static_cast<unsigned char>(name[i]);
        if (c == '\\' || c == '\'') {
            out += '\\';
            out += static_cast<char>(c);
        } else if (c >= 0x20 && c < 0x7f) {
            out += static_cast<char>(c);
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\t') {
            out += "\\t";
        } else {
            out += "\\x";
            out += hex[c >> 4];
            out += hex[c & 15];
        }
    }
    out += '\'';
    if (i < name.size()) out += "... (" + std::to_string(name.size()) + " bytes)";
    return out;
}

uint64_t process_start_time(int32_t pid) { return process_stat(pid).second; }

uint64_t own_pid_namespace() {
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) != 0) return 0;
    return static_cast<uint64_t>(st.st_ino);
}

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
                        " once no engine uses it (`kvpool pools --gc`)");
    }
    void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return fail(errno_text("mmap(" + path + ")", errno));
    ::close(fd);
    fd = -1;
    std::shared_ptr<Ledger> l(new Ledger());
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
                                       " once no engine uses it (`kvpool pools --gc`)");
            return nullptr;  // the destructor unmaps
        }
    }
    *status = Status::ok();
    return l;
}

Ledger::~Ledger() {
    if (hdr_) munmap(hdr_, sizeof(LedgerHeader));
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

bool Ledger::read_settings(int slot, int64_t* limit, int64_t* limit_rev, int64_t* guarantee,
                           int64_t* guarantee_rev) const {
    const SlotSettings& s = hdr_->tenants[slot].settings;
    // Readers retry briefly and otherwise keep what they had (a writer
    // stopped inside must not slow every snapshot of the pool); only
    // writers wait longer.
    for (int i = 0; i < kReadSpins; ++i) {
        const uint64_t s1 = s.seq.load(std::memory_order_acquire);
        if (s1 & 1) {
            if (i > 32) sched_yield();
            continue;
        }
        const int64_t l = s.limit.load(std::memory_order_relaxed), lr = s.limit_revision.load(std::memory_order_relaxed);
        const int64_t g = s.guarantee.load(std::memory_order_relaxed),
                      gr = s.guarantee_revision.load(std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_acquire);
        if (s.seq.load(std::memory_order_relaxed) != s1) continue;
        *limit = l;
        *limit_rev = lr;
        *guarantee = g;
        *guarantee_rev = gr;
        return true;
    }
    return false;
}

LedgerSnapshot Ledger::snapshot(bool names) const {
    LedgerSnapshot s;
    s.capacity = hdr_->capacity;
    s.generation = generation();
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
        r.lending = t.lending.load(kSeq);
        r.reserve_pages = t.reserve_pages.load(kSeq);
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

// ------------------------------------------------------------------ tenants

Status Ledger::register_tenant(const std::string& name, int64_t limit_bytes, int64_t guarantee_bytes, int* slot) {
    if (!valid_name(name))
        return Status::make(Code::Invalid, "bad tenant name " + quoted_name(name) +
                                               ": use 1-64 characters from [A-Za-z0-9._-], starting with a "
                                               "letter or digit");
    reap();
    const int32_t me = static_cast<int32_t>(getpid());
    const uint64_t start = process_start_time(me);
    if (guarantee_bytes >= 0) {
        const LedgerSnapshot s = snapshot();
        int64_t explicit_sum = 0;
        for (const auto& r : s.rows)
            if (r.guarantee >= 0) explicit_sum += r.guarantee;
        if (explicit_sum + guarantee_bytes > s.capacity)
            return Status::make(Code::Invalid, "guarantee_bytes=" + std::to_string(guarantee_bytes) +
                                                   " does not fit pool '" + name_ + "': explicit guarantees hold " +
                                                   std::to_string(explicit_sum) + " of its " +
                                                   std::to_string(s.capacity) + " bytes");
    }
    // Two tenants registering the same name at once: each publishes itself,
    // then looks for the other; of two SC store-then-load sequences at least
    // one sees the other, and whoever sees a twin withdraws (both may: retry).
    for (int attempt = 0; attempt < 4; ++attempt) {
        for (const auto& r : snapshot().rows)
            if (r.name == name)
                return Status::make(Code::Invalid,
                                    "pool '" + name_ + "' already has a live tenant named " + quoted_name(name));
        int mine = -1;
        for (int i = 0; i < kMaxTenants && mine < 0; ++i) {
            int32_t expect = 0;
            if (hdr_->tenants[i].pid.compare_exchange_strong(expect, me, kSeq)) mine = i;
        }
        if (mine < 0)
            return Status::make(Code::Shortage, "pool '" + name_ + "' has no free tenant slot (max " +
                                                    std::to_string(kMaxTenants) + ")");
        TenantSlot& t = hdr_->tenants[mine];
        t.pidns.store(my_pidns_, kSeq);  // first: a reaper can judge the slot from here on
        t.start_time.store(start, kSeq);
        std::memset(t.name, 0, sizeof(t.name));
        std::memcpy(t.name, name.data(), name.size());
        t.claimed.store(0);
        t.pending.store(0);
        t.want.store(0);
        t.wait_ticket.store(0);
        t.waiting.store(0);
        t.limit_state.store(0);
        t.judged_revision.store(0);
        t.reserve_pages.store(0);
        t.lending.store(0);
        SlotSettings& st = t.settings;
        // Nobody else writes a slot that is not live yet: take the seqlock
        // plainly, past any odd value a dead writer left behind.
        const uint64_t seq = (st.seq.load() | 1) + 1;
        st.seq.store(seq - 1);
        st.limit.store(limit_bytes < 0 ? -1 : limit_bytes);
        st.limit_revision.store(0);
        st.guarantee.store(guarantee_bytes < 0 ? -1 : guarantee_bytes);
        st.guarantee_revision.store(0);
        st.seq.store(seq, std::memory_order_release);
        t.live.store(1, kSeq);
        if (t.pid.load(kSeq) != me) {
            // Reaped while registering (judged dead by a confused peer): the
            // slot is not ours any more; take another.
            continue;
        }
        if (guarantee_bytes >= 0) {
            // Two tenants registering at once could both pass the check
            // above: re-check now that this one is published (SC: of two
            // racers at least one sees the other) and withdraw if over.
            int64_t sum = 0;
            for (const auto& r : snapshot(false).rows)
                if (r.guarantee >= 0) sum += r.guarantee;
            if (sum > hdr_->capacity) {
                t.live.store(0, kSeq);
                t.pid.store(0, kSeq);
                return Status::make(Code::Invalid, "guarantee_bytes=" + std::to_string(guarantee_bytes) +
                                                       " does not fit pool '" + name_ + "': explicit guarantees "
                                                       "would hold " + std::to_string(sum) + " of its " +
                                                       std::to_string(hdr_->capacity) + " bytes");
            }
        }
        bool twin = false;
        for (int i = 0; i < kMaxTenants; ++i) {
            if (i == mine) continue;
            const TenantSlot& o = hdr_->tenants[i];
            if (o.pid.load(kSeq) > 0 && o.live.load(kSeq) == 1 && std::strncmp(o.name, t.name, kNameBytes) == 0)
                twin = true;
        }
        if (!twin) {
            *slot = mine;
            bump_generation();  // default guarantees changed: every tenant's share moved
            return Status::ok();
        }
        t.live.store(0, kSeq);
        t.pid.store(0, kSeq);
        std::this_thread::sleep_for(std::chrono::microseconds(50 * (attempt + 1) * (1 + me % 7)));
    }
    return Status::make(Code::Invalid, "pool '" + name_ + "' already has a live tenant named " + quoted_name(name));
}

void Ledger::unregister_tenant(int slot) {
    if (slot < 0 || slot >= kMaxTenants) return;
    TenantSlot& t = hdr_->tenants[slot];
    if (t.pid.load() != static_cast<int32_t>(getpid())) return;
    t.live.store(0, kSeq);  // out of every sum from here
    t.claimed.store(0);
    t.pending.store(0);
    t.want.store(0);
    t.waiting.store(0);
    t.wait_ticket.store(0);
    t.start_time.store(0);
    t.pidns.store(0);
    t.pid.store(0, kSeq);
    bump_generation();
}

bool Ledger::reap_slot(int slot) {
    TenantSlot& t = hdr_->tenants[slot];
    int32_t pid = t.pid.load(kSeq);
    if (pid <= 0) return false;
    // Take the slot from the dead owner; a reaper racing us loses the CAS.
    if (!t.pid.compare_exchange_strong(pid, -static_cast<int32_t>(getpid()), kSeq)) return false;
    t.live.store(0, kSeq);
    t.claimed.store(0);
    t.pending.store(0);
    t.want.store(0);
    t.waiting.store(0);
    t.wait_ticket.store(0);
    t.lending.store(0);
    t.start_time.store(0);
    t.pidns.store(0);
    t.pid.store(0, kSeq);
    return true;
}

int Ledger::reap() {
    int reaped = 0;
    const int32_t me = static_cast<int32_t>(getpid());
    for (int i = 0; i < kMaxTenants; ++i) {
        TenantSlot& t = hdr_->tenants[i];
        const int32_t pid = t.pid.load(kSeq);
        if (pid < 0) {
            // A reaper that died inside reap_slot: finish its work if it is
            // ours to judge (it would have been in our namespace only if the
            // slot's owner was).
            if (t.pidns.load() == my_pidns_ && tenant_dead(-pid, 0)) {
                int32_t expect = pid;
                if (t.pid.compare_exchange_strong(expect, 0, kSeq)) ++reaped;
            }
            continue;
        }
        if (pid == 0 || pid == me) continue;
        // Only tenants of this PID namespace: another namespace's pid 7 is
        // not our pid 7.
        if (t.pidns.load(kSeq) != my_pidns_ || my_pidns_ == 0) continue;
        // A slot still registering has no start time of its own yet: judge
        // it only by its pid being gone.
        const bool registering = t.live.load(kSeq) != 1;
        const bool dead = registering ? (kill(pid, 0) != 0 && errno == ESRCH) : tenant_dead(pid, t.start_time.load());
        if (dead) reaped += reap_slot(i) ? 1 : 0;
    }
    if (reaped) bump_generation();
    return reaped;
}

Status Ledger::find_tenant(const std::string& tenant, int* slot) {
    reap();
    for (const auto& r : snapshot().rows)
        if (r.name == tenant) {
            *slot = r.slot;
            return Status::ok();
        }
    return Status::make(Code::Ledger, "pool '" + name_ + "' has no tenant " + quoted_name(tenant));
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
        *why = "pool '" + name_ + "' has " + std::to_string(std::max<int64_t>(0, free_bytes)) +
               " bytes free for a claim of " + std::to_string(bytes);
        return false;
    }
    *why = "pool '" + name_ + "': claim of " + std::to_string(bytes) + " bytes lost to concurrent claims";
    return false;
}

void Ledger::release(int slot, int64_t bytes) {
    if (bytes <= 0) return;
    TenantSlot& me = hdr_->tenants[slot];
    me.claimed.fetch_sub(bytes, kSeq);
    // Wake other processes only if someone waits for budget: another tenant,
    // or this one (a waiter freeing its way below its guarantee makes the
    // borrowers lenders: they must look again).
    if (me.want.load(kSeq) > 0 || anyone_waiting(slot)) bump_generation();
}

bool Ledger::quiet_free_bytes(int slot, int64_t* free_bytes) const {
    int64_t used = 0;
    for (int i = 0; i < kMaxTenants; ++i) {
        const TenantSlot& t = hdr_->tenants[i];
        if (t.pid.load(kSeq) <= 0 || t.live.load(kSeq) != 1) continue;
        if (i != slot && t.want.load(kSeq) > 0) return false;
        const int64_t cap = hdr_->capacity;
        used += std::clamp<int64_t>(t.claimed.load(kSeq), 0, cap) +
                (i == slot ? 0 : std::clamp<int64_t>(t.pending.load(kSeq), 0, cap));
    }
    *free_bytes = hdr_->capacity - used;
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

void Ledger::publish_lending(int slot, bool lending) {
    hdr_->tenants[slot].lending.store(lending ? 1 : 0, std::memory_order_release);
}

// ----------------------------------------------------------------- settings

Status Ledger::write_setting(int slot, bool guarantee, int64_t bytes, int64_t revision, LimitResult* result) {
    const char* what = guarantee ? "guarantee" : "limit";
    if (slot < 0 || slot >= kMaxTenants) return Status::make(Code::Invalid, "bad tenant slot");
    if (bytes < -1) return Status::make(Code::Invalid, std::string(what) + " must be >= 0 bytes, or -1 for none");
    // revision -1: the next one, read inside the seqlock (a setter racing an
    // operator must not compute it from a stale copy and be judged stale).
    if (revision < -1 || revision > kMaxRevision)
        return Status::make(Code::Invalid, std::string(what) + " revision must be in [0, 2**53], got " +
                                               std::to_string(revision));
    TenantSlot& t = hdr_->tenants[slot];
    SlotSettings& s = t.settings;
    uint64_t seq = 0;
    bool entered = false;
    for (int i = 0; i < kSettingSpins && !entered; ++i) {
        seq = s.seq.load(kSeq);
        if (!(seq & 1) && s.seq.compare_exchange_weak(seq, seq + 1, kSeq)) entered = true;
        else if (i > 64) sched_yield();
    }
    if (!entered)
        return Status::make(Code::Ledger, "pool '" + name_ + "': the settings of tenant slot " + std::to_string(slot) +
                                              " are held by a stopped or dead writer; try again");
    std::atomic<int64_t>& value = guarantee ? s.guarantee : s.limit;
    std::atomic<int64_t>& rev = guarantee ? s.guarantee_revision : s.limit_revision;
    const int64_t cur = rev.load(kSeq);
    if (revision < 0) revision = cur + 1;
    Status st = Status::ok();
    if (revision > kMaxRevision) {
        s.seq.store(seq + 2, std::memory_order_release);
        return Status::make(Code::Invalid, std::string(what) + " revision would pass 2**53");
    }
    if (revision < cur) *result = LimitResult::Stale;
    else if (revision == cur) *result = value.load(kSeq) == bytes ? LimitResult::Same : LimitResult::Conflict;
    else {
        const int64_t old = value.exchange(bytes, kSeq);
        *result = LimitResult::Applied;
        if (guarantee && bytes >= 0) {
            // Explicit guarantees may not add up to more than the capacity.
            // Checked after the write (SC), so of two racing setters at least
            // one sees the other; an over-promise is rolled back.
            int64_t sum = 0;
            for (int i = 0; i < kMaxTenants; ++i) {
                const TenantSlot& o = hdr_->tenants[i];
                if (o.pid.load(kSeq) <= 0 || o.live.load(kSeq) != 1) continue;
                const int64_t g = o.settings.guarantee.load(kSeq);
                if (g >= 0) sum += g;
            }
            if (sum > hdr_->capacity) {
                value.store(old, kSeq);
                st = Status::make(Code::Invalid, "a guarantee of " + std::to_string(bytes) + " bytes does not fit pool '" +
                                                     name_ + "': explicit guarantees would hold " +
                                                     std::to_string(sum) + " of its " +
                                                     std::to_string(hdr_->capacity) + " bytes");
            }
        }
        if (st.is_ok()) rev.store(revision, kSeq);
    }
    s.seq.store(seq + 2, std::memory_order_release);
    if (st.is_ok() && *result == LimitResult::Applied) bump_generation();
    return st;
}

Status Ledger::set_limit(int slot, int64_t bytes, int64_t revision, LimitResult* result) {
    return write_setting(slot, false, bytes, revision, result);
}

Status Ledger::set_guarantee(int slot, int64_t bytes, int64_t revision, LimitResult* result) {
    return write_setting(slot, true, bytes, revision, result);
}

}  // namespace kvpool
