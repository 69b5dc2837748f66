// PrivateUse1's c10::DeviceAllocator in C++, over the device's caching allocator.
//
// torch.accelerator's memory API (memory_stats, memory_allocated, max_memory_*,
// reset_*_memory_stats, empty_cache, get_memory_info) asks c10::getDeviceAllocator(), which
// dynamic_casts the allocator registered for the device type (c10::GetAllocator) to a
// c10::DeviceAllocator. A Python backend registers none (PyTorch's Python-backend set-up
// has no allocator to give, GetAllocator answers null), so those functions fail with
// "Allocator for sim is not a DeviceAllocator", and C++ that makes a device storage itself
// (torch._C.StorageBase.__new__, which torch.UntypedStorage(n, device=...) reaches without
// torchport's Python constructor) calls through a null allocator. This allocator serves them
// from the caching allocator below (the device's pools, in C++, once
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
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "native_layer.h"

namespace {

using c10::CachingDeviceAllocator::DeviceStats;
constexpr auto kDevice = c10::DeviceType::PrivateUse1;
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

// The Python functions, in the order torchport/device/accelerator_memory.py passes them.
struct Callbacks {
  int (*allocate)(int device, uint64_t nbytes, uint64_t* ptr);
  int (*free)(int device, uint64_t ptr);
  int (*stats)(int device, int64_t* out, int count);
  int (*reset_peak)(int device);
  int (*reset_accumulated)(int device);
  int (*empty_cache)();
  int (*memory_info)(int device, uint64_t* free, uint64_t* total);
  int (*initialized)(int* out);
  int (*record_stream)(int device, uint64_t ptr, int stream_device, int64_t stream_id);
  int (*copy)(uint64_t dest, uint64_t src, uint64_t count);
  // The interpreter's own, for the error indicator (see above).
  int (*gil_ensure)();
  void (*gil_release)(int);
  void (*err_fetch)(void**, void**, void**);
  void (*err_restore)(void*, void*, void*);
};
constexpr int kCallbacks = sizeof(Callbacks) / sizeof(void*);

Callbacks callbacks{};
// False until enabled, and again from the interpreter's exit on: a storage that dies then
// keeps its block (the process is ending) rather than calling into a finalizing interpreter.
std::atomic<bool> live{false};

// The Python exception a callback reported, for the thread that called it.
enum ErrorKind { kError = 0, kOutOfMemory, kAccelerator, kValue, kType, kIndex,
                 kNotImplemented };
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

// Runs `call` (which invokes one callback) with the GIL held and Python's error indicator
// saved; where it did not answer 1, throws the c10::Error of the exception it reported. A
// call made inside another (a storage freed while Python runs for an allocation) keeps the
// outer call's report.
template <typename F>
void python(const char* what, F&& call) {
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

void check_live(const char* what) {
  TORCH_CHECK(live.load(), "torchport: ", what, " on the device after the interpreter began "
              "to exit (or before torchport registered the device)");
}

c10::DeviceIndex current_device() {
  return c10::impl::getDeviceGuardImpl(kDevice)->getDevice().index();
}

c10::DeviceIndex resolve(c10::DeviceIndex device) {
  return device < 0 ? current_device() : device;
}

// A block's owner in its DataPtr: what the deleter returns to the Python allocator.
struct Allocation {
  uint64_t ptr;
  int device;
};

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

}  // namespace

// ---- the caching allocator in C++ ----------------------------------------------------
//
// The device's caching allocator (the Python one of torchport/memory/allocator.py, the same
// rules): segments from the runtime (a Python callback: the runtime is Python), carved into
// blocks by CUDA's size classes, pools and split rules, free blocks parked for an
// exact-size reuse (capped), statistics named and counted as CUDA's. Allocations and frees
// stay in C++: a storage's DataPtr returns its block from its deleter. Python is entered
// only for a new or returned segment, an out-of-memory message, a device synchronize, and
// the events of stream-aware freeing (through the device guard's stream layer).

namespace {

constexpr uint64_t kMinBlock = 512;
constexpr uint64_t kSmallSize = 1 << 20;
constexpr uint64_t kSmallBuffer = 2 << 20;
constexpr uint64_t kLargeBuffer = 20 << 20;
constexpr uint64_t kMinLargeAlloc = 10 << 20;
constexpr uint64_t kRoundLarge = 2 << 20;
constexpr uint64_t kParkFloor = 8 << 20;

// the guard's stream-layer operations used here (native_guard.cpp's Op)
constexpr int kQueryStream = 1, kEventCreate = 4, kEventRecord = 5, kEventQuery = 7,
              kEventDestroy = 10;

// A call into the stream layer (events, stream queries), with Python's error indicator
// saved around it as python() saves it: a block may be freed while an exception is in flight.
int stream_layer(int op, long long a, long long b, long long c, long long* iout) {
  int gil = callbacks.gil_ensure();
  void *type = nullptr, *value = nullptr, *traceback = nullptr;
  callbacks.err_fetch(&type, &value, &traceback);
  int rc = 0;
  try {
    rc = torchport::guard_call(op, a, b, c, iout);
  } catch (...) {
    callbacks.err_restore(type, value, traceback);
    callbacks.gil_release(gil);
    throw;
  }
  callbacks.err_restore(type, value, traceback);
  callbacks.gil_release(gil);
  return rc;
}

// The statistics, DeviceStats order (names) x StatType order (pools).
enum StatName { ALLOCATION = 0, SEGMENT, ACTIVE, INACTIVE_SPLIT, ALLOCATED_BYTES,
                RESERVED_BYTES, ACTIVE_BYTES, INACTIVE_SPLIT_BYTES, REQUESTED_BYTES };
constexpr int kNames = 9;
constexpr int kCounterCount = 5;  // retries, ooms, sync_all_streams, device_alloc, device_free

struct CStat {
  int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void add(int64_t n) {
    current += n;
    if (n > 0) allocated += n; else freed -= n;
    if (current > peak) peak = current;
  }
};

struct Block {
  uint64_t ptr;
  uint64_t size;
  uint64_t segment_size;
  bool small;
  int64_t stream;  // the guard's stream id the block was allocated on (0: default)
  bool allocated = false;
  uint64_t requested = 0;
  Block* prev = nullptr;
  Block* next = nullptr;
  bool parked = false;
  bool adopted = false;
  std::vector<std::pair<int, int64_t>> stream_uses;  // (device index, stream id)
};

struct BlockLess {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->ptr < b->ptr;
  }
};

struct Pool {
  std::set<Block*, BlockLess> blocks;
  Block* best_fit(int64_t stream, uint64_t size) {
    Block key{0, size, 0, false, stream};
    key.ptr = 0;
    auto it = blocks.lower_bound(&key);
    if (it != blocks.end() && (*it)->stream == stream) return *it;
    return nullptr;
  }
};

struct Segment {
  uint64_t size;
  bool small;
};

// Python's side of the caching allocator (torchport/memory/allocator.py, NativeAllocator).
struct CachingCallbacks {
  int (*segment_malloc)(int device, uint64_t nbytes, uint64_t* ptr);  // *ptr = 0: no room
  int (*segment_free)(int device, uint64_t ptr, uint64_t nbytes);
  int (*synchronize)(int device);
  int (*out_of_memory)(int device, uint64_t requested);  // reports torch.OutOfMemoryError
  int (*gil_check)();
  void* (*save_thread)();
  void (*restore_thread)(void*);
};
constexpr int kCachingCallbacks = sizeof(CachingCallbacks) / sizeof(void*);
CachingCallbacks cc{};
std::atomic<bool> caching_on{false};
std::atomic<bool> caching_exiting{false};  // detached by the exit handler

// A device's allocator lock. Python is called with it held (segments, events); a thread
// holding the GIL that must wait for it lets the GIL go while it waits, so that the
// holder's Python call can run. Recursive: a Python call may drop a storage of the
// device; that free is deferred to the end of the outer operation.

struct CachingAllocator;
struct Locked {
  CachingAllocator& a;
  explicit Locked(CachingAllocator& alloc);
  ~Locked();
};

struct CachingAllocator {
  int device = 0;
  bool asynchronous = false;
  double limit = -1;  // set_per_process_memory_fraction's bytes (-1: none)
  uint64_t max_parked = 256;
  std::recursive_mutex mutex;
  Pool small_pool, large_pool;
  std::unordered_map<uint64_t, Block*> active;
  std::map<uint64_t, Segment> segments;
  // (stream, size) -> parked blocks, with the order the keys were made (Python dict order)
  std::map<std::pair<int64_t, uint64_t>, std::pair<uint64_t, std::vector<Block*>>> parked;
  uint64_t parked_seq = 0;
  uint64_t num_parked = 0;
  uint64_t parked_bytes[2] = {0, 0};  // large, small
  bool full = false;
  // freed blocks waiting for events, one queue per allocation stream (insertion order)
  std::vector<std::pair<int64_t, std::deque<std::pair<Block*, std::vector<long long>>>>>
      pending;
  int depth = 0;  // operations of the thread holding the mutex (it alone changes this)
  std::vector<uint64_t> deferred;  // frees that arrived during an operation of that thread
  CStat stats[kNames][3];
  int64_t counters[kCounterCount] = {};
  int64_t slow_mallocs = 0;  // requests an exact-size parked block did not serve

