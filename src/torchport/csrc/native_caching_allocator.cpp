// The device's caching allocator in C++: one CachingAllocator per device, its lock, and the
// DataPtrs of its blocks (their deleter returns the block to the pool).
//
// The same rules as the Python one of torchport/memory/allocator.py: segments from the
// runtime (a Python callback: the runtime is Python), carved into blocks by CUDA's size
// classes, pools and split rules, free blocks parked for an exact-size reuse (capped),
// statistics named and counted as CUDA's. Allocations and frees stay in C++: a storage's
// DataPtr returns its block from its deleter. Python is entered only for a new or returned
// segment, an out-of-memory message, a device synchronize, and the events of stream-aware
// freeing (through the device guard's stream layer). The types are declared in
// native_allocator.h; the C entry points for allocator.py are in native_caching_api.cpp.
#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "native_allocator.h"
#include "native_layer.h"

namespace torchport::alloc {

namespace {

constexpr uint64_t kMinBlock = 512;
constexpr uint64_t kSmallSize = 1 << 20;
constexpr uint64_t kSmallBuffer = 2 << 20;
constexpr uint64_t kLargeBuffer = 20 << 20;
constexpr uint64_t kMinLargeAlloc = 10 << 20;
constexpr uint64_t kRoundLarge = 2 << 20;
constexpr uint64_t kParkFloor = 8 << 20;
constexpr size_t kPendingKept = 4;  // streams whose empty queue of pending frees stays

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

}  // namespace

CachingCallbacks cc{};
std::atomic<bool> caching_on{false};
std::atomic<bool> caching_exiting{false};

Block* Pool::best_fit(int64_t stream, uint64_t size) {
  Block key{0, size, 0, false, stream};
  key.ptr = 0;
  auto it = blocks.lower_bound(&key);
  if (it != blocks.end() && (*it)->stream == stream) return *it;
  return nullptr;
}

Pool& CachingAllocator::pool(bool small) { return small ? small_pool : large_pool; }

void CachingAllocator::stat(bool small, StatName name, int64_t n) {
  stats[name][0].add(n);
  stats[name][small ? 1 : 2].add(n);
}

uint64_t CachingAllocator::round(uint64_t n) {
  return n < kMinBlock ? kMinBlock : (n + kMinBlock - 1) / kMinBlock * kMinBlock;
}
uint64_t CachingAllocator::segment_size(uint64_t size) {
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return kLargeBuffer;
  return (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

// ---- allocation --------------------------------------------------------------------
Block* CachingAllocator::malloc(uint64_t nbytes, int64_t stream) {
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

Block* CachingAllocator::pop_parked(int64_t stream, uint64_t size) {
  auto it = parked.find({stream, size});
  if (it == parked.end() || it->second.second.empty()) return nullptr;
  Block* b = it->second.second.back();
  it->second.second.pop_back();
  b->parked = false;
  num_parked -= 1;
  parked_bytes[b->small] -= b->size;
  return b;
}

Block* CachingAllocator::hand_out(Block* b, uint64_t nbytes) {
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

Block* CachingAllocator::from_cache(Pool& p, int64_t stream, uint64_t size, bool allow_oversize) {
  unpark_all();
  Block* b = p.best_fit(stream, size);
  if (b && !allow_oversize && oversize(b, size)) return nullptr;
  if (b) p.blocks.erase(b);
  return b;
}

bool CachingAllocator::oversize(const Block* b, uint64_t size) {
  return !b->small && b->size >= size + kLargeBuffer && b->size > 2 * size;
}

void CachingAllocator::maybe_split(Block* b, uint64_t size, Pool& p) {
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

uint64_t CachingAllocator::reserved() const {
  return static_cast<uint64_t>(stats[RESERVED_BYTES][0].current);
}

uint64_t CachingAllocator::device_malloc(uint64_t seg) {
  if (limit >= 0 && static_cast<double>(reserved() + seg) > limit) return 0;
  uint64_t ptr = 0;
  python("segment malloc", [&] { return cc.segment_malloc(device, seg, &ptr); });
  return ptr;
}

Block* CachingAllocator::new_segment(uint64_t size, bool small, int64_t stream, bool retry) {
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

Block* CachingAllocator::adopt(uint64_t ptr, uint64_t nbytes, int64_t stream) {
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
bool CachingAllocator::owns(uint64_t ptr) {
  Locked l(*this);
  return active.count(ptr) != 0;
}

// ---- freeing ------------------------------------------------------------------------
void CachingAllocator::free(uint64_t ptr) {
  Locked l(*this);
  if (depth > 1) {  // a free reached from Python this allocator called: after the operation
    deferred.push_back(ptr);
    return;
  }
  free_locked(ptr);
}

void CachingAllocator::free_locked(uint64_t ptr) {
  if (!pending.empty()) process_pending(false);
  auto it = active.find(ptr);
  TORCH_CHECK(it != active.end(), "torchport: no block of device ", device, " at ", ptr);
  Block* b = it->second;
  active.erase(it);
  Events events;
  if (!b->stream_uses.empty() || asynchronous) events = free_events(b);
  int64_t s = static_cast<int64_t>(b->size);
  stat(b->small, ALLOCATION, -1);
  stat(b->small, ALLOCATED_BYTES, -s);
  stat(b->small, REQUESTED_BYTES, -static_cast<int64_t>(b->requested));
  if (!events.empty()) {
    auto q = std::find_if(pending.begin(), pending.end(),
                          [&](const auto& e) { return e.first == b->stream; });
    if (q == pending.end()) {
      pending.emplace_back(b->stream, std::deque<std::pair<Block*, Events>>{});
      q = pending.end() - 1;
    }
    q->second.emplace_back(b, std::move(events));
    return;
  }
  release_block(b);
}

// An event on a default stream whose queue is C++'s is the ticket of its last job, encoded as
// a negative id (the stream layer's are positive): nothing queued for it, and no Python call to
// record, query or destroy it.
namespace {
constexpr int kQueueBits = 6;  // logical device index (native_queues.cpp keeps 64)

long long queued_event(int index, int64_t ticket) {
  return -((static_cast<long long>(ticket) << kQueueBits) | index) - 1;
}

bool queued_event_done(long long e) {
  const long long v = -(e + 1);
  return torchport::queues::done(
      torchport::queues::default_queue(static_cast<int>(v & ((1 << kQueueBits) - 1))),
      v >> kQueueBits);
}
}  // namespace

// Has this device's `stream` run everything queued on it? The default stream's C++ queue or
// the runtime's C query answers without Python where there is one.
bool CachingAllocator::stream_idle(int64_t stream) {
  if (stream == 0) {
    if (torchport::queues::Queue* q = torchport::queues::default_queue(device))
      return torchport::queues::done(q, 0);
    if (default_stream_query && default_stream_query(default_stream_context, phys) == 1)
      return true;
  }
  return stream_layer(kQueryStream, device, stream, 0, nullptr) == 1;
}

long long CachingAllocator::record(int index, int64_t stream) {
  if (stream == 0)
    if (torchport::queues::Queue* q = torchport::queues::default_queue(index))
      return queued_event(index, torchport::queues::last_ticket(q));
  long long eid = 0;
  stream_layer(kEventCreate, index, 0, 0, &eid);
  stream_layer(kEventRecord, eid, index, stream, nullptr);
  return eid;
}

CachingAllocator::Events CachingAllocator::free_events(Block* b) {
  Events events;
  for (auto& [index, stream] : b->stream_uses) events.push_back(record(index, stream));
  b->stream_uses.clear();
  if (asynchronous && !stream_idle(b->stream))
    events.push_back(record(device, b->stream));
  return events;
}

bool CachingAllocator::may_park(const Block* b) {
  bool small = b->small;
  if (num_parked >= max_parked || (full && !small)) return false;
  uint64_t held = parked_bytes[small] + b->size;
  if (held <= kParkFloor) return true;
  if (full) return false;
  const CStat& alloc = stats[ALLOCATED_BYTES][small ? 1 : 2];
  return static_cast<int64_t>(held) <= 2 * std::max(alloc.peak, alloc.current);
}

void CachingAllocator::park(Block* b) {
  b->parked = true;
  auto [it, made] = parked.try_emplace({b->stream, b->size});
  if (made) it->second.first = parked_seq++;
  it->second.second.push_back(b);
  num_parked += 1;
  parked_bytes[b->small] += b->size;
}

// the parked lists in the order their keys were made
auto CachingAllocator::parked_in_order(int64_t only_stream, bool all)
    -> std::vector<decltype(parked)::iterator> {
  std::vector<decltype(parked)::iterator> out;
  for (auto it = parked.begin(); it != parked.end(); ++it)
    if (all || it->first.first == only_stream) out.push_back(it);
  std::sort(out.begin(), out.end(),
            [](const auto& x, const auto& y) { return x->second.first < y->second.first; });
  return out;
}

void CachingAllocator::unpark_all() {
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

Block* CachingAllocator::unpark_for(bool small, int64_t stream, uint64_t size) {
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

void CachingAllocator::process_pending(bool force) {
  for (size_t i = 0; i < pending.size();) {
    auto& q = pending[i].second;
    while (!q.empty()) {
      auto& events = q.front().second;
      bool done = force || std::all_of(events.begin(), events.end(), [](long long e) {
                    return e < 0 ? queued_event_done(e)
                                 : stream_layer(kEventQuery, e, 0, 0, nullptr) == 1;
                  });
      if (!done) break;
      Block* b = q.front().first;
      const Events ev = std::move(events);
      q.pop_front();
      for (long long e : ev)
        if (e > 0) stream_layer(kEventDestroy, e, 0, 0, nullptr);
      release_block(b);
    }
    if (q.empty() && i >= kPendingKept) pending.erase(pending.begin() + static_cast<long>(i));
    else ++i;
  }
}

void CachingAllocator::release_block(Block* b) {
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

void CachingAllocator::release_segment(uint64_t ptr, uint64_t size, bool small) {
  python("segment free", [&] { return cc.segment_free(device, ptr, size); });
  counters[4] += 1;
  stat(small, SEGMENT, -1);
  stat(small, RESERVED_BYTES, -static_cast<int64_t>(size));
}

bool CachingAllocator::mergeable(const Block* nb) const {
  return nb != nullptr && !nb->allocated && !nb->parked && !active.count(nb->ptr);
}

void CachingAllocator::return_to_pool(Block* b) {
  Pool& p = pool(b->small);
  Block* prev = b->prev;
  Block* next = b->next;
  if (mergeable(prev)) merge(b, prev, p);
  if (mergeable(next)) merge(b, next, p);
  p.blocks.insert(b);
}

void CachingAllocator::merge(Block* dst, Block* src, Pool& p) {
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

void CachingAllocator::recount_inactive_split() {
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
void CachingAllocator::release_free_segments() {
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

void CachingAllocator::empty_cache() {
  Locked l(*this);
  release_free_segments();
  full = false;
}

// the statistics, kNames x 3 pools x 4 metrics, then the five counters
void CachingAllocator::read_stats(int64_t* out, bool refresh) {
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

void CachingAllocator::reset_peak() {
  Locked l(*this);
  for (auto& name : stats)
    for (auto& s : name) s.peak = s.current;
}

void CachingAllocator::reset_accumulated() {
  Locked l(*this);
  for (auto& name : stats)
    for (auto& s : name) s.allocated = s.freed = 0;
  for (auto& c : counters) c = 0;
}

void CachingAllocator::drain_deferred() {
  while (!deferred.empty()) {
    uint64_t ptr = deferred.back();
    deferred.pop_back();
    try {
      free_locked(ptr);
    } catch (const c10::Error&) {
    }
  }
}

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

}  // namespace torchport::alloc
