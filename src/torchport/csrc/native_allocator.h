// What the files of the device allocator share, in torchport::alloc (nothing outside them
// includes this; what the rest of the library calls is in native_layer.h): the bridge into
// the Python side and its callbacks (native_allocator.cpp), the caching allocator's pools and
// the DataPtrs of their blocks (native_caching_allocator.cpp), and device tensors over blocks
// (native_block_storage.cpp). The C entry points that Python calls through ctypes are not
// here: each file keeps its own.
#pragma once
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/SmallVector.h>

namespace torchport::alloc {

constexpr auto kDevice = c10::DeviceType::PrivateUse1;

// ---- the Python side (native_allocator.cpp) ------------------------------------------

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
  // The interpreter's own, for the error indicator (see python()). The caching allocator
  // sets these four too: it calls Python without the callbacks above.
  int (*gil_ensure)();
  void (*gil_release)(int);
  void (*err_fetch)(void**, void**, void**);
  void (*err_restore)(void*, void*, void*);
};
extern Callbacks callbacks;
// False until enabled, and again from the interpreter's exit on: a storage that dies then
// keeps its block (the process is ending) rather than calling into a finalizing interpreter.
extern std::atomic<bool> live;

// The kinds of Python exception a callback reports (torchport_allocator_fail) and of the
// errors the caching allocator's entry points record; accelerator_memory.py and
// allocator.py read the same numbers.
enum ErrorKind { kError = 0, kOutOfMemory, kAccelerator, kValue, kType, kIndex,
                 kNotImplemented };

// Runs `call` (which invokes one callback) with the GIL held and Python's error indicator
// saved; where it did not answer 1, throws the c10::Error of the exception it reported. A
// call made inside another (a storage freed while Python runs for an allocation) keeps the
// outer call's report.
void python(const char* what, c10::function_ref<int()> call);

c10::DeviceIndex current_device();

// A block's owner in its DataPtr: what the deleter returns (to the Python allocator, or to
// the caching allocator's pool).
struct Allocation {
  uint64_t ptr;
  int device;
};

// The c10::DeviceAllocator registered for the device; the storages made in C++ name it.
c10::Allocator* allocator();

// ---- the caching allocator (native_caching_allocator.cpp) ----------------------------

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
  Block* best_fit(int64_t stream, uint64_t size);
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
extern CachingCallbacks cc;
extern std::atomic<bool> caching_on;
extern std::atomic<bool> caching_exiting;  // detached by the exit handler

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

// One device's pools (native_caching_allocator.cpp says the rules).
struct CachingAllocator {
  int device = 0;
  bool asynchronous = false;
  // the runtime's C query of this device's default stream (NativeCopies.query_default_stream,
  // set once before the device's first block): 1 when it ran everything queued; else unknown
  int32_t (*default_stream_query)(void* context, int32_t index) = nullptr;
  void* default_stream_context = nullptr;
  int32_t phys = 0;  // the runtime's index of this device
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
  // freed blocks waiting for events, one queue per allocation stream (insertion order; the
  // first few kept when empty: a stream's blocks go through it once per op)
  using Events = c10::SmallVector<long long, 2>;
  std::vector<std::pair<int64_t, std::deque<std::pair<Block*, Events>>>> pending;
  int depth = 0;  // operations of the thread holding the mutex (it alone changes this)
  std::vector<uint64_t> deferred;  // frees that arrived during an operation of that thread
  CStat stats[kNames][3];
  int64_t counters[kCounterCount] = {};
  int64_t slow_mallocs = 0;  // requests an exact-size parked block did not serve

  Pool& pool(bool small);
  void stat(bool small, StatName name, int64_t n);
  static uint64_t round(uint64_t n);
  static uint64_t segment_size(uint64_t size);

  // allocation
  Block* malloc(uint64_t nbytes, int64_t stream);
  Block* pop_parked(int64_t stream, uint64_t size);
  Block* hand_out(Block* b, uint64_t nbytes);
  Block* from_cache(Pool& p, int64_t stream, uint64_t size, bool allow_oversize);
  static bool oversize(const Block* b, uint64_t size);
  void maybe_split(Block* b, uint64_t size, Pool& p);
  uint64_t reserved() const;
  uint64_t device_malloc(uint64_t seg);
  Block* new_segment(uint64_t size, bool small, int64_t stream, bool retry);
  Block* adopt(uint64_t ptr, uint64_t nbytes, int64_t stream);
  bool owns(uint64_t ptr);

  // freeing
  void free(uint64_t ptr);
  void free_locked(uint64_t ptr);
  long long record(int index, int64_t stream);
  bool stream_idle(int64_t stream);
  Events free_events(Block* b);
  bool may_park(const Block* b);
  void park(Block* b);
  std::vector<decltype(parked)::iterator> parked_in_order(int64_t only_stream, bool all);
  void unpark_all();
  Block* unpark_for(bool small, int64_t stream, uint64_t size);
  void process_pending(bool force);
  void release_block(Block* b);
  void release_segment(uint64_t ptr, uint64_t size, bool small);
  bool mergeable(const Block* nb) const;
  void return_to_pool(Block* b);
  static void merge(Block* dst, Block* src, Pool& p);
  void recount_inactive_split();
  void release_free_segments();
  void empty_cache();

  // statistics
  void read_stats(int64_t* out, bool refresh);
  void reset_peak();
  void reset_accumulated();
  void drain_deferred();
};

// One caching allocator per visible device (made by torchport_caching_enable).
std::vector<CachingAllocator*>& caching();
// The allocator of `device`; an AcceleratorError for an invalid ordinal.
CachingAllocator& caching_of(int device);
// Returns block `ptr` of `device` from a deleter (which cannot throw).
void free_block(int device, uint64_t ptr);
// The deleter of the blocks' DataPtrs (its context an Allocation).
void free_cached(void* ctx);
int64_t current_stream_id(c10::DeviceIndex device);
// The DataPtr of a device storage holding block `ptr` of `device`: its deleter returns it.
c10::DataPtr block_data_ptr(uint64_t ptr, int device);
// A DataPtr over a new block of `nbytes` on `stream` (a null one for 0 bytes).
c10::DataPtr cached_data_ptr(int device, uint64_t nbytes, int64_t stream);

// ---- tensors over blocks (native_block_storage.cpp) -----------------------------------

// A device tensor over `data` (`nbytes`), its storage resizable by the device allocator.
at::Tensor tensor_over(c10::DataPtr data, uint64_t nbytes, caffe2::TypeMeta dtype,
                       c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t offset = 0);

}  // namespace torchport::alloc
