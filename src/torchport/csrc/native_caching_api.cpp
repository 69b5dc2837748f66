// The caching allocator's C entry points, which torchport/memory/allocator.py
// (NativeAllocator) calls through ctypes: enabling and detaching the pools, malloc, free and
// adopt, statistics and their resets, empty_cache, configuration, and the views of the
// pools' state that its tests and snapshots read; and, where Python's headers are there,
// device tensors over new or adopted blocks in one call (through ctypes.PyDLL).
// Each answers 1 (or a value), or 0 after recording the error for torchport_caching_error:
// no C++ exception crosses into ctypes.
#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "native_allocator.h"
#include "native_layer.h"

using namespace torchport::alloc;

namespace {

// The last error of an entry point below, on this thread, and its ErrorKind.
thread_local std::string caching_error;
thread_local int caching_error_kind = 0;

template <typename F>
int caching_guarded(F&& f) {
  try {
    f();
    return 1;
  } catch (const c10::OutOfMemoryError& e) {
    caching_error = e.what_without_backtrace();
    caching_error_kind = kOutOfMemory;
  } catch (const c10::Error& e) {
    caching_error = e.what_without_backtrace();
    caching_error_kind = kError;
  } catch (const std::exception& e) {
    caching_error = e.what();
    caching_error_kind = kError;
  }
  return 0;
}

}  // namespace

// Sets Python's side (`count` pointers in CachingCallbacks order, then the interpreter's
// PyGILState_Ensure, PyGILState_Release, PyErr_Fetch, PyErr_Restore) and makes one caching
// allocator per visible device: 1; -1 where `count` is not this library's.
extern "C" int torchport_caching_enable(void** functions, int count, int devices,
                                        int asynchronous) {
  if (count != kCachingCallbacks + 4) return -1;
  void** slots = reinterpret_cast<void**>(&cc);
  for (int i = 0; i < kCachingCallbacks; ++i) slots[i] = functions[i];
  void** interpreter = functions + kCachingCallbacks;
  callbacks.gil_ensure = reinterpret_cast<int (*)()>(interpreter[0]);
  callbacks.gil_release = reinterpret_cast<void (*)(int)>(interpreter[1]);
  callbacks.err_fetch = reinterpret_cast<void (*)(void**, void**, void**)>(interpreter[2]);
  callbacks.err_restore = reinterpret_cast<void (*)(void*, void*, void*)>(interpreter[3]);
  auto& v = caching();
  while (static_cast<int>(v.size()) < devices) {
    auto* a = new CachingAllocator();
    a->device = static_cast<int>(v.size());
    v.push_back(a);
  }
  for (auto* a : v) a->asynchronous = asynchronous != 0;
  caching_on.store(true);
  return 1;
}

// The runtime's C query of `device`'s default stream (NativeCopies.query_default_stream:
// `fn(context, phys)`, 1 when that stream ran everything queued), asked before the runtime's
// Python query_stream for each block freed on an asynchronous device.
extern "C" int torchport_caching_set_default_stream_query(int device, void* fn, void* context,
                                                          int phys) {
  return caching_guarded([&] {
    CachingAllocator& a = caching_of(device);
    a.default_stream_context = context;
    a.phys = phys;
    a.default_stream_query = reinterpret_cast<int32_t (*)(void*, int32_t)>(fn);
  });
}

// The interpreter is exiting: blocks freed from now on stay with the process.
extern "C" void torchport_caching_detach() { caching_on.store(false); }

// The same from the interpreter's exit on; the pools stay for what Python still asks of them
// (a resize in a finaliser), their blocks kept to the end.
extern "C" void torchport_caching_at_exit() {
  caching_exiting.store(true);
  caching_on.store(false);
}

extern "C" const char* torchport_caching_error() { return caching_error.c_str(); }
extern "C" int torchport_caching_error_kind() { return caching_error_kind; }

// A block of at least `nbytes` on `stream` (a guard stream id): its address, 0 on error.
extern "C" uint64_t torchport_caching_malloc(int device, uint64_t nbytes, long long stream) {
  uint64_t ptr = 0;
  caching_guarded([&] { ptr = caching_of(device).malloc(nbytes, stream)->ptr; });
  return ptr;
}

extern "C" int torchport_caching_free(int device, uint64_t ptr) {
  return caching_guarded([&] { caching_of(device).free(ptr); });
}