  Pool& pool(bool small) { return small ? small_pool : large_pool; }

  void stat(bool small, StatName name, int64_t n) {
    stats[name][0].add(n);
    stats[name][small ? 1 : 2].add(n);
  }

  static uint64_t round(uint64_t n) {
    return n < kMinBlock ? kMinBlock : (n + kMinBlock - 1) / kMinBlock * kMinBlock;
  }
  static uint64_t segment_size(uint64_t size) {
    if (size <= kSmallSize) return kSmallBuffer;
    if (size < kMinLargeAlloc) return kLargeBuffer;
    return (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
  }

  // ---- allocation --------------------------------------------------------------------
  Block* malloc(uint64_t nbytes, int64_t stream) {
    Locked l(*this);
    uint64_t size = round(nbytes);
    if (num_parked) {
      if (Block* b = pop_parked(stream, size)) return hand_out(b, nbytes);
    }
    slow_mallocs += 1;
    bool small = size <= kSmallSize;
    Pool& p = pool(small);
    if (!pending.empty()) process_pending(false);
    if (num_parked) {
      if (Block* b = pop_parked(stream, size)) return hand_out(b, nbytes);
    }
    Block* block = p.best_fit(stream, size);
    Block* fresh = nullptr;
    if (block == nullptr && num_parked) {
      if (small && !full) fresh = new_segment(size, small, stream, false);
      if (fresh == nullptr) block = unpark_for(small, stream, size);
    }
    if (block != nullptr && oversize(block, size)) block = nullptr;
    if (block == nullptr) {
      block = fresh;
      if (!block) block = new_segment(size, small, stream, false);
      if (!block) block = from_cache(p, stream, size, false);
      if (!block) block = new_segment(size, small, stream, true);
      if (!block) block = from_cache(p, stream, size, true);
      if (!block) {
        counters[1] += 1;
        python("out of memory", [&] { return cc.out_of_memory(device, nbytes); });
        throw c10::OutOfMemoryError({"malloc", __FILE__, __LINE__},
                                    "out of memory");  // (the callback raised already)
      }
    } else {
      p.blocks.erase(block);
    }
    maybe_split(block, size, p);
    return hand_out(block, nbytes);
  }

  Block* pop_parked(int64_t stream, uint64_t size) {
    auto it = parked.find({stream, size});
    if (it == parked.end() || it->second.second.empty()) return nullptr;
    Block* b = it->second.second.back();
    it->second.second.pop_back();
    b->parked = false;
    num_parked -= 1;
    parked_bytes[b->small] -= b->size;
    return b;
  }

  Block* hand_out(Block* b, uint64_t nbytes) {
    b->allocated = true;
    b->requested = nbytes;
    active[b->ptr] = b;
    int64_t s = static_cast<int64_t>(b->size);
    stat(b->small, ALLOCATION, 1);
    stat(b->small, ACTIVE, 1);
    stat(b->small, ALLOCATED_BYTES, s);
    stat(b->small, ACTIVE_BYTES, s);
    stat(b->small, REQUESTED_BYTES, static_cast<int64_t>(nbytes));
    return b;
  }

  Block* from_cache(Pool& p, int64_t stream, uint64_t size, bool allow_oversize) {
    unpark_all();
    Block* b = p.best_fit(stream, size);
    if (b && !allow_oversize && oversize(b, size)) return nullptr;
    if (b) p.blocks.erase(b);
    return b;
  }

  static bool oversize(const Block* b, uint64_t size) {
    return !b->small && b->size >= size + kLargeBuffer && b->size > 2 * size;
  }

  void maybe_split(Block* b, uint64_t size, Pool& p) {
    uint64_t remaining = b->size - size;
    uint64_t threshold = b->small ? kMinBlock : kSmallSize;
    if (remaining < threshold) return;
    auto* rest = new Block{b->ptr + size, remaining, b->segment_size, b->small, b->stream};
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    p.blocks.insert(rest);
  }

  uint64_t reserved() const { return static_cast<uint64_t>(stats[RESERVED_BYTES][0].current); }

  uint64_t device_malloc(uint64_t seg) {
    if (limit >= 0 && static_cast<double>(reserved() + seg) > limit) return 0;
    uint64_t ptr = 0;
    python("segment malloc", [&] { return cc.segment_malloc(device, seg, &ptr); });
    return ptr;
  }

  Block* new_segment(uint64_t size, bool small, int64_t stream, bool retry) {
    uint64_t seg = segment_size(size);
    uint64_t ptr = device_malloc(seg);
    if (!ptr) full = true;
    if (!ptr && retry) {
      counters[0] += 1;
      python("synchronize", [&] { return cc.synchronize(device); });
      process_pending(true);
      release_free_segments();
      ptr = device_malloc(seg);
    }
    if (!ptr) return nullptr;
    counters[3] += 1;
    auto* b = new Block{ptr, seg, seg, small, stream};
    segments[ptr] = {seg, small};
    stat(small, SEGMENT, 1);
    stat(small, RESERVED_BYTES, static_cast<int64_t>(seg));
    return b;
  }

  Block* adopt(uint64_t ptr, uint64_t nbytes, int64_t stream) {
    Locked l(*this);
    counters[3] += 1;
    auto* b = new Block{ptr, nbytes, nbytes, false, stream};
    b->adopted = true;
    segments[ptr] = {nbytes, false};
    stat(false, SEGMENT, 1);
    stat(false, RESERVED_BYTES, static_cast<int64_t>(nbytes));
    return hand_out(b, nbytes);
  }

  // Is `ptr` a block this allocator handed out and still holds?
  bool owns(uint64_t ptr) {
    Locked l(*this);
    return active.count(ptr) != 0;
  }

  // ---- freeing ------------------------------------------------------------------------
  void free(uint64_t ptr) {
    Locked l(*this);
    if (depth > 1) {  // a free reached from Python this allocator called: after the operation
      deferred.push_back(ptr);
      return;
    }
    free_locked(ptr);
  }

  void free_locked(uint64_t ptr) {
    if (!pending.empty()) process_pending(false);
    auto it = active.find(ptr);
    TORCH_CHECK(it != active.end(), "torchport: no block of device ", device, " at ", ptr);
    Block* b = it->second;
    active.erase(it);
    std::vector<long long> events;
    if (!b->stream_uses.empty() || asynchronous) events = free_events(b);
    int64_t s = static_cast<int64_t>(b->size);
    stat(b->small, ALLOCATION, -1);
    stat(b->small, ALLOCATED_BYTES, -s);
    stat(b->small, REQUESTED_BYTES, -static_cast<int64_t>(b->requested));
    if (!events.empty()) {
      auto q = std::find_if(pending.begin(), pending.end(),
                            [&](const auto& e) { return e.first == b->stream; });
      if (q == pending.end()) {
        pending.emplace_back(b->stream, std::deque<std::pair<Block*, std::vector<long long>>>{});
        q = pending.end() - 1;
      }
      q->second.emplace_back(b, std::move(events));
      return;
    }
    release_block(b);
  }

  long long record(int index, int64_t stream) {
    long long eid = 0;
    stream_layer(kEventCreate, index, 0, 0, &eid);
    stream_layer(kEventRecord, eid, index, stream, nullptr);
    return eid;
  }

  std::vector<long long> free_events(Block* b) {
    std::vector<long long> events;
    for (auto& [index, stream] : b->stream_uses) events.push_back(record(index, stream));
    b->stream_uses.clear();
    if (asynchronous && stream_layer(kQueryStream, device, b->stream, 0, nullptr) != 1)
      events.push_back(record(device, b->stream));
    return events;
  }

  bool may_park(const Block* b) {
    bool small = b->small;
    if (num_parked >= max_parked || (full && !small)) return false;
    uint64_t held = parked_bytes[small] + b->size;
    if (held <= kParkFloor) return true;
    if (full) return false;
    const CStat& alloc = stats[ALLOCATED_BYTES][small ? 1 : 2];
    return static_cast<int64_t>(held) <= 2 * std::max(alloc.peak, alloc.current);
  }

  void park(Block* b) {
    b->parked = true;
    auto [it, made] = parked.try_emplace({b->stream, b->size});
    if (made) it->second.first = parked_seq++;
    it->second.second.push_back(b);
    num_parked += 1;
    parked_bytes[b->small] += b->size;
  }

  // the parked lists in the order their keys were made
  std::vector<decltype(parked)::iterator> parked_in_order(int64_t only_stream, bool all) {
    std::vector<decltype(parked)::iterator> out;
    for (auto it = parked.begin(); it != parked.end(); ++it)
      if (all || it->first.first == only_stream) out.push_back(it);
    std::sort(out.begin(), out.end(),
              [](const auto& x, const auto& y) { return x->second.first < y->second.first; });
    return out;
  }

  void unpark_all() {
    if (!num_parked) return;
    std::vector<Block*> blocks;
    for (auto& it : parked_in_order(0, true))
      for (Block* b : it->second.second) blocks.push_back(b);
    parked.clear();
    num_parked = 0;
    parked_bytes[0] = parked_bytes[1] = 0;
    for (Block* b : blocks) {
      b->parked = false;
      return_to_pool(b);
    }
  }

  Block* unpark_for(bool small, int64_t stream, uint64_t size) {
    for (auto& it : parked_in_order(stream, false)) {
      auto& lst = it->second.second;
      while (!lst.empty()) {
        Block* b = lst.back();
        if (b->small != small) break;
        lst.pop_back();
        num_parked -= 1;
        parked_bytes[b->small] -= b->size;
        b->parked = false;
        return_to_pool(b);
        if (b->size >= size) {
          if (lst.empty()) parked.erase(it);
          return pool(small).best_fit(stream, size);
        }
      }
      if (lst.empty()) parked.erase(it);
    }
    return nullptr;
  }

  void process_pending(bool force) {
    for (size_t i = 0; i < pending.size();) {
      auto& q = pending[i].second;
      while (!q.empty()) {
        auto& events = q.front().second;
        bool done = force || std::all_of(events.begin(), events.end(), [](long long e) {
                      return stream_layer(kEventQuery, e, 0, 0, nullptr) == 1;
                    });
        if (!done) break;
        Block* b = q.front().first;
        std::vector<long long> ev = std::move(events);
        q.pop_front();
        for (long long e : ev) stream_layer(kEventDestroy, e, 0, 0, nullptr);
        release_block(b);
      }
      if (q.empty()) pending.erase(pending.begin() + static_cast<long>(i));
      else ++i;
    }
  }

  void release_block(Block* b) {
    int64_t s = static_cast<int64_t>(b->size);
    stat(b->small, ACTIVE, -1);
    stat(b->small, ACTIVE_BYTES, -s);
    b->allocated = false;
    if (b->adopted) {
      segments.erase(b->ptr);
      release_segment(b->ptr, b->size, b->small);
      delete b;
      return;
    }
    if (may_park(b)) {
      park(b);
      return;
    }
    return_to_pool(b);
  }

  void release_segment(uint64_t ptr, uint64_t size, bool small) {
    python("segment free", [&] { return cc.segment_free(device, ptr, size); });
    counters[4] += 1;
    stat(small, SEGMENT, -1);
    stat(small, RESERVED_BYTES, -static_cast<int64_t>(size));
  }

  bool mergeable(const Block* nb) const {
    return nb != nullptr && !nb->allocated && !nb->parked && !active.count(nb->ptr);
  }

  void return_to_pool(Block* b) {
    Pool& p = pool(b->small);
    Block* prev = b->prev;
    Block* next = b->next;
    if (mergeable(prev)) merge(b, prev, p);
    if (mergeable(next)) merge(b, next, p);
    p.blocks.insert(b);
  }

  static void merge(Block* dst, Block* src, Pool& p) {
    p.blocks.erase(src);
    if (src == dst->prev) {
      dst->ptr = src->ptr;
      dst->prev = src->prev;
      if (dst->prev) dst->prev->next = dst;
    } else {
      dst->next = src->next;
      if (dst->next) dst->next->prev = dst;
    }
    dst->size += src->size;
    delete src;
  }

  void recount_inactive_split() {
    int64_t count[3] = {0, 0, 0}, bytes[3] = {0, 0, 0};
    for (Pool* p : {&small_pool, &large_pool})
      for (Block* b : p->blocks)
        if (b->prev || b->next)
          for (int pool_index : {0, b->small ? 1 : 2}) {
            count[pool_index] += 1;
            bytes[pool_index] += static_cast<int64_t>(b->size);
          }
    for (int i = 0; i < 3; ++i) {
      if (count[i] != stats[INACTIVE_SPLIT][i].current)
        stats[INACTIVE_SPLIT][i].add(count[i] - stats[INACTIVE_SPLIT][i].current);
      if (bytes[i] != stats[INACTIVE_SPLIT_BYTES][i].current)
        stats[INACTIVE_SPLIT_BYTES][i].add(bytes[i] - stats[INACTIVE_SPLIT_BYTES][i].current);
    }
  }

  // every fully free segment back to the runtime (the caller synchronised the device)
  void release_free_segments() {
    process_pending(false);
    unpark_all();
    for (Pool* p : {&small_pool, &large_pool}) {
      std::vector<Block*> whole;
      for (Block* b : p->blocks)
        if (!b->prev && !b->next && b->size == b->segment_size) whole.push_back(b);
      for (Block* b : whole) {
        p->blocks.erase(b);
        segments.erase(b->ptr);
        release_segment(b->ptr, b->size, b->small);
        delete b;
      }
    }
    recount_inactive_split();
  }

  void empty_cache() {
    Locked l(*this);
    release_free_segments();
    full = false;
  }

  // the statistics, kNames x 3 pools x 4 metrics, then the five counters
  void read_stats(int64_t* out, bool refresh) {
    Locked l(*this);
    if (refresh) {
      unpark_all();
      recount_inactive_split();
    }
    for (auto& name : stats)
      for (auto& s : name) {
        *out++ = s.current;
        *out++ = s.peak;
        *out++ = s.allocated;
        *out++ = s.freed;
      }
    for (int64_t c : counters) *out++ = c;
  }

  void reset_peak() {
    Locked l(*this);
    for (auto& name : stats)
      for (auto& s : name) s.peak = s.current;
  }

  void reset_accumulated() {
    Locked l(*this);
    for (auto& name : stats)
      for (auto& s : name) s.allocated = s.freed = 0;
    for (auto& c : counters) c = 0;
  }

  void drain_deferred() {
    while (!deferred.empty()) {
      uint64_t ptr = deferred.back();
      deferred.pop_back();
      try {
        free_locked(ptr);
      } catch (const c10::Error&) {
      }
    }
  }
};

Locked::Locked(CachingAllocator& alloc) : a(alloc) {
  if (!a.mutex.try_lock()) {
    if (cc.gil_check && cc.gil_check()) {
      void* state = cc.save_thread();
      a.mutex.lock();
      cc.restore_thread(state);
    } else {
      a.mutex.lock();
    }
  }
  ++a.depth;
}

Locked::~Locked() {
  if (a.depth == 1 && !a.deferred.empty()) {
    ++a.depth;
    a.drain_deferred();
    --a.depth;
  }
  --a.depth;
  a.mutex.unlock();
}

// Never destroyed (storages may die while static objects are torn down).
std::vector<CachingAllocator*>& caching() {
  static auto* v = new std::vector<CachingAllocator*>();
  return *v;
}

CachingAllocator& caching_of(int device) {
  auto& v = caching();
  if (device < 0 || device >= static_cast<int>(v.size()))
    throw c10::AcceleratorError(
        {"caching_of", __FILE__, static_cast<uint32_t>(__LINE__)}, 0,
        "torchport: invalid device ordinal " + std::to_string(device) + "; " +
            std::to_string(v.size()) +
            " device(s) of this type are visible (TORCHPORT_VISIBLE_DEVICES)");
  return *v[device];
}

// A deleter returns block `ptr` of `device` (no-op once the process is ending: the
// runtime is gone); a deleter cannot throw: reported as Python reports an exception in
// __del__.
void free_block(int device, uint64_t ptr) {
  if (!caching_on.load()) return;
  try {
    caching_of(device).free(ptr);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "Exception ignored in torchport's device allocator: %s\n",
                 e.what_without_backtrace());
  }
}

void free_cached(void* ctx) {
  auto* a = static_cast<Allocation*>(ctx);
  free_block(a->device, a->ptr);
  delete a;
}

int64_t current_stream_id(c10::DeviceIndex device) {
  return c10::impl::getDeviceGuardImpl(kDevice)
      ->getStream(c10::Device(kDevice, device))
      .id();
}

// The DataPtr of a device storage holding block `ptr` of `device`: its deleter returns it.
c10::DataPtr block_data_ptr(uint64_t ptr, int device) {
  return {reinterpret_cast<void*>(ptr), new Allocation{ptr, device}, &free_cached,
          c10::Device(kDevice, static_cast<c10::DeviceIndex>(device))};
}

c10::DataPtr cached_data_ptr(int device, uint64_t nbytes, int64_t stream) {
  c10::Device where(kDevice, static_cast<c10::DeviceIndex>(device));
  if (nbytes == 0) return {nullptr, nullptr, &free_cached, where};
  return block_data_ptr(caching_of(device).malloc(nbytes, stream)->ptr, device);
}

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

namespace {

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

// Never destroyed: storages may die while the process's static objects are torn down.
PythonDeviceAllocator* allocator() {
  static auto* a = new PythonDeviceAllocator();
  return a;
}

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

// ---- the caching allocator's entry points (torchport/memory/allocator.py, NativeAllocator) --------
// Each answers 1 (or a value), or 0 after recording the error for torchport_caching_error.

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

// ---- for the other parts of the library ------------------------------------------------
// A device tensor over a new block (native_factories.cpp, torchport_caching_new_tensor) and
// a device storage resized in place (native_hooks.cpp's resizePrivateUse1Bytes).

// Python's side of a resize: the block at `ptr` of `device` that a storage made in Python
// held (a weak reference frees it, torchport/memory/tensors.py watch) leaves that storage now.
using ReleaseBlock = int (*)(int device, uint64_t ptr);
std::atomic<ReleaseBlock> release_block_cb{nullptr};

namespace torchport {

bool caching_serves() { return caching_on.load(); }

int64_t caching_current_stream(c10::DeviceIndex device) { return current_stream_id(device); }

namespace {
// A device tensor over `data` (`nbytes`), its storage resizable by the device allocator.
at::Tensor tensor_over(c10::DataPtr data, uint64_t nbytes, caffe2::TypeMeta dtype,
                       c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t offset = 0) {
  auto storage = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), static_cast<int64_t>(nbytes), std::move(data),
      allocator(), /*resizable=*/true);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(std::move(storage)), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      dtype);
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return t;
}
}  // namespace

