// PrivateUse1's c10::DeviceAllocator in C++, over the device's caching allocator; and the
// bridge through which every part of the allocator calls its Python side (python()).
//
// torch.accelerator's memory API (memory_stats, memory_allocated, max_memory_*,
// reset_*_memory_stats, empty_cache, get_memory_info) asks c10::getDeviceAllocator(), which
// dynamic_casts the allocator registered for the device type (c10::GetAllocator) to a
// c10::DeviceAllocator. A Python backend registers none (PyTorch's Python-backend set-up
// has no allocator to give, GetAllocator answers null), so those functions fail with
// "Allocator for sim is not a DeviceAllocator", and C++ that makes a device storage itself
// (torch._C.StorageBase.__new__, which torch.UntypedStorage(n, device=...) reaches without
// torchport's Python constructor) calls through a null allocator. This allocator serves them
// from the caching allocator (native_caching_allocator.cpp: the device's pools, in C++, once
// torchport_caching_enable() ran: allocate, free from the DataPtr's deleter, statistics and
// their resets without Python), and otherwise -- or for what needs the runtime: empty_cache,
// memory info, copies, record_stream -- calls a Python function that
// torchport.device.accelerator_memory sets, which acts on the device's allocator
// (torchport/memory/allocator.py), so torch.accelerator and torch.<device> report the same
// statistics, and a storage made here is a block of that allocator, counted as a tensor of
// its size.
//
// The functions are ctypes callbacks (each takes the GIL). Each answers 1, or 0 after
// torchport_allocator_fail() recorded the Python exception, which becomes the c10::Error of
// the same kind (OutOfMemoryError, AcceleratorError, ValueError...) with its message.
// Python's error indicator is saved around every call: a storage may die while an exception
// is in flight (the interpreter drops a call's arguments after the call raised), and a
// Python call made then would replace that exception with a SystemError.
// Built with the other csrc/*.cpp by torchport/core/native.py; enabled by
// torchport_allocator_enable().
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "native_allocator.h"
#include "native_layer.h"

using namespace torchport::alloc;

namespace {

using c10::CachingDeviceAllocator::DeviceStats;
// Above a default-priority registration made later (REGISTER_ALLOCATOR in a library loaded
// afterwards), which would take the device from the allocator that owns its memory.
constexpr uint8_t kPriority = 1;

// The statistics' layout, shared with torchport/device/accelerator_memory.py (STATS_LAYOUT): the
// nine stat arrays in DeviceStats order, each for the pools all, small_pool, large_pool
// (c10::CachingAllocator::StatType order), each current, peak, allocated, freed; then six
// counters; then oversize_allocations and oversize_segments, each with the four metrics.
constexpr int kArrays = 9;
constexpr int kPools = 3;
constexpr int kMetrics = 4;
constexpr int kCounters = 6;
constexpr int kStats = kArrays * kPools * kMetrics + kCounters + 2 * kMetrics;

constexpr int kCallbacks = sizeof(Callbacks) / sizeof(void*);

// The Python exception a callback reported, for the thread that called it.
struct Failure {
  int kind = kError;
  std::string message;
  bool set = false;
};
thread_local Failure failure;

[[noreturn]] void raise(const char* what, Failure f) {
  std::string msg = f.set ? std::move(f.message)
                          : std::string("torchport: the Python side of the device allocator "
                                        "failed in ") + what +
                                " (its traceback is printed above)";
  c10::SourceLocation loc{what, __FILE__, static_cast<uint32_t>(__LINE__)};
  switch (f.kind) {
    case kOutOfMemory: throw c10::OutOfMemoryError(loc, std::move(msg));
    case kAccelerator: throw c10::AcceleratorError(loc, 0, std::move(msg));
    case kValue: throw c10::ValueError(loc, std::move(msg));
    case kType: throw c10::TypeError(loc, std::move(msg));
    case kIndex: throw c10::IndexError(loc, std::move(msg));
    case kNotImplemented: throw c10::NotImplementedError(loc, std::move(msg));
    default: throw c10::Error(loc, std::move(msg));
  }
}

}  // namespace

