// Internals the ledger's source files share (ledger.cpp: the segment, its
// snapshot and claims; ledger_tenants.cpp: who a tenant is, joining and
// leaving; ledger_settings.cpp: the operators' settings). Not for other
// layers: they use ledger.hpp.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>

namespace kvpool::ledger_detail {

constexpr auto kSeq = std::memory_order_seq_cst;

inline bool alnum(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }
inline bool name_char(char c) { return alnum(c) || c == '.' || c == '_' || c == '-'; }

// A stored name as text a reader can print (ledger_tenants.cpp says how).
std::string sanitized_name(const char* raw, int slot);

}  // namespace kvpool::ledger_detail