at::Tensor caching_new_tensor(int device, uint64_t nbytes, c10::ScalarType scalar,
                              c10::IntArrayRef sizes, c10::IntArrayRef strides,
                              int64_t stream) {
  return tensor_over(cached_data_ptr(device, nbytes, stream), nbytes,
                     c10::scalarTypeToTypeMeta(scalar), sizes, strides);
}

namespace {
// `storage` (of `device`) holds `fresh` (`newsize` bytes) from now on; its old block returns:
// a block of ours as its DataPtr dies, one a Python-made storage held through Python.
void replace_block(const c10::Storage& storage, c10::DataPtr fresh, size_t newsize, int device) {
  c10::DataPtr gone = storage.set_data_ptr(std::move(fresh));
  storage.set_nbytes(newsize);
  ReleaseBlock release = release_block_cb.load();
  if (gone.get() != nullptr && gone.get_deleter() != &free_cached && release != nullptr) {
    auto ptr = reinterpret_cast<uint64_t>(gone.get());
    python("release", [&] { return release(device, ptr); });
  }
}
}  // namespace

// UntypedStorage.resize_ of a device storage: a new block of `newsize` bytes on the current
// stream of the storage's device, the bytes both sizes hold copied by the runtime (the
// device allocator's copy_data), the old block returned -- every tensor on the storage sees
// the new memory, and resize_(0) frees the old one (FSDP2 frees unsharded parameters so).
void resize_device_storage(const c10::Storage& storage, size_t newsize) {
  auto n = static_cast<int64_t>(newsize);  // Python's negative sizes arrive as huge ones
  TORCH_CHECK(n >= 0, "resize_: size must be non-negative, got ", n);
  TORCH_CHECK(((caching_on.load() && live.load()) || caching_exiting.load()) &&
                  callbacks.copy != nullptr,
              "torchport: resizing a device storage needs torchport's C++ allocator, which "
              "does not serve this process; call resize_ before the interpreter exits");
  size_t old = storage.nbytes();
  if (newsize == old) return;
  int device = storage.device().has_index() ? storage.device().index() : current_device();
  CachingAllocator& a = caching_of(device);
  if (a.asynchronous)  // queued kernels may still read or write the old block
    python("synchronize", [&] { return cc.synchronize(device); });
  c10::DataPtr fresh = cached_data_ptr(device, newsize, current_stream_id(
                                                            static_cast<c10::DeviceIndex>(device)));
  size_t kept = std::min(old, newsize);
  const void* from = storage.data_ptr().get();
  if (kept && from != nullptr)
    python("copy_data", [&] {
      return callbacks.copy(reinterpret_cast<uint64_t>(fresh.get()),
                            reinterpret_cast<uint64_t>(from), kept);
    });
  replace_block(storage, std::move(fresh), newsize, device);
}