// `nbytes` at `ptr` the runtime adopted from host memory: an allocated segment of its own.
extern "C" int torchport_caching_adopt(int device, uint64_t ptr, uint64_t nbytes,
                                       long long stream) {
  return caching_guarded([&] { caching_of(device).adopt(ptr, nbytes, stream); });
}

// The statistics (9 names x 3 pools x current, peak, allocated, freed; five counters);
// `refresh`: first merge the parked blocks and count the inactive split ones, as
// memory_stats() reports them.
extern "C" int torchport_caching_stats(int device, int64_t* out, int refresh) {
  return caching_guarded([&] { caching_of(device).read_stats(out, refresh != 0); });
}

extern "C" int torchport_caching_reset_peak(int device) {
  return caching_guarded([&] { caching_of(device).reset_peak(); });
}

extern "C" int torchport_caching_reset_accumulated(int device) {
  return caching_guarded([&] { caching_of(device).reset_accumulated(); });
}

// Every fully free segment back to the runtime (the caller synchronised the device).
extern "C" int torchport_caching_empty_cache(int device) {
  return caching_guarded([&] { caching_of(device).empty_cache(); });
}

// set_per_process_memory_fraction's limit in bytes (negative: none); the parking cap.
extern "C" int torchport_caching_configure(int device, double limit, long long max_parked) {
  return caching_guarded([&] {
    auto& a = caching_of(device);
    Locked l(a);
    a.limit = limit;
    a.max_parked = static_cast<uint64_t>(max_parked < 0 ? 0 : max_parked);
  });
}

// num_parked, full, active blocks, pending blocks, segments, parked keys, slow mallocs.
extern "C" int torchport_caching_counts(int device, int64_t* out) {
  return caching_guarded([&] {
    auto& a = caching_of(device);
    Locked l(a);
    int64_t pending = 0;
    for (auto& q : a.pending) pending += static_cast<int64_t>(q.second.size());
    out[0] = static_cast<int64_t>(a.num_parked);
    out[1] = a.full;
    out[2] = static_cast<int64_t>(a.active.size());
    out[3] = pending;
    out[4] = static_cast<int64_t>(a.segments.size());
    out[5] = static_cast<int64_t>(a.parked.size());
    out[6] = a.slow_mallocs;
  });
}

// What: 0 active addresses; 1 pending addresses; 2 segments (address, size, small);
// 3 parked lists (stream, size, count) in their order; 4 snapshot: per segment (address,
// size, small, n) then n blocks (address, size, allocated, requested). Writes at most
// `cap` values; returns how many there are (-1 on error).
extern "C" long long torchport_caching_list(int device, int what, int64_t* out, long long cap) {
  long long n = 0;
  auto put = [&](int64_t v) {
    if (n < cap) out[n] = v;
    ++n;
  };
  int ok = caching_guarded([&] {
    auto& a = caching_of(device);
    Locked l(a);
    if (what == 0) {
      for (auto& [ptr, b] : a.active) put(static_cast<int64_t>(ptr));
    } else if (what == 1) {
      for (auto& q : a.pending)
        for (auto& e : q.second) put(static_cast<int64_t>(e.first->ptr));
    } else if (what == 2) {
      for (auto& [ptr, seg] : a.segments) {
        put(static_cast<int64_t>(ptr));
        put(static_cast<int64_t>(seg.size));
        put(seg.small);
      }
    } else if (what == 3) {
      for (auto& it : a.parked_in_order(0, true)) {
        put(it->first.first);
        put(static_cast<int64_t>(it->first.second));
        put(static_cast<int64_t>(it->second.second.size()));
      }
    } else if (what == 4) {
      a.unpark_all();
      for (auto& [ptr, seg] : a.segments) {
        Block* first = nullptr;
        auto found = a.active.find(ptr);
        if (found != a.active.end()) first = found->second;
        for (Pool* p : {&a.small_pool, &a.large_pool})
          for (Block* b : p->blocks)
            if (!first && b->ptr == ptr) first = b;
        std::vector<Block*> blocks;
        uint64_t total = 0;
        for (Block* b = first; b && total < seg.size; b = b->next) {
          blocks.push_back(b);
          total += b->size;
        }
        put(static_cast<int64_t>(ptr));
        put(static_cast<int64_t>(seg.size));
        put(seg.small);
        put(static_cast<int64_t>(blocks.size()));
        for (Block* b : blocks) {
          put(static_cast<int64_t>(b->ptr));
          put(static_cast<int64_t>(b->size));
          put(b->allocated);
          put(static_cast<int64_t>(b->allocated ? b->requested : 0));
        }
      }
    }
  });
  return ok ? n : -1;
}

