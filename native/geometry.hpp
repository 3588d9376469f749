// The one block/page formula of kvpool (ARCHITECTURE.md, "Geometry").
//
//   region bytes:  |<------ page 0 (P) ------>|<------ page 1 (P) ------>|
//   blocks (B):    |  b0   |  b1   |  b2 (straddles) |  b3   |   ...
//
// Page p holds blocks [ceil(p*P/B), floor((p+1)*P/B)), clipped to [0, N).
// A block that straddles a page boundary belongs to no page and is never
// handed out, so every capacity figure is a sum of these ranges.
#pragma once
#include <cstdint>

namespace kvpool {

struct BlockRange {
    int64_t first;  // inclusive
    int64_t last;   // exclusive
    int64_t size() const { return last - first; }
};

inline int64_t num_pages_for(int64_t page_bytes, int64_t block_bytes, int64_t num_blocks) {
    const int64_t total = num_blocks * block_bytes;
    return (total + page_bytes - 1) / page_bytes;
}

inline BlockRange page_block_range(int64_t page_bytes, int64_t block_bytes,
                                   int64_t num_blocks, int64_t page) {
    int64_t first = (page * page_bytes + block_bytes - 1) / block_bytes;
    int64_t last = ((page + 1) * page_bytes) / block_bytes;
    if (first > num_blocks) first = num_blocks;
    if (last > num_blocks) last = num_blocks;
    if (last < first) last = first;
    return {first, last};
}

// Page of a block, or -1 when the block straddles a page boundary.
inline int64_t block_page(int64_t page_bytes, int64_t block_bytes, int64_t block) {
    const int64_t start = block * block_bytes;
    const int64_t page = start / page_bytes;
    if (start + block_bytes > (page + 1) * page_bytes) return -1;
    return page;
}

}  // namespace kvpool
