// The ledger's tenants: who a tenant is (pid, process start time, PID
// namespace, name), how it joins and leaves a pool, and how the dead are
// reaped. The segment, its snapshot and claims are in ledger.cpp; settings
// in ledger_settings.cpp.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "ledger.hpp"
#include "ledger_detail.hpp"
#include "sizes.hpp"

namespace kvpool {
using ledger_detail::alnum;
using ledger_detail::kSeq;
using ledger_detail::name_char;
using ledger_detail::process_stat;
using ledger_detail::tenant_dead;

namespace ledger_detail {

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

}  // namespace ledger_detail

namespace ledger_detail {

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

}  // namespace ledger_detail

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

// Every figure the owner writes, back to 0: the one list of them, for a
// tenant joining (a reaper may have died before clearing the slot) and for a
// slot being freed (no stale claim, want or wait for the next reader).
static void clear_figures(TenantSlot& t) {
    t.claimed.store(0);
    t.pending.store(0);
    t.want.store(0);
    t.wait_ticket.store(0);
    t.waiting.store(0);
    t.limit_state.store(0);
    t.judged_revision.store(0);
    t.reserve_pages.store(0);
    t.lending.store(0);
    t.headroom.store(0);
    t.keep_free.store(0);
    t.allocs.store(0);  // counters start at 0 for a new tenant
    t.shortages.store(0);
    t.freeing.store(0);
    t.no_preempt.store(0);
    t.preempt_bytes.store(0);
    t.preempt_asked.store(0);
    t.preempted.store(0);
    t.recomputed_tokens.store(0);
    t.reclaimed_completion.store(0);
    t.reclaimed_preemption.store(0);
    t.reclaimed_eviction.store(0);
}

Status Ledger::guarantee_fits(int64_t extra, bool published) const {
    const LedgerSnapshot s = snapshot(false);
    int64_t sum = published ? 0 : extra;
    for (const auto& r : s.rows)
        if (r.guarantee >= 0) sum += r.guarantee;
    if (sum <= s.capacity) return Status::ok();
    return Status::make(Code::Invalid, "guarantee_bytes=" + std::to_string(extra) + " (" + format_size(extra) +
                                           ") does not fit pool '" + name_ + "': explicit guarantees " +
                                           (published ? "would hold " : "hold ") +
                                           format_size_exact(published ? sum : sum - extra) + " of its " +
                                           format_size_exact(s.capacity));
}

int Ledger::take_free_slot(int32_t me) {
    for (int i = 0; i < kMaxTenants; ++i) {
        int32_t expect = 0;
        if (!hdr_->tenants[i].pid.compare_exchange_strong(expect, me, kSeq)) continue;
        hdr_->tenants[i].pidns.store(my_pidns_, kSeq);  // first: a reaper can judge the slot from here on
        // The liveness lock, before the slot goes live. Held elsewhere: a
        // reaper judging it this instant, or a forked child of a dead
        // owner that inherited the open file. Not ours to wait for: next slot.
        if (lock_slot(i)) return i;
        hdr_->tenants[i].pidns.store(0, kSeq);
        hdr_->tenants[i].pid.store(0, kSeq);
    }
    return -1;
}

void Ledger::publish_slot(int slot, const std::string& name, uint64_t start, int64_t limit_bytes,
                          int64_t guarantee_bytes) {
    TenantSlot& t = hdr_->tenants[slot];
    t.start_time.store(start, kSeq);
    std::memset(t.name, 0, sizeof(t.name));
    std::memcpy(t.name, name.data(), name.size());
    clear_figures(t);  // a reaper may have died before clearing them
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
}

bool Ledger::has_twin(int slot) const {
    const TenantSlot& t = hdr_->tenants[slot];
    for (int i = 0; i < kMaxTenants; ++i) {
        if (i == slot) continue;
        const TenantSlot& o = hdr_->tenants[i];
        if (o.pid.load(kSeq) > 0 && o.live.load(kSeq) == 1 && std::strncmp(o.name, t.name, kNameBytes) == 0)
            return true;
    }
    return false;
}

void Ledger::withdraw_slot(int slot) {
    TenantSlot& t = hdr_->tenants[slot];
    t.live.store(0, kSeq);
    t.pid.store(0, kSeq);
    unlock_slot(slot);
}

Status Ledger::register_tenant(const std::string& name, int64_t limit_bytes, int64_t guarantee_bytes, int* slot) {
    if (!valid_name(name))
        return Status::make(Code::Invalid, "bad tenant name " + quoted_name(name) +
                                               ": use 1-64 characters from [A-Za-z0-9._-], starting with a "
                                               "letter or digit");
    reap();
    const int32_t me = static_cast<int32_t>(getpid());
    const uint64_t start = process_start_time(me);
    if (guarantee_bytes >= 0) {
        Status fits = guarantee_fits(guarantee_bytes, /*published=*/false);
        if (!fits.is_ok()) return fits;
    }
    // Two tenants registering the same name at once: each publishes itself,
    // then looks for the other; of two SC store-then-load sequences at least
    // one sees the other, and whoever sees a twin withdraws (both may: retry).
    for (int attempt = 0; attempt < 4; ++attempt) {
        for (const auto& r : snapshot().rows)
            if (r.name == name)
                return Status::make(Code::Invalid,
                                    "pool '" + name_ + "' already has a live tenant named " + quoted_name(name));
        const int mine = take_free_slot(me);
        if (mine < 0)
            return Status::make(Code::Shortage, "pool '" + name_ + "' has no free tenant slot (max " +
                                                    std::to_string(kMaxTenants) + ")");
        publish_slot(mine, name, start, limit_bytes, guarantee_bytes);
        if (hdr_->tenants[mine].pid.load(kSeq) != me) {
            // Reaped while registering (judged dead by a confused peer): the
            // slot is not ours any more; take another.
            unlock_slot(mine);
            continue;
        }
        if (guarantee_bytes >= 0) {
            // Two tenants registering at once could both pass the check
            // above: re-check now that this one is published (SC: of two
            // racers at least one sees the other) and withdraw if over.
            Status fits = guarantee_fits(guarantee_bytes, /*published=*/true);
            if (!fits.is_ok()) {
                withdraw_slot(mine);
                return fits;
            }
        }
        if (!has_twin(mine)) {
            *slot = mine;
            bump_generation();  // default guarantees changed: every tenant's share moved
            return Status::ok();
        }
        withdraw_slot(mine);
        std::this_thread::sleep_for(std::chrono::microseconds(50 * (attempt + 1) * (1 + me % 7)));
    }
    return Status::make(Code::Invalid, "pool '" + name_ + "' already has a live tenant named " + quoted_name(name));
}

// Frees a slot its caller holds (its owner leaving, or a reaper that won
// the pid CAS): out of every sum first (live = 0), then its figures and its
// identity cleared, so the next tenant and a reader of a half-freed slot
// see no stale claim, want or wait, and no old pid namespace or start time
// to judge; the pid word last, which frees the slot for the next CAS.
void Ledger::free_slot(int slot) {
    TenantSlot& t = hdr_->tenants[slot];
    t.live.store(0, kSeq);
    clear_figures(t);
    t.start_time.store(0);
    t.pidns.store(0);
    t.pid.store(0, kSeq);
}

void Ledger::unregister_tenant(int slot) {
    if (slot < 0 || slot >= kMaxTenants) return;
    if (hdr_->tenants[slot].pid.load() != static_cast<int32_t>(getpid())) return;
    free_slot(slot);
    unlock_slot(slot);  // after the slot is free: a reaper that takes the lock now finds nothing live
    hdr_->last_exit.store(static_cast<uint32_t>(LastExit::Left), kSeq);
    bump_generation();
}

bool Ledger::reap_slot(int slot) {
    TenantSlot& t = hdr_->tenants[slot];
    int32_t pid = t.pid.load(kSeq);
    if (pid <= 0) return false;
    // Take the slot from the dead owner; a reaper racing us loses the CAS.
    if (!t.pid.compare_exchange_strong(pid, -static_cast<int32_t>(getpid()), kSeq)) return false;
    free_slot(slot);
    hdr_->last_exit.store(static_cast<uint32_t>(LastExit::Died), kSeq);
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
                if (t.pid.compare_exchange_strong(expect, 0, kSeq)) {
                    hdr_->last_exit.store(static_cast<uint32_t>(LastExit::Died), kSeq);
                    ++reaped;
                }
            }
            continue;
        }
        if (pid == 0 || pid == me) continue;
        // Another namespace's pid 7 is not our pid 7: its tenants are judged
        // by their slot's lock instead.
        if (t.pidns.load(kSeq) != my_pidns_ || my_pidns_ == 0) {
            reaped += reap_foreign(i, pid) ? 1 : 0;
            continue;
        }
        // A slot still registering has no start time of its own yet: judge
        // it only by its pid being gone.
        const bool registering = t.live.load(kSeq) != 1;
        const bool dead = registering ? (kill(pid, 0) != 0 && errno == ESRCH) : tenant_dead(pid, t.start_time.load());
        if (dead) reaped += reap_slot(i) ? 1 : 0;
    }
    if (reaped) bump_generation();
    return reaped;
}