namespace torchport::alloc {

Callbacks callbacks{};
std::atomic<bool> live{false};

void python(const char* what, c10::function_ref<int()> call) {
  torchport::CallbackInterrupts interrupts;
  int gil = callbacks.gil_ensure();
  void *type = nullptr, *value = nullptr, *traceback = nullptr;
  callbacks.err_fetch(&type, &value, &traceback);
  Failure outer = std::exchange(failure, Failure{});
  bool ok = call() == 1;
  Failure mine = std::exchange(failure, std::move(outer));
  callbacks.err_restore(type, value, traceback);
  callbacks.gil_release(gil);
  if (!ok) raise(what, std::move(mine));
}

c10::DeviceIndex current_device() {
  return c10::impl::getDeviceGuardImpl(kDevice)->getDevice().index();
}

}  // namespace torchport::alloc

namespace {

void check_live(const char* what) {
  TORCH_CHECK(live.load(), "torchport: ", what, " on the device after the interpreter began "
              "to exit (or before torchport registered the device)");
}

c10::DeviceIndex resolve(c10::DeviceIndex device) {
  return device < 0 ? current_device() : device;
}

void free_allocation(void* ctx) {
  auto* a = static_cast<Allocation*>(ctx);
  if (live.load()) {
    // The Python side prints its own errors, as for a __del__: a deleter cannot throw.
    try {
      python("free", [&] { return callbacks.free(a->device, a->ptr); });
    } catch (const c10::Error&) {
    }
  }
  delete a;
}

struct PythonDeviceAllocator final : public c10::DeviceAllocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DeviceIndex device = current_device();
    if (caching_on.load()) return cached_data_ptr(device, n, current_stream_id(device));
    c10::Device where(kDevice, device);
    if (n == 0) return {nullptr, nullptr, &free_allocation, where};
    check_live("allocate");
    uint64_t ptr = 0;
    python("allocate", [&] { return callbacks.allocate(device, n, &ptr); });
    auto* ctx = new Allocation{ptr, device};
    return {reinterpret_cast<void*>(ptr), ctx, &free_allocation, where};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count == 0) return;
    check_live("copy_data");
    // Device memory may not be host memory (the sim's strict mode): the runtime copies.
    python("copy_data", [&] {
      return callbacks.copy(reinterpret_cast<uint64_t>(dest), reinterpret_cast<uint64_t>(src),
                            count);
    });
  }

  bool initialized() override {
    if (!live.load()) return false;
    int out = 0;
    python("initialized", [&] { return callbacks.initialized(&out); });
    return out != 0;
  }

  void emptyCache(c10::MempoolId_t mempool_id) override {
    TORCH_CHECK(mempool_id == c10::MempoolId_t(0, 0),
                "torchport: the device has no private memory pools; call empty_cache() "
                "without a pool");
    check_live("emptyCache");
    python("emptyCache", [&] { return callbacks.empty_cache(); });
  }

  // PyTorch 2.13 sends Tensor.record_stream through the dispatcher (torchport's kernel);
  // this serves C++ that asks the allocator. A pointer the Python allocator does not
  // hand out is left alone, as that kernel leaves it.
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    if (!ptr.get() || ptr.device().type() != kDevice) return;
    TORCH_CHECK(stream.device_type() == kDevice, "torchport: record_stream of a ",
                ptr.device(), " block on a ", stream.device_type(), " stream");
    check_live("recordStream");
    int device = ptr.device().index() < 0 ? current_device() : ptr.device().index();
    python("recordStream", [&] {
      return callbacks.record_stream(device, reinterpret_cast<uint64_t>(ptr.get()),
                                     stream.device_index(), stream.id());
    });
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_live("getDeviceStats");
    int64_t v[kStats] = {};
    device = resolve(device);
    if (caching_on.load()) {  // the C++ pools' statistics, as torch.<device>.memory_stats()
      caching_of(device).read_stats(v, true);
      v[kArrays * kPools * kMetrics + kCounters - 1] = -1;  // max_split_size: none
    } else {
      python("getDeviceStats", [&] { return callbacks.stats(device, v, kStats); });
    }
    DeviceStats s;
    c10::CachingAllocator::StatArray* arrays[kArrays] = {
        &s.allocation,     &s.segment,        &s.active,
        &s.inactive_split, &s.allocated_bytes, &s.reserved_bytes,
        &s.active_bytes,   &s.inactive_split_bytes, &s.requested_bytes};
    const int64_t* p = v;
    auto fill = [&p](c10::CachingAllocator::Stat& st) {
      st.current = p[0];
      st.peak = p[1];
      st.allocated = p[2];
      st.freed = p[3];
      p += kMetrics;
    };
    for (auto* array : arrays)
      for (auto& st : *array) fill(st);
    s.num_alloc_retries = p[0];
    s.num_ooms = p[1];
    s.num_sync_all_streams = p[2];
    s.num_device_alloc = p[3];
    s.num_device_free = p[4];
    s.max_split_size = p[5];
    p += kCounters;
    fill(s.oversize_allocations);
    fill(s.oversize_segments);
    return s;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_live("resetAccumulatedStats");
    device = resolve(device);
    if (caching_on.load()) return caching_of(device).reset_accumulated();
    python("resetAccumulatedStats", [&] { return callbacks.reset_accumulated(device); });
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_live("resetPeakStats");
    device = resolve(device);
    if (caching_on.load()) return caching_of(device).reset_peak();
    python("resetPeakStats", [&] { return callbacks.reset_peak(device); });
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_live("getMemoryInfo");
    uint64_t free = 0, total = 0;
    device = resolve(device);
    python("getMemoryInfo", [&] { return callbacks.memory_info(device, &free, &total); });
    return {static_cast<size_t>(free), static_cast<size_t>(total)};
  }
};

