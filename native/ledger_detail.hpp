// Internals the ledger's source files share (ledger.cpp: the segment, its
// snapshot and claims; ledger_tenants.cpp: who a tenant is, joining and
// leaving; ledger_settings.cpp: the operators' settings). Not for other
// layers: they use ledger.hpp (except tenant_dead, which the mirror_*.cpp share).
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>

namespace kvpool::ledger_detail {

constexpr auto kSeq = std::memory_order_seq_cst;

inline bool alnum(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }
inline bool name_char(char c) { return alnum(c) || c == '.' || c == '_' || c == '-'; }

// A stored name as text a reader can print (ledger_tenants.cpp says how).
std::string sanitized_name(const char* raw, int slot);
// State letter and start time of a process from /proc/<pid>/stat ('?' and 0
// when it cannot be read).
std::pair<char, uint64_t> process_stat(int32_t pid);
// A process of this PID namespace that is gone: no such pid, a zombie (its
// memory is already freed), or (start_time != 0) the pid reused by a process
// that started later. Also how a mirrored space judges its ranks (mirror_channel.hpp).
bool tenant_dead(int32_t pid, uint64_t start_time);

}  // namespace kvpool::ledger_detail