// ---- results of host-op kernels in device memory ----------------------------------------
// A host-op kernel (native_hostops.cpp) runs PyTorch's CPU kernel on CPU tensors over device
// memory; the CPU kernel makes its new results with the CPU allocator. While a thread runs
// such a kernel for device d (`HostResultsIn`), the CPU allocator's allocations in that
// thread are blocks of d's caching allocator on the current stream, so a new result is
// device memory already (`host_result_on_device` makes it the device's without a copy).
// Every other allocation, in every other thread, is the wrapped allocator's own.
namespace {
thread_local int results_device = -1;
constexpr int kResultDevices = 64;
c10::Allocator* host_base = nullptr;

void free_result(int device, void* p) { free_block(device, reinterpret_cast<uint64_t>(p)); }

// One deleter per device (a DataPtr's context is its address, as raw_allocate requires).
template <size_t... D>
constexpr std::array<c10::DeleterFnPtr, sizeof...(D)> result_deleters_for(
    std::index_sequence<D...>) {
  return {{[](void* p) { free_result(static_cast<int>(D), p); }...}};
}
constexpr auto result_deleters = result_deleters_for(std::make_index_sequence<kResultDevices>{});

// raw_allocate's memory returns through raw_deleter(): a device block or the host's.
void raw_free(void* p) {
  if (p != nullptr && caching_on.load()) {
    auto& v = caching();
    for (size_t d = 0; d < v.size(); ++d)
      if (v[d]->owns(reinterpret_cast<uint64_t>(p))) return free_result(static_cast<int>(d), p);
  }
  host_base->raw_deleter()(p);
}

struct HostResultsAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    const int d = results_device;
    if (d < 0 || n == 0 || !caching_on.load()) return host_base->allocate(n);
    results_device = -1;  // the caching allocator's own host allocations (a new segment)
    struct Restore {
      int d;
      ~Restore() { results_device = d; }
    } restore{d};
    auto device = static_cast<c10::DeviceIndex>(d);
    Block* b = caching_of(d).malloc(n, current_stream_id(device));
    void* p = reinterpret_cast<void*>(b->ptr);
    return {p, p, result_deleters[d], c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    host_base->copy_data(dest, src, count);
  }
};
}  // namespace