// For the extern "C" entry points below, which ctypes calls: no C++ exception may cross.
thread_local std::string last_error;

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 1;
  } catch (const c10::Error& e) {
    last_error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    last_error = e.what();
  }
  return 0;
}

}  // namespace

// Never destroyed: storages may die while the process's static objects are torn down.
c10::Allocator* torchport::alloc::allocator() {
  static auto* a = new PythonDeviceAllocator();
  return a;
}

// Sets the Python side (`count` function pointers in Callbacks order) and registers this
// allocator for PrivateUse1: 1; 0 where another C++ allocator is registered for it already
// (it is kept); -1 where `count` is not this library's.
extern "C" int torchport_allocator_enable(void** functions, int count) {
  if (count != kCallbacks) return -1;
  c10::Allocator* registered = nullptr;
  try {
    registered = c10::GetAllocator(kDevice);
  } catch (const c10::Error&) {  // builds that check "is not set"
  }
  if (registered != nullptr && registered != allocator()) return 0;
  void** slots = reinterpret_cast<void**>(&callbacks);
  for (int i = 0; i < kCallbacks; ++i) slots[i] = functions[i];
  live.store(true);
  c10::SetAllocator(kDevice, allocator(), kPriority);
  return 1;
}

// The interpreter is exiting: no more calls into Python (see `live`).
extern "C" void torchport_allocator_detach() { live.store(false); }

// The number of statistics getDeviceStats reads (the layout's length).
extern "C" int torchport_allocator_stats_count() { return kStats; }

// Records the Python exception a callback is about to report by answering 0.
extern "C" void torchport_allocator_fail(int kind, const char* message) {
  failure.kind = kind;
  failure.message = message ? message : "";
  failure.set = true;
}

// The message of the last entry point below that answered 0, on this thread.
extern "C" const char* torchport_allocator_last_error() { return last_error.c_str(); }

// The registered allocator's recordStream for a block at `ptr` of device `device`, for C++
// callers without the allocator object and for tests: 1, or 0 (see last_error).
extern "C" int torchport_allocator_record_stream(uint64_t ptr, int device, int stream_device,
                                                 int64_t stream_id) {
  return guarded([&] {
    c10::DataPtr data(reinterpret_cast<void*>(ptr),
                      c10::Device(kDevice, static_cast<c10::DeviceIndex>(device)));
    c10::Stream stream(c10::Stream::UNSAFE,
                       c10::Device(kDevice, static_cast<c10::DeviceIndex>(stream_device)),
                       stream_id);
    c10::getDeviceAllocator(kDevice)->recordStream(data, stream);
  });
}

// The registered allocator's copy_data (what Allocator::clone copies with), likewise.
extern "C" int torchport_allocator_copy_data(uint64_t dest, uint64_t src, uint64_t count) {
  return guarded([&] {
    c10::getDeviceAllocator(kDevice)->copy_data(reinterpret_cast<void*>(dest),
                                                reinterpret_cast<const void*>(src), count);
  });
}
