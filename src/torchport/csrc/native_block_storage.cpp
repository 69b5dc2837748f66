// Device tensors and storages over the caching allocator's blocks, for the other parts of
// the library (native_layer.h): a new device tensor without Python (native_factories.cpp),
// UntypedStorage.resize_ of a device storage in place (native_hooks.cpp), and the results
// of host-op kernels made in device memory (native_hostops.cpp), through a wrapper of the
// CPU allocator.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <utility>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "native_allocator.h"
#include "native_layer.h"

using namespace torchport::alloc;

namespace {

// Python's side of a resize: the block at `ptr` of `device` that a storage made in Python
// held (a weak reference frees it, torchport/memory/tensors.py watch) leaves that storage now.
using ReleaseBlock = int (*)(int device, uint64_t ptr);
std::atomic<ReleaseBlock> release_block_cb{nullptr};
}  // namespace

// A device tensor over `data` (`nbytes`), its storage resizable by the device allocator.
at::Tensor torchport::alloc::tensor_over(c10::DataPtr data, uint64_t nbytes,
                                         caffe2::TypeMeta dtype, c10::IntArrayRef sizes,
                                         c10::IntArrayRef strides, int64_t offset) {
  auto storage = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), static_cast<int64_t>(nbytes), std::move(data),
      allocator(), /*resizable=*/true);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(std::move(storage)), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      dtype);
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return t;
}

namespace torchport {

bool caching_serves() { return caching_on.load(); }

int64_t caching_current_stream(c10::DeviceIndex device) { return current_stream_id(device); }

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