bool host_results_install() {
  static HostResultsAllocator wrapper;
  static std::once_flag once;
  std::call_once(once, [] {
    host_base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&wrapper, /*priority=*/0);
  });
  return c10::GetCPUAllocator() == &wrapper;  // another one may outrank it
}

HostResultsIn::HostResultsIn(int device)
    : saved_(results_device) {
  results_device = device < kResultDevices ? device : -1;
}
HostResultsIn::~HostResultsIn() { results_device = saved_; }

at::Tensor host_result_on_device(const at::Tensor& cpu, int device) {
  if (!cpu.has_storage() || device < 0 || device >= kResultDevices) return {};
  c10::StorageImpl* st = cpu.storage().unsafeGetStorageImpl();
  // ours, and nothing but this result holds it (a CPU kernel may keep its own tensors)
  if (st->data_ptr().get_deleter() != result_deleters[device] ||
      cpu.storage().use_count() != 1)
    return {};
  c10::DataPtr taken = st->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));
  auto p = reinterpret_cast<uint64_t>(taken.release_context());  // ours now: no deleter runs
  return tensor_over(block_data_ptr(p, device), st->nbytes(), cpu.dtype(), cpu.sizes(),
                     cpu.strides(), cpu.storage_offset());
}

void host_storage_grown(c10::StorageImpl* cpu, const c10::Storage& dev, int device) {
  const size_t n = cpu->nbytes();
  void* p = cpu->data_ptr().get();
  c10::DataPtr fresh;
  if (p == nullptr || n == 0) {
    fresh = c10::DataPtr(nullptr, c10::Device(kDevice, static_cast<c10::DeviceIndex>(device)));
  } else if (device < kResultDevices && cpu->data_ptr().get_deleter() == result_deleters[device]) {
    (void)cpu->set_data_ptr(c10::DataPtr(p, c10::Device(c10::kCPU))).release_context();  // ours
    fresh = block_data_ptr(reinterpret_cast<uint64_t>(p), device);
  } else {  // host memory (another CPU allocator served the kernel): copied into a block
    fresh = cached_data_ptr(device, n, current_stream_id(static_cast<c10::DeviceIndex>(device)));
    std::memcpy(fresh.get(), p, n);
    cpu->set_data_ptr(c10::DataPtr(fresh.get(), c10::Device(c10::kCPU)));
  }
  replace_block(dev, std::move(fresh), n, device);
}

}  // namespace torchport

// Python's function for the blocks of Python-made storages a resize replaces (nullptr: none).
extern "C" void torchport_caching_set_release(ReleaseBlock fn) { release_block_cb.store(fn); }

#if __has_include(<Python.h>)
#include <ATen/core/Tensor.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {
bool read_ints(PyObject* seq, std::vector<int64_t>& out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (!fast) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[static_cast<size_t>(i)] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
  }
  Py_DECREF(fast);
  return !PyErr_Occurred();
}

// A tensor layout from Python (a torch.dtype, sizes, strides); false with a Python error.
bool read_layout(PyObject* dtype, PyObject* size, PyObject* stride, c10::ScalarType& scalar,
                 std::vector<int64_t>& sizes, std::vector<int64_t>& strides) {
  if (!read_ints(size, sizes) || !read_ints(stride, strides)) return false;
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
    t = torchport::tensor_over(block_data_ptr(ptr, device), nbytes,
                               c10::scalarTypeToTypeMeta(scalar), sizes, strides);
  });
  if (!ok) Py_RETURN_NONE;
  return THPVariable_Wrap(std::move(t));
}
#endif