// The lock's byte: the slot's own offset in the file, so slots never share one.
static flock slot_lock(int slot, short type) {
    flock l{};
    l.l_type = type;
    l.l_whence = SEEK_SET;
    l.l_start = static_cast<off_t>(offsetof(LedgerHeader, tenants) + static_cast<size_t>(slot) * sizeof(TenantSlot));
    l.l_len = 1;
    l.l_pid = 0;  // required by OFD locks
    return l;
}

bool Ledger::lock_slot(int slot) const {
    flock l = slot_lock(slot, F_WRLCK);
    return fcntl(fd_, F_OFD_SETLK, &l) == 0;
}

void Ledger::unlock_slot(int slot) const {
    flock l = slot_lock(slot, F_UNLCK);
    fcntl(fd_, F_OFD_SETLK, &l);
}

bool Ledger::reap_foreign(int slot, int32_t pid) {
    TenantSlot& t = hdr_->tenants[slot];
    // Registering (not live yet): its lock may not be taken yet either.
    if (t.live.load(kSeq) != 1) return false;
    // A live owner holds the lock from before it went live until after its
    // slot is free; holding it ourselves, nobody can register here meanwhile.
    if (!lock_slot(slot)) return false;
    const bool dead = t.live.load(kSeq) == 1 && t.pid.load(kSeq) == pid && reap_slot(slot);
    unlock_slot(slot);
    return dead;
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

}  // namespace kvpool
