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
// native_generator.cpp.
// Built with native_views.cpp and native_guard.cpp by torchport/native.py; enabled by
// torchport_hooks_enable().
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace torchport {
const at::Generator& default_generator(c10::DeviceIndex index);  // native_generator.cpp
at::Generator new_generator(c10::DeviceIndex index);
}  // namespace torchport

namespace {

// Never destroyed: PyTorch may free a pinned block, or ask the hooks, while the process's
// static objects are being torn down at exit.
struct Registry {
  std::mutex mutex;
  std::map<std::uintptr_t, std::size_t> blocks;  // pinned block address -> size
  std::size_t bytes = 0;
};
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

std::atomic<int> visible{0};

void free_pinned(void* ptr) {
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.blocks.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it != r.blocks.end()) {
      r.bytes -= it->second;
      r.blocks.erase(it);
    }
  }
  c10::free_cpu(ptr);
}

struct PinnedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(std::size_t n) override {
    void* ptr = n ? c10::alloc_cpu(n) : nullptr;
    if (ptr) {
      Registry& r = registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      r.blocks[reinterpret_cast<std::uintptr_t>(ptr)] = n;
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
  return p < it->first + it->second;
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
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return torchport::default_generator(index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return torchport::new_generator(index);
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

// Bytes of pinned host memory alive now.
extern "C" long long torchport_pinned_bytes() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return static_cast<long long>(r.bytes);
}
