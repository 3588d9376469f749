// The ids crossing the boundary, as every face runs them: alloc_ids (n ids
// as an int64 numpy array made through numpy's C API, or a Failure),
// free_ids (what is available after it, or a Failure), id_buffer (a free's
// ids read in place), the vLLM plugin's item forms, acquire (the bounded
// wait) and available_now. Each runs first non-blocking with the GIL held
// (no page syscall, no wait: most calls) and retries with it released only
// when the core says it would block.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstring>

// numpy's C API table is defined in bindings.cpp (_import_array there).
#define PY_ARRAY_UNIQUE_SYMBOL kvpool_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

#include "bindings.hpp"
#include "space.hpp"

namespace nb = nanobind;
using kvpool::Code;
using kvpool::Space;
using kvpool::Status;
using kvpool::bind::Failure;
using kvpool::bind::alloc_ids;
using kvpool::bind::free_ids;
using kvpool::bind::id_buffer;

namespace {

// A fresh int64 array of n elements (numpy's C API: no Python-level call).
nb::object new_int64_array(int64_t n, int64_t** data) {
    npy_intp dim = static_cast<npy_intp>(n);
    PyObject* a = PyArray_SimpleNew(1, &dim, NPY_INT64);
    if (a == nullptr) throw nb::python_error();
    *data = static_cast<int64_t*>(PyArray_DATA(reinterpret_cast<PyArrayObject*>(a)));
    return nb::steal(a);
}

}  // namespace

namespace kvpool::bind {

// The ids of a free: a 1-D, C-contiguous, aligned, native-order int64 numpy
// array, read in place, or a list of Python ints (the vLLM plugin's ids),
// copied into `scratch`. Anything else (an int beyond int64 included) is a
// TypeError the Python layer answers by converting
// (kvpool._validate.block_ids) and calling again.
const int64_t* id_buffer(nb::handle ids, int64_t* n, std::vector<int64_t>& scratch) {
    PyObject* o = ids.ptr();
    if (PyList_CheckExact(o)) {
        const Py_ssize_t len = PyList_GET_SIZE(o);
        scratch.resize(static_cast<size_t>(len));
        for (Py_ssize_t i = 0; i < len; ++i) {
            PyObject* item = PyList_GET_ITEM(o, i);
            int overflow = 0;
            const long long v = PyLong_Check(item) && !PyBool_Check(item) ? PyLong_AsLongLongAndOverflow(item, &overflow)
                                                                         : (overflow = 1, 0);
            if (overflow != 0) throw nb::type_error("free: ids must be Python ints within int64");
            scratch[static_cast<size_t>(i)] = static_cast<int64_t>(v);
        }
        *n = static_cast<int64_t>(len);
        return scratch.data();
    }
    if (PyArray_Check(o)) {
        auto* a = reinterpret_cast<PyArrayObject*>(o);
        const int t = PyArray_TYPE(a);
        if (PyArray_NDIM(a) == 1 && (t == NPY_LONG || t == NPY_LONGLONG) && PyArray_ITEMSIZE(a) == 8 &&
            PyArray_ISCARRAY_RO(a)) {
            *n = static_cast<int64_t>(PyArray_DIM(a, 0));
            return static_cast<const int64_t*>(PyArray_DATA(a));
        }
    }
    throw nb::type_error("free: ids must be a 1-D C-contiguous int64 numpy array or a list of ints");
}

}  // namespace kvpool::bind

namespace {

// A refused alloc as Python sees it (an Unsatisfiable one names the most
// this tenant can ever hold).
nb::object failed_alloc(Space& s, Status st, int64_t available) {
    Failure f{static_cast<int>(st.code), std::move(st.message), available, 0, {}};
    if (st.code == Code::Unsatisfiable) {
        nb::gil_scoped_release nogil;
        f.max_blocks = s.max_blocks();
    }
    return nb::cast(std::move(f));
}

// The ids of `items` (a list), each read as the int attribute `attr` (the
// vLLM plugin's block objects and their block_id), into `scratch`.
const int64_t* attr_ids(nb::handle items, nb::handle attr, int64_t* n, std::vector<int64_t>& scratch) {
    PyObject* list = items.ptr();
    if (!PyList_CheckExact(list)) throw nb::type_error("free_items: items must be a list");
    if (!PyUnicode_CheckExact(attr.ptr())) throw nb::type_error("free_items: attr must be a str");
    const Py_ssize_t len = PyList_GET_SIZE(list);
    scratch.resize(static_cast<size_t>(len));
    for (Py_ssize_t i = 0; i < len; ++i) {
        PyObject* v = PyObject_GetAttr(PyList_GET_ITEM(list, i), attr.ptr());
        if (v == nullptr) throw nb::python_error();
        int overflow = 0;
        const long long id = PyLong_Check(v) ? PyLong_AsLongLongAndOverflow(v, &overflow) : (overflow = 1, 0);
        Py_DECREF(v);
        if (overflow != 0) throw nb::type_error("free_items: each item's id must be an int within int64");
        scratch[static_cast<size_t>(i)] = static_cast<int64_t>(id);
    }
    *n = static_cast<int64_t>(len);
    return scratch.data();
}

}  // namespace

