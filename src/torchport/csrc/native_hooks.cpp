// PrivateUse1's accelerator hooks in C++, with pinned host memory.
//
// Tensor.pin_memory(), torch.empty(..., pin_memory=True) and DataLoader(pin_memory=True) ask
// the current accelerator's hooks for a pinned-memory allocator (at::native::_pin_memory,
// Context::getPinnedMemoryAllocator), and Tensor.is_pinned() asks them whether a host
// pointer is pinned (Context::isPinnedPtr). PyTorch's Python-backend hooks (torch/csrc/acc)
// forward neither to Python: they raise NotImplementedError and answer false. PyTorch takes
// one hooks object per process (RegisterPrivateUse1HooksInterface refuses a second), and the
// Python-backend set-up skips its own when one is there, so torchport registers this one
// first. It answers what torchport's Python hooks answer (built; available with a visible
// device; a primary context for each visible index) and gives pinned memory: host memory
// from c10::alloc_cpu (the CPU allocator's), each block recorded while it lives, so that is_pinned() is true
// for any address inside one, as CUDA answers for its page-locked blocks. The sim's copies
// are host memcpys, so page-locking would only tie up RAM; a vendor's C++ layer would lock
// (register) the block with its driver here.
// The device's generators (torch.Generator(device="sim:1"), the default ones) come from
// native_generator.cpp; UntypedStorage.resize_ of a device storage from native_block_storage.cpp.
// Built with native_views.cpp and native_guard.cpp by torchport/core/native.py; enabled by
// torchport_hooks_enable().
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include "native_layer.h"


namespace {

// Never destroyed: PyTorch may free a pinned block, or ask the hooks, while the process's
// static objects are being torn down at exit.
struct Registry {
  std::mutex mutex;
  std::map<std::uintptr_t, std::pair<std::size_t, bool>> blocks;  // address -> size, runtime's
  std::size_t bytes = 0;
};
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

std::atomic<int> visible{0};

// The runtime's page-locked host memory (Runtime.host_alloc/host_free), where it gives one:
// an address, 0 for plain host memory, -1 for a failure (reported by the Python side).
using HostAlloc = long long (*)(long long nbytes);
using HostFree = void (*)(long long address);
std::atomic<HostAlloc> host_alloc{nullptr};
std::atomic<HostFree> host_free{nullptr};

void free_pinned(void* ptr) {
  Registry& r = registry();
  bool runtime_block = false;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.blocks.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it != r.blocks.end()) {
      r.bytes -= it->second.first;
      runtime_block = it->second.second;
      r.blocks.erase(it);
    }
  }
  if (!runtime_block) {
    c10::free_cpu(ptr);
  } else if (HostFree fn = host_free.load()) {  // none at exit: the process ends anyway
    torchport::CallbackInterrupts interrupts;
    fn(reinterpret_cast<long long>(ptr));
  }
}

struct PinnedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(std::size_t n) override {
    void* ptr = nullptr;
    bool runtime_block = false;
    if (HostAlloc fn = n ? host_alloc.load() : nullptr) {
      long long address;
      {
        torchport::CallbackInterrupts interrupts;
        address = fn(static_cast<long long>(n));
      }
      TORCH_CHECK(address != -1, "the device runtime's host_alloc(", n,
                  ") failed (its error was shown as a warning); pin_memory=False avoids it");
      ptr = reinterpret_cast<void*>(address);
      runtime_block = ptr != nullptr;
    }
    if (ptr == nullptr && n) ptr = c10::alloc_cpu(n);
    if (ptr) {
      Registry& r = registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      r.blocks[reinterpret_cast<std::uintptr_t>(ptr)] = {n, runtime_block};
      r.bytes += n;
    }
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

bool is_pinned(const void* data) {
  auto p = reinterpret_cast<std::uintptr_t>(data);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.blocks.upper_bound(p);
  if (it == r.blocks.begin()) return false;
  --it;
  return p < it->first + it->second.first;
}

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return visible.load() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex index) const override {
    return index >= 0 && index < visible.load();
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  at::Allocator* getPinnedMemoryAllocator() const override {
    static PinnedAllocator* allocator = new PinnedAllocator();
    return allocator;
  }
  void init() const override {}  // devices are ready once the backend registered
  c10::DeviceIndex deviceCount() const override { return torchport::guard_device_count(); }
  c10::DeviceIndex getCurrentDevice() const override {
    return torchport::guard_current_device();
  }
  void setCurrentDevice(c10::DeviceIndex index) const override {
    torchport::guard_set_device(index);
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    c10::DeviceIndex old = torchport::guard_current_device();
    if (index >= 0 && index != old) torchport::guard_set_device(index);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override {
    return exchangeDevice(index);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return torchport::default_generator(index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return torchport::new_generator(index);
  }
  // UntypedStorage.resize_ of a device storage (PyTorch asks the hooks): in place, through
  // the C++ caching allocator.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    torchport::resize_device_storage(storage, newsize);
  }
};

Hooks* hooks() {
  static Hooks* h = new Hooks();
  return h;
}

}  // namespace

// Registers these hooks for PrivateUse1 with `count` visible devices: 1, or 0 where another
// hooks object is registered already (PyTorch takes one per process).
extern "C" int torchport_hooks_enable(int count) {
  visible.store(count);
  if (at::isPrivateUse1HooksRegistered()) return &at::detail::getPrivateUse1Hooks() == hooks();
  at::RegisterPrivateUse1HooksInterface(hooks());
  return 1;
}

// Will these hooks serve UntypedStorage.resize_ of device storages: they are (or, being
// first, will be) PrivateUse1's, and the C++ caching allocator serves: 1, else 0.
extern "C" int torchport_hooks_resize_ready() {
  bool ours = !at::isPrivateUse1HooksRegistered() ||
              &at::detail::getPrivateUse1Hooks() == hooks();
  return ours && torchport::caching_serves();
}

// Bytes of pinned host memory alive now.
extern "C" long long torchport_pinned_bytes() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return static_cast<long long>(r.bytes);
}

// Pinned blocks from the runtime's host_alloc/host_free from now on (nullptr: plain host
// memory again; blocks already given are freed by the function they came from, or kept).
extern "C" void torchport_hooks_set_host_memory(HostAlloc alloc, HostFree free) {
  host_free.store(free);
  host_alloc.store(alloc);
}