// The allocated (or pending) block at `ptr`: size, requested, stream, adopted, number of
// stream uses, then (device, stream) per use, at most `cap` values; 0 where none is there.
extern "C" long long torchport_caching_block(int device, uint64_t ptr, int64_t* out,
                                             long long cap) {
  long long n = 0;
  caching_guarded([&] {
    auto& a = caching_of(device);
    Locked l(a);
    Block* b = nullptr;
    auto it = a.active.find(ptr);
    if (it != a.active.end()) b = it->second;
    if (!b) return;
    std::vector<int64_t> v{static_cast<int64_t>(b->size), static_cast<int64_t>(b->requested),
                           b->stream, b->adopted,
                           static_cast<int64_t>(b->stream_uses.size())};
    for (auto& [index, stream] : b->stream_uses) {
      v.push_back(index);
      v.push_back(stream);
    }
    for (int64_t x : v) {
      if (n < cap) out[n] = x;
      ++n;
    }
  });
  return n;
}

// Tensor.record_stream: the block at `ptr` waits, when freed, for the work queued so far on
// stream `stream` of device `stream_device`: 1, or 0 where no block of this allocator is there.
extern "C" int torchport_caching_record_use(int device, uint64_t ptr, int stream_device,
                                            long long stream) {
  int found = 0;
  caching_guarded([&] {
    auto& a = caching_of(device);
    Locked l(a);
    auto it = a.active.find(ptr);
    if (it == a.active.end()) return;
    found = 1;
    Block* b = it->second;
    if (stream_device == device && stream == b->stream) return;  // ordered already
    std::pair<int, int64_t> use{stream_device, stream};
    if (std::find(b->stream_uses.begin(), b->stream_uses.end(), use) == b->stream_uses.end())
      b->stream_uses.push_back(use);
  });
  return found;
}

#if __has_include(<Python.h>)
#include <ATen/core/Tensor.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {
// A tensor layout from Python (a torch.dtype, sizes, strides); false with a Python error.
bool read_layout(PyObject* dtype, PyObject* size, PyObject* stride, c10::ScalarType& scalar,
                 std::vector<int64_t>& sizes, std::vector<int64_t>& strides) {
  if (!torchport::read_ints(size, sizes) || !torchport::read_ints(stride, strides)) return false;
  if (!THPDtype_Check(dtype)) {
    PyErr_SetString(PyExc_TypeError, "expected a torch.dtype");
    return false;
  }
  scalar = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  return true;
}
}  // namespace

// A device tensor of `dtype`, `size` and `stride` over a new block of `nbytes` on `stream`
// of device `device`, returned to the pool by its storage's deleter: one call, no Python
// object for the block. None where the allocator failed (torchport_caching_error says why);
// NULL with a Python error for arguments it cannot read. Called through ctypes.PyDLL.
extern "C" PyObject* torchport_caching_new_tensor(int device, uint64_t nbytes, PyObject* dtype,
                                                  PyObject* size, PyObject* stride,
                                                  long long stream) {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType scalar;
  if (!read_layout(dtype, size, stride, scalar, sizes, strides)) return nullptr;
  at::Tensor t;
  int ok = caching_guarded(
      [&] { t = torchport::caching_new_tensor(device, nbytes, scalar, sizes, strides, stream); });
  if (!ok) Py_RETURN_NONE;
  return THPVariable_Wrap(std::move(t));
}

// A device tensor over `nbytes` at `ptr`, host memory the runtime adopted as device memory:
// an allocated segment of its own on `stream`, whose storage's deleter returns it (the
// runtime's `free` then gives the memory back to the host), as a new block's does. None
// where the allocator failed; NULL with a Python error for arguments it cannot read.
extern "C" PyObject* torchport_caching_adopted_tensor(int device, uint64_t ptr, uint64_t nbytes,
                                                      PyObject* dtype, PyObject* size,
                                                      PyObject* stride, long long stream) {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType scalar;
  if (!read_layout(dtype, size, stride, scalar, sizes, strides)) return nullptr;
  at::Tensor t;
  int ok = caching_guarded([&] {
    caching_of(device).adopt(ptr, nbytes, stream);
    t = tensor_over(block_data_ptr(ptr, device), nbytes,
                    c10::scalarTypeToTypeMeta(scalar), sizes, strides);
  });
  if (!ok) Py_RETURN_NONE;
  return THPVariable_Wrap(std::move(t));
}
#endif