namespace kvpool::bind {

// Space::free as the binding runs it (ids already read): non-blocking with
// the GIL held, then (if the core would block) again without it.
nb::object free_ids(Space& s, const int64_t* data, int64_t n, bool want_available) {
    std::vector<int64_t> bad;
    int64_t available = 0;
    int64_t* avail = want_available ? &available : nullptr;  // (a pooled tenant's figure reads the ledger)
    bool release_due = false;
    Status st = s.free(data, n, &bad, nullptr, avail, /*nonblocking=*/true, &release_due);
    if (release_due) {  // no reserve thread: the page syscalls, without the GIL
        nb::gil_scoped_release nogil;
        s.release_inline();
        if (want_available) available = s.available();
    } else if (st.code == Code::WouldBlock) {
        // The caller's ids stay referenced for the call; the core applies
        // its own validated copy of them.
        nb::gil_scoped_release nogil;
        st = s.free(data, n, &bad, nullptr, avail);
    }
    if (st.is_ok()) return want_available ? nb::object(nb::int_(available)) : nb::none();
    return nb::cast(Failure{static_cast<int>(st.code), std::move(st.message), available, 0, std::move(bad)});
}

// Space::alloc as every alloc binding runs it: non-blocking with the GIL
// held, then (if the core would block) again without it.
Status run_alloc(Space& s, int64_t n, int64_t* out, bool promised, int64_t* available) {
    Status st = s.alloc(n, out, available, nullptr, /*nonblocking=*/true, promised);
    if (st.code == Code::WouldBlock) {
        nb::gil_scoped_release nogil;
        st = s.alloc(n, out, available, nullptr, /*nonblocking=*/false, promised);
    }
    return st;
}

// Space::alloc as the binding runs it: non-blocking with the GIL held, then
// (if the core would block) again without it.
nb::object alloc_ids(Space& s, int64_t n, bool promised) {
    int64_t* data = nullptr;
    // No buffer for requests beyond capacity: the core answers those before
    // touching it.
    nb::object ids = new_int64_array(n > 0 && n <= s.capacity() ? n : 0, &data);
    int64_t available = 0;
    Status st = run_alloc(s, n, data, promised, &available);
    if (st.is_ok()) return ids;
    return failed_alloc(s, std::move(st), available);
}

}  // namespace kvpool::bind

namespace kvpool::bind {

// Space::acquire as the bindings run it: the GIL released for the whole
// wait, signals (Ctrl-C) checked between its sleeps.
Status run_acquire(Space& s, int64_t n, int64_t* out, bool promised, double stall, double timeout,
                   int64_t* available) {
    AcquireWait w;
    w.promised = promised;
    w.stall_s = stall;
    w.timeout_s = timeout;
    w.interrupted = [] {
        nb::gil_scoped_acquire gil;
        return PyErr_CheckSignals() != 0;
    };
    Status st;
    {
        nb::gil_scoped_release nogil;
        st = s.acquire(n, out, available, w);
    }
    if (st.code == Code::Interrupted) throw nb::python_error();  // the signal handler's exception
    return st;
}

namespace {
void check_items(Space& s, nb::handle items, const char* who) {
    if (!PyList_CheckExact(items.ptr())) throw nb::type_error((std::string(who) + ": items must be a list").c_str());
    if (PyList_GET_SIZE(items.ptr()) < s.config().num_blocks)
        throw nb::value_error((std::string(who) + ": items must have an entry for every block of the space").c_str());
}

// The n allocated `ids` answered as [items[id] for each id]; on no memory
// for the answer the blocks go back.
nb::object answer_items(Space& s, int64_t n, nb::handle items, const int64_t* ids) {
    PyObject* table = items.ptr();
    PyObject* out = PyList_New(static_cast<Py_ssize_t>(n));
    if (out == nullptr) {  // no memory for the answer: give the blocks back
        nb::gil_scoped_release nogil;
        std::vector<int64_t> bad;
        s.free(ids, n, &bad);
        throw nb::python_error();
    }
    for (int64_t i = 0; i < n; ++i) {
        PyObject* item = PyList_GET_ITEM(table, static_cast<Py_ssize_t>(ids[i]));
        Py_INCREF(item);
        PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), item);
    }
    return nb::steal(out);
}
}  // namespace

// alloc_items: n ids allocated as alloc_ids does, answered as `items[id]` for
// each (a list): the vLLM plugin passes its block objects and gets them back
// without building ids on either side.
nb::object alloc_items(Space& s, int64_t n, nb::handle items, bool promised) {
    check_items(s, items, "alloc_items");
    thread_local std::vector<int64_t> ids;
    ids.resize(static_cast<size_t>(n > 0 && n <= s.capacity() ? n : 0));
    int64_t available = 0;
    Status st = run_alloc(s, n, ids.data(), promised, &available);
    if (!st.is_ok()) return failed_alloc(s, std::move(st), available);
    return answer_items(s, n, items, ids.data());
}

// acquire: Space::acquire answered as alloc (ids) or alloc_items (items given).
nb::object acquire(Space& s, int64_t n, nb::handle items, bool promised, double stall, double timeout) {
    if (!items.is_none()) check_items(s, items, "acquire");
    int64_t* data = nullptr;
    std::vector<int64_t> scratch;
    nb::object ids;
    const int64_t len = n > 0 && n <= s.capacity() ? n : 0;
    if (items.is_none()) {
        ids = new_int64_array(len, &data);
    } else {
        scratch.resize(static_cast<size_t>(len));
        data = scratch.data();
    }
    int64_t available = 0;
    Status st = run_acquire(s, n, data, promised, stall, timeout, &available);
    if (!st.is_ok()) return failed_alloc(s, std::move(st), available);
    return items.is_none() ? ids : answer_items(s, n, items, data);
}

nb::object free_items(Space& s, nb::handle items, nb::handle attr, bool want_available) {
    int64_t n = 0;
    thread_local std::vector<int64_t> scratch;
    const int64_t* data = attr_ids(items, attr, &n, scratch);
    return free_ids(s, data, n, want_available);
}

int64_t available_now(Space& s) {
    int64_t a = 0;
    if (s.try_available(&a)) return a;  // the common case: the GIL held, no wait
    nb::gil_scoped_release nogil;
    return s.available();
}

}  // namespace kvpool::bind
