#include "page_table.hpp"

#include <algorithm>
#include <cassert>
#include <functional>

#include "geometry.hpp"

namespace kvpool {

void PageTable::init(int64_t page_bytes, int64_t block_bytes, int64_t num_blocks) {
    const int64_t np = num_pages_for(page_bytes, block_bytes, num_blocks);
    page_bytes_ = page_bytes;
    block_bytes_ = block_bytes;
    if (page_bytes % block_bytes == 0) {
        const int64_t bpp = page_bytes / block_bytes;
        if ((bpp & (bpp - 1)) == 0) bpp_shift_ = __builtin_ctzll(static_cast<unsigned long long>(bpp));
    }
    pages_.resize(static_cast<size_t>(np));
    held_.assign(static_cast<size_t>(num_blocks), BlockHold::Free);
    std::vector<int64_t> caps;
    caps.reserve(pages_.size());
    for (int64_t p = 0; p < np; ++p) {
        const BlockRange r = page_block_range(page_bytes, block_bytes, num_blocks, p);
        Page& pg = pages_[p];
        pg.first = r.first;
        pg.cap = static_cast<int32_t>(r.size());
        pg.free_off.reserve(pg.cap);
        // Stack order: pop yields ascending ids on a fresh page.
        for (int32_t i = pg.cap - 1; i >= 0; --i) pg.free_off.push_back(i);
        capacity_ += pg.cap;
        max_cap_ = std::max(max_cap_, pg.cap);
        caps.push_back(pg.cap);
    }
    std::sort(caps.begin(), caps.end(), std::greater<int64_t>());
    top_prefix_.assign(caps.size() + 1, 0);
    for (size_t i = 0; i < caps.size(); ++i) top_prefix_[i + 1] = top_prefix_[i] + caps[i];
    bucket_head_.assign(static_cast<size_t>(max_cap_) + 1, -1);
    bucket_bits_.assign(static_cast<size_t>(max_cap_) / 64 + 1, 0);
    count_[static_cast<int>(PageState::Free)] = np;
    blocks_[static_cast<int>(PageState::Free)] = capacity_;
    // Pushed from the back so that page 0 ends up planned first.
    for (int64_t p = np - 1; p >= 0; --p)
        if (pages_[p].cap > 0) free_push(static_cast<int32_t>(p));
}

int64_t PageTable::top_pages_blocks(int64_t k) const {
    if (k <= 0) return 0;
    return top_prefix_[static_cast<size_t>(std::min<int64_t>(k, num_pages()))];
}

// ------------------------------------------------------------- transitions

void PageTable::set_state(int32_t p, PageState to) {
    Page& pg = pages_[p];
    if (pg.state == to) return;
    leave(p, pg.state);
    --count_[static_cast<int>(pg.state)];
    blocks_[static_cast<int>(pg.state)] -= pg.cap;
    pg.state = to;
    ++count_[static_cast<int>(to)];
    blocks_[static_cast<int>(to)] += pg.cap;
    enter(p, to);
}

namespace {
void erase_from_back(std::vector<int32_t>& v, int32_t p) {
    // Callers usually take the back: search from there.
    auto pos = std::find(v.rbegin(), v.rend(), p);
    assert(pos != v.rend());
    v.erase(pos.base() - 1);
}
}  // namespace

void PageTable::enter(int32_t p, PageState s) {
    Page& pg = pages_[p];
    switch (s) {
        case PageState::Free:
            if (pg.cap > 0) free_push(p);
            break;
        case PageState::Committing: committing_.push_back(p); break;
        case PageState::Reserve: reserve_.push_back(p); break;
        case PageState::Releasing: releasing_.push_back(p); break;
        case PageState::Active:
            partial_free_ += pg.nfree;
            if (pg.nfree > 0) bucket_insert(p);
            break;
    }
}

void PageTable::leave(int32_t p, PageState s) {
    Page& pg = pages_[p];
    switch (s) {
        case PageState::Free:
            if (pg.cap > 0) free_remove(p);
            break;
        case PageState::Committing: erase_from_back(committing_, p); break;
        case PageState::Reserve: erase_from_back(reserve_, p); break;
        case PageState::Releasing: erase_from_back(releasing_, p); break;
        case PageState::Active:
            partial_free_ -= pg.nfree;
            if (pg.nfree > 0) bucket_remove(p);
            break;
    }
}

void PageTable::sort_reserve_largest_last() {
    std::sort(reserve_.begin(), reserve_.end(), [this](int32_t a, int32_t b) { return pages_[a].cap < pages_[b].cap; });
}

// ------------------------------------------------------------------ blocks

void PageTable::activate(int32_t p) {
    pages_[p].nfree = pages_[p].cap;
    set_state(p, PageState::Active);
}

void PageTable::take(int32_t p, int64_t k, int64_t*& out) {
    Page& pg = pages_[p];
    bucket_remove(p);
    for (int64_t i = 0; i < k; ++i) {
        const int64_t id = pg.first + pg.free_off.back();
        pg.free_off.pop_back();
        held_[id] = BlockHold::Held;
        *out++ = id;
    }
    pg.nfree -= static_cast<int32_t>(k);
    partial_free_ -= k;
    if (pg.nfree > 0) bucket_insert(p);
}

bool PageTable::give_back_batch(const int64_t* ids, size_t n) {
    if (++batch_ == 0) {  // wrapped: no page may carry the new stamp already
        for (Page& pg : pages_) pg.batch = 0;
        batch_ = 1;
    }
    touched_.clear();
    for (size_t i = 0; i < n; ++i) {
        const int32_t p = static_cast<int32_t>(page_of(ids[i]));
        Page& pg = pages_[p];
        if (pg.batch != batch_) {
            // First block of this page in the batch: out of its bucket (and
            // out of partial_free_) until the batch is applied.
            pg.batch = batch_;
            touched_.push_back(p);
            if (pg.nfree > 0) bucket_remove(p);
            partial_free_ -= pg.nfree;
        }
        held_[ids[i]] = BlockHold::Free;
        pg.free_off.push_back(static_cast<int32_t>(ids[i] - pg.first));
        ++pg.nfree;
    }
    bool emptied = false;
    for (int32_t p : touched_) {
        Page& pg = pages_[p];
        partial_free_ += pg.nfree;
        bucket_insert(p);
        if (pg.nfree == pg.cap && !pg.pinned) {
            set_state(p, PageState::Reserve);  // emptied: as give_back
            emptied = true;
        }
    }
    return emptied;
}

int64_t PageTable::slow_page_of(int64_t id) const { return block_page(page_bytes_, block_bytes_, id); }

// ----------------------------------------------------------------- buckets
// ACTIVE pages with free blocks sit in bucket_head_[nfree] (doubly linked),
// with a bitmap of non-empty buckets: best-fit is one bit scan, O(cap/64).

void PageTable::bucket_insert(int32_t p) {
    Page& pg = pages_[p];
    const int32_t k = pg.nfree;
    pg.prev = -1;
    pg.next = bucket_head_[k];
    if (pg.next >= 0) pages_[pg.next].prev = p;
    bucket_head_[k] = p;
    bucket_bits_[k / 64] |= (uint64_t{1} << (k % 64));
}

void PageTable::bucket_remove(int32_t p) {
    Page& pg = pages_[p];
    const int32_t k = pg.nfree;
    if (pg.prev >= 0) pages_[pg.prev].next = pg.next;
    else bucket_head_[k] = pg.next;
    if (pg.next >= 0) pages_[pg.next].prev = pg.prev;
    pg.prev = pg.next = -1;
    if (bucket_head_[k] < 0) bucket_bits_[k / 64] &= ~(uint64_t{1} << (k % 64));
}

int32_t PageTable::bucket_find_ge(int32_t k) const {
    if (k < 1) k = 1;
    if (k > max_cap_) return -1;
    size_t w = static_cast<size_t>(k) / 64;
    uint64_t bits = bucket_bits_[w] & (~uint64_t{0} << (k % 64));
    while (true) {
        if (bits) return static_cast<int32_t>(w * 64 + __builtin_ctzll(bits));
        if (++w >= bucket_bits_.size()) return -1;
        bits = bucket_bits_[w];
    }
}

int32_t PageTable::bucket_find_max() const {
    for (size_t w = bucket_bits_.size(); w-- > 0;) {
        uint64_t bits = bucket_bits_[w];
        if (w == 0) bits &= ~uint64_t{1};  // bucket 0 holds nothing
        if (bits) return static_cast<int32_t>(w * 64 + 63 - __builtin_clzll(bits));
    }
    return -1;
}

void PageTable::free_push(int32_t p) {
    const int32_t cap = pages_[p].cap;
    auto it = std::find_if(free_by_cap_.begin(), free_by_cap_.end(), [cap](const auto& e) { return e.first <= cap; });
    if (it == free_by_cap_.end() || it->first != cap) it = free_by_cap_.insert(it, {cap, {}});
    it->second.push_back(p);
}

void PageTable::free_remove(int32_t p) {
    for (auto it = free_by_cap_.begin(); it != free_by_cap_.end(); ++it) {
        if (it->first != pages_[p].cap) continue;
        auto& v = it->second;
        erase_from_back(v, p);
        if (v.empty()) free_by_cap_.erase(it);  // the thread relies on non-empty buckets
        return;
    }
}

}  // namespace kvpool
