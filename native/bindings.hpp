// What the binding files share: the module's id arrays and each file's entry
// point. bindings.cpp defines the module (figures, ledger, helpers);
// bindings_space.cpp binds a Space, its hot path and create_space.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>

namespace kvpool::bind {

using IdArray = nanobind::ndarray<nanobind::numpy, int64_t, nanobind::ndim<1>>;

// A fresh int64 numpy array whose buffer the array itself owns.
inline IdArray new_id_array(size_t n, int64_t** data) {
    int64_t* buf = new int64_t[n > 0 ? n : 1];
    nanobind::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<int64_t*>(p); });
    *data = buf;
    return IdArray(buf, {n}, owner);
}

// Failure, Space and create_space (bindings_space.cpp); needs Ledger bound first.
void bind_space(nanobind::module_& m);
// RankStats, RankMemory and attach_rank (bindings_mirror.cpp).
void bind_mirror(nanobind::module_& m);

}  // namespace kvpool::bind
