// The page table of one KV space: page states, per-state counts, and the
// structures that find pages fast. Plain bookkeeping, no syscalls, no locks
// (the space holds its mutex around every call).
//
// Page states:   FREE --commit--> RESERVE --first alloc--> ACTIVE
//                  ^                 |  ^                      |
//                  +----release------+  +---last block freed---+
// plus two transient states (COMMITTING, RELEASING) owned by the reserve
// thread while it runs a syscall without holding the lock.
//
// Every state change goes through set_state(), the one transition function:
// it moves the page between the membership structures of its old and new
// state and keeps count(state) / blocks(state) exact, so no caller sums
// pages by hand. The named figures (committed, claimed, idle) read those.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace kvpool {

enum class PageState : uint8_t { Free = 0, Committing = 1, Reserve = 2, Active = 3, Releasing = 4 };
constexpr int kPageStates = 5;

// A block's ownership in the space's held map.
enum class BlockHold : uint8_t {
    Free = 0,    // on its page's free stack
    Held = 1,    // handed out
    Marked = 2,  // held and named once already in the free batch being validated
};

class PageTable {
public:
    struct Page {
        int64_t first = 0;           // first block id on the page
        int32_t cap = 0;             // blocks on the page
        int32_t nfree = 0;           // free blocks (ACTIVE pages)
        PageState state = PageState::Free;
        bool pinned = false;         // holds the null block: never released
        int32_t prev = -1, next = -1;  // links in bucket_head_[nfree]
        uint32_t batch = 0;          // the last give_back_batch that touched it
        std::vector<int32_t> free_off;  // free block offsets, a stack
    };

    // Pages of the geometry (page_bytes, block_bytes, num_blocks).
    void init(int64_t page_bytes, int64_t block_bytes, int64_t num_blocks);

    int64_t num_pages() const { return static_cast<int64_t>(pages_.size()); }
    int64_t capacity() const { return capacity_; }
    int32_t max_cap() const { return max_cap_; }
    Page& page(int32_t p) { return pages_[p]; }
    const Page& page(int32_t p) const { return pages_[p]; }

    // The one transition function (see the header comment).
    void set_state(int32_t p, PageState to);
    int64_t count(PageState s) const { return count_[static_cast<int>(s)]; }
    int64_t blocks(PageState s) const { return blocks_[static_cast<int>(s)]; }  // sum of caps

    // Named figures, in pages.
    int64_t committed() const {  // holding memory now
        return count(PageState::Active) + count(PageState::Reserve) + count(PageState::Releasing);
    }
    int64_t claimed() const { return committed() + count(PageState::Committing); }  // as the budget counts them
    int64_t idle() const { return count(PageState::Reserve) + count(PageState::Committing); }

    // Free blocks on ACTIVE pages.
    int64_t partial_free() const { return partial_free_; }

    // RESERVE pages, a stack (back = next handed out or released).
    const std::vector<int32_t>& reserve() const { return reserve_; }
    // Orders the reserve stack so the largest pages are handed out first.
    void sort_reserve_largest_last();
    const std::vector<int32_t>& committing() const { return committing_; }
    const std::vector<int32_t>& releasing() const { return releasing_; }
    // FREE pages by capacity, largest first: top-k sums stay exact under a limit.
    const std::vector<std::pair<int32_t, std::vector<int32_t>>>& free_by_cap() const { return free_by_cap_; }
    // Blocks the k largest pages of the space hold (admission's upper bound).
    int64_t top_pages_blocks(int64_t k) const;

    // Blocks: take k from ACTIVE page p (writes ids).
    void take(int32_t p, int64_t k, int64_t*& out);
    // Give a validated batch of held ids back: each page
    // touched moves between buckets once, not once per block. Returns true
    // if any page emptied (it is RESERVE then).
    bool give_back_batch(const int64_t* ids, size_t n);
    // Page of a block id (0 <= id < num_blocks), or -1 when the block
    // straddles a page boundary: the geometry formula, a shift when a page
    // holds a power-of-two number of whole blocks.
    int64_t page_of(int64_t id) const {
        return bpp_shift_ >= 0 ? (id >> bpp_shift_) : slow_page_of(id);
    }
    // An idle (RESERVE) page becomes ACTIVE with all blocks free.
    void activate(int32_t p);
    // Best fit: bucket of the smallest nfree >= k, or of the largest.
    int32_t bucket_find_ge(int32_t k) const;
    int32_t bucket_find_max() const;
    int32_t bucket_head(int32_t k) const { return bucket_head_[k]; }

    BlockHold hold(int64_t id) const { return held_[id]; }
    void set_hold(int64_t id, BlockHold h) { held_[id] = h; }

private:
    void enter(int32_t p, PageState s);
    void leave(int32_t p, PageState s);
    void bucket_insert(int32_t p);
    void bucket_remove(int32_t p);
    void free_push(int32_t p);
    void free_remove(int32_t p);
    int64_t slow_page_of(int64_t id) const;

    std::vector<Page> pages_;
    std::vector<BlockHold> held_;
    std::vector<int32_t> bucket_head_;   // ACTIVE pages with 0 < nfree, by nfree
    std::vector<uint64_t> bucket_bits_;  // non-empty buckets: best-fit lookup by bit scan
    std::vector<std::pair<int32_t, std::vector<int32_t>>> free_by_cap_;
    std::vector<int32_t> reserve_, committing_, releasing_;
    std::vector<int64_t> top_prefix_;    // top_prefix_[k]: blocks of the k largest pages
    int64_t count_[kPageStates] = {0, 0, 0, 0, 0};
    int64_t blocks_[kPageStates] = {0, 0, 0, 0, 0};
    int64_t partial_free_ = 0;
    int64_t capacity_ = 0;
    int32_t max_cap_ = 0;
    int64_t page_bytes_ = 0, block_bytes_ = 0;
    int bpp_shift_ = -1;       // log2(blocks per page) when pages hold 2**k whole blocks
    uint32_t batch_ = 0;       // give_back_batch counter (Page::batch)
    std::vector<int32_t> touched_;  // give_back_batch scratch
};

}  // namespace kvpool
