// Device memory a runtime keeps in host memory behind addresses of its own (the sim's strict
// mode): a table of its blocks, and the two C copies a runtime gives torchport through
// `Runtime.native_copies` (runtime.py) over it. A discrete device's driver has such copies in
// C (cudaMemcpy, aclrtMemcpy); a runtime written in Python over host memory has only its
// Python methods, which the staged fallback calls (native_staged.cpp) would otherwise enter
// once per span, each with the GIL. The runtime adds each block at malloc and removes it
// before free (backends/host_memory.py); a copy outside every block returns 1 and the
// runtime's Python method takes it (and raises its own illegal-address error). An
// asynchronous runtime marks a device busy while its default queue has work left or an
// error to report, and the whole table declined while it injects faults: such copies too
// return 1, and the Python method waits, raises or fails as the runtime's rule says. The same
// flag answers such a runtime's default-stream query (`NativeCopies.query_default_stream`):
// the caching allocator asks it for each block freed, and a settled queue needs no Python.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <vector>

namespace {

struct Block {
  uint64_t host;
  uint64_t nbytes;
};

struct Table {
  std::shared_mutex lock;
  std::vector<std::map<uint64_t, Block>> devices;  // device address -> block, per device
  std::unique_ptr<std::atomic<int32_t>[]> busy;     // per device: copies go to Python
  std::atomic<int32_t> declined{0};                 // every copy goes to Python
};

// May a copy of device `index` run here (a device of the table, neither busy nor declined)?
bool passes(Table* t, int32_t index) {
  return index >= 0 && static_cast<size_t>(index) < t->devices.size() &&
         t->declined.load(std::memory_order_acquire) == 0 &&
         t->busy[static_cast<size_t>(index)].load(std::memory_order_acquire) == 0;
}

// The host address of the `n` bytes at device address `addr` of device `index`; 0 where no
// one block holds them all.
uint64_t host_at(Table* t, int32_t index, uint64_t addr, uint64_t n) {
  std::shared_lock<std::shared_mutex> reading(t->lock);
  if (index < 0 || static_cast<size_t>(index) >= t->devices.size()) return 0;
  const auto& blocks = t->devices[static_cast<size_t>(index)];
  auto it = blocks.upper_bound(addr);
  if (it == blocks.begin()) return 0;
  --it;
  const uint64_t off = addr - it->first;
  if (off > it->second.nbytes || n > it->second.nbytes - off) return 0;
  return it->second.host + off;
}

// One copy between host address `host` and the table's device address `device`, to the host
// (`to_host`) or to the device: 0 once the bytes moved, 1 for the runtime's Python copy.
int32_t copy_at(void* table, int32_t index, uint64_t device, uint64_t host, uint64_t nbytes,
                bool to_host) {
  auto* t = static_cast<Table*>(table);
  if (!passes(t, index)) return 1;
  const uint64_t at = host_at(t, index, device, nbytes);
  if (at == 0) return 1;
  if (to_host)
    std::memmove(reinterpret_cast<void*>(host), reinterpret_cast<const void*>(at), nbytes);
  else
    std::memmove(reinterpret_cast<void*>(at), reinterpret_cast<const void*>(host), nbytes);
  return 0;
}

}  // namespace

// A table for `devices` devices (kept for the process: C++ may hold its copies' context).
extern "C" void* torchport_host_memory_new(int32_t devices) {
  auto* t = new Table();
  const size_t n = devices > 0 ? static_cast<size_t>(devices) : 0;
  t->devices.resize(n);
  t->busy.reset(new std::atomic<int32_t>[n == 0 ? 1 : n]);
  for (size_t i = 0; i < n; ++i) t->busy[i].store(0);
  return t;
}

// Device `index`'s copies go to the runtime's Python methods while `busy` is nonzero (its
// default queue has work left, or an error to report); index -1: every device's.
extern "C" void torchport_host_memory_busy(void* table, int32_t index, int32_t busy) {
  auto* t = static_cast<Table*>(table);
  if (index < 0)
    t->declined.store(busy, std::memory_order_release);
  else if (static_cast<size_t>(index) < t->devices.size())
    t->busy[static_cast<size_t>(index)].store(busy, std::memory_order_release);
}

// The block of `nbytes` at device address `base` of device `index` lies at host address `host`.
extern "C" void torchport_host_memory_add(void* table, int32_t index, uint64_t base,
                                          uint64_t host, uint64_t nbytes) {
  auto* t = static_cast<Table*>(table);
  std::unique_lock<std::shared_mutex> writing(t->lock);
  if (index >= 0 && static_cast<size_t>(index) < t->devices.size())
    t->devices[static_cast<size_t>(index)][base] = Block{host, nbytes};
}

// The block at device address `base` of device `index` is no longer the device's.
extern "C" void torchport_host_memory_remove(void* table, int32_t index, uint64_t base) {
  auto* t = static_cast<Table*>(table);
  std::unique_lock<std::shared_mutex> writing(t->lock);
  if (index >= 0 && static_cast<size_t>(index) < t->devices.size())
    t->devices[static_cast<size_t>(index)].erase(base);
}

// Runtime.native_copies' default-stream query, for a runtime that marks a device busy exactly
// while its default queue has work left or an error to report: 1 when device `index`'s queue
// is settled; -1 otherwise (the runtime's query_stream answers).
extern "C" int32_t torchport_host_memory_settled(void* table, int32_t index) {
  auto* t = static_cast<Table*>(table);
  if (index < 0 || static_cast<size_t>(index) >= t->devices.size()) return -1;
  return t->busy[static_cast<size_t>(index)].load(std::memory_order_acquire) == 0 ? 1 : -1;
}

// Runtime.native_copies' two copies.
extern "C" int32_t torchport_host_memory_d2h(void* table, int32_t index, uint64_t dst_host,
                                             uint64_t src, uint64_t nbytes) {
  return copy_at(table, index, src, dst_host, nbytes, /*to_host=*/true);
}

extern "C" int32_t torchport_host_memory_h2d(void* table, int32_t index, uint64_t dst,
                                             uint64_t src_host, uint64_t nbytes) {
  return copy_at(table, index, dst, src_host, nbytes, /*to_host=*/false);
}

// Runtime.native_copies' copy within device `index` (memmove: the spans may overlap).
extern "C" int32_t torchport_host_memory_d2d(void* table, int32_t index, uint64_t dst,
                                             uint64_t src, uint64_t nbytes) {
  auto* t = static_cast<Table*>(table);
  if (!passes(t, index)) return 1;
  const uint64_t to = host_at(t, index, dst, nbytes);
  const uint64_t from = host_at(t, index, src, nbytes);
  if (to == 0 || from == 0) return 1;
  std::memmove(reinterpret_cast<void*>(to), reinterpret_cast<const void*>(from), nbytes);
  return 0;
}
