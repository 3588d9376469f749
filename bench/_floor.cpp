// The floor of `kvpool bench peers` (bench/peers.py, installed as kvpool.bench.peers): the least a block-id allocator can do.
//
// A stack of free block ids in one std::vector<int64_t> (capacity reserved for
// every block up front, so it never reallocates): alloc(n) copies the top n ids
// into the caller's buffer and pops them; free(ids) pushes them back. No
// validation (double frees, unknown ids), no pages, no accounting, no locks:
// whatever kvpool does beyond this is the price of its guarantees.
//
// The peers suite compiles this file at run time (g++ -O2 -shared -fPIC, into a
// temporary folder) and loads it with ctypes; it is not part of the kvpool build.

#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace {

struct FreeList {
  std::vector<int64_t> free_ids;  // a stack; its top is the back
};

inline FreeList* as_list(void* h) { return static_cast<FreeList*>(h); }

inline int64_t do_alloc(FreeList* fl, int64_t n, int64_t* out) {
  std::vector<int64_t>& v = fl->free_ids;
  if (n < 0 || static_cast<uint64_t>(n) > v.size()) return -1;
  const size_t top = v.size() - static_cast<size_t>(n);
  std::memcpy(out, v.data() + top, static_cast<size_t>(n) * sizeof(int64_t));
  v.resize(top);  // shrinking a vector of int64_t: just moves its end
  return n;
}

inline int64_t do_free(FreeList* fl, const int64_t* ids, int64_t n) {
  if (n < 0) return -1;
  fl->free_ids.insert(fl->free_ids.end(), ids, ids + n);
  return n;
}

}  // namespace

extern "C" {

// A list of num_blocks free ids (0 .. num_blocks-1; alloc hands out the lowest first), or null.
void* fl_create(int64_t num_blocks) {
  if (num_blocks < 0) return nullptr;
  FreeList* fl = new (std::nothrow) FreeList;
  if (fl == nullptr) return nullptr;
  try {
    fl->free_ids.reserve(static_cast<size_t>(num_blocks));
    for (int64_t i = num_blocks - 1; i >= 0; --i) fl->free_ids.push_back(i);
  } catch (...) {
    delete fl;
    return nullptr;
  }
  return fl;
}

void fl_destroy(void* h) { delete as_list(h); }

int64_t fl_available(void* h) { return static_cast<int64_t>(as_list(h)->free_ids.size()); }

// n ids into out (n, or -1 when fewer than n are free: then nothing changes).
int64_t fl_alloc(void* h, int64_t n, int64_t* out) { return do_alloc(as_list(h), n, out); }

// Push n ids back (n, or -1 for a negative n).
int64_t fl_free(void* h, const int64_t* ids, int64_t n) { return do_free(as_list(h), ids, n); }

// iters round trips of alloc(n) into out + free(out) inside C++: the pure floor.
// 0, or -1 when an alloc failed. The compiler barriers keep the optimizer from
// fusing a round trip's pop and push into nothing.
int64_t fl_roundtrips(void* h, int64_t n, int64_t iters, int64_t* out) {
  FreeList* fl = as_list(h);
  for (int64_t i = 0; i < iters; ++i) {
    if (do_alloc(fl, n, out) != n) return -1;
    asm volatile("" : : "r"(out) : "memory");
    do_free(fl, out, n);
    asm volatile("" : : "r"(out) : "memory");
  }
  return 0;
}

}  // extern "C"
