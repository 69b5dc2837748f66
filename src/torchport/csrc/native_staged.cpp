// The CPU fallback's warm calls on device-only memory: where the host reaches device memory
// only through the runtime's copies (a discrete device; the strict sim, the reference
// backend, OpenCL), the learnt overloads of the device's boxed fallback (native_hostops.cpp)
// run here without a Python frame of torchport's: the bytes the call's device tensors span
// are copied to host memory by the runtime's `copy_d2h`, the CPU kernel runs on CPU tensors
// over them, the written arguments' spans go back by its `copy_h2d`, and new results are
// blocks of the C++ caching allocator filled by `copy_h2d`. The copies are the runtime's
// C entry points where it gives them (`Runtime.native_copies`: called without the GIL; one
// that returns nonzero hands that copy to the Python method), its Python methods otherwise,
// all with `stream=None`: the stream rule (runtime.py) orders them
// after the default stream's work, and only calls made while the default stream is current
// are served here. What the Python fallback does on these runtimes (torchport/ops/hostexec.py)
// is what this does; the overloads it serves are taught by it (ops/native_hostops.py
// learn_fallback), with the arguments each writes (its schema's, and those PyTorch's
// schemas do not mark: ops/plan.py HIDDEN_WRITES). An out= the CPU kernel resizes grows
// into host memory (the copies are resizable CPU storages) and the device tensor takes its
// layout, its storage grown as the CPU's (native_block_storage.cpp resize_device_storage).
#if __has_include(<Python.h>)
#include <ATen/core/Tensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <bitset>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <mutex>
#include <vector>

#include "native_layer.h"

namespace torchport {
// Runtime.native_copies' C copies: fn(context, index, dst, src, nbytes), 0 once done.
using NativeCopy = int32_t (*)(void*, int32_t, uint64_t, uint64_t, uint64_t);
struct Copies {
  PyObject* d2h = nullptr;     // runtime.copy_d2h(index, dst_host, src, nbytes)
  PyObject* h2d = nullptr;     // runtime.copy_h2d(index, dst, src_host, nbytes)
  NativeCopy native_d2h = nullptr;  // the same copies in C (null: none)
  NativeCopy native_h2d = nullptr;
  NativeCopy native_d2d = nullptr;  // a copy within a device in C (null: none)
  void* context = nullptr;          // (their first argument)
  // The runtime's queues run behind the host: a span a call overwrites is read all the same,
  // as its copy to the host waits for the default stream, which orders the write after the
  // queued work that reads it (a runtime's copy_h2d with stream=None need not wait: the
  // sim's does not)
  bool asynchronous = false;
  PyObject* result = nullptr;  // result(cpu_tensor, index): a result not copied here
  std::vector<int> phys;       // the runtime's index of each device
  std::bitset<256> refused;    // dtypes the device refuses: their results go to `result`
};
}  // namespace torchport

namespace {

using torchport::Copies;
std::mutex configuring;
std::atomic<Copies*> copies{nullptr};  // set per configuration, kept (calls may hold the old)
std::atomic<bool> staging{false};

uint64_t address(const c10::StorageImpl* st) {
  return reinterpret_cast<uint64_t>(st->data_ptr().get());
}

// The byte range [lo, hi) of its storage a tensor with elements can touch.
std::pair<uint64_t, uint64_t> span(const at::Tensor& t) {
  uint64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d)
    extent += static_cast<uint64_t>(t.size(d) - 1) * static_cast<uint64_t>(t.stride(d));
  const uint64_t lo = static_cast<uint64_t>(t.storage_offset()) * t.itemsize();
  return {lo, lo + extent * t.itemsize()};
}

// One span's copy to the host (`to_host`) or to the device: in C where the runtime gives the
// copy in C and it takes it, else by the runtime's Python method.
void copy(const Copies& c, bool to_host, int phys, uint64_t dst, uint64_t src,
          uint64_t nbytes) {
  if (nbytes == 0) return;
  const torchport::NativeCopy native = to_host ? c.native_d2h : c.native_h2d;
  if (native != nullptr && native(c.context, phys, dst, src, nbytes) == 0) return;
  PyObject* fn = to_host ? c.d2h : c.h2d;
  pybind11::gil_scoped_acquire gil;
  torchport::CallbackInterrupts held;
  PyObject* r = PyObject_CallFunction(fn, "iKKK", phys, static_cast<unsigned long long>(dst),
                                      static_cast<unsigned long long>(src),
                                      static_cast<unsigned long long>(nbytes));
  if (!r) torchport::raise_python();
  Py_DECREF(r);
}

}  // namespace

namespace torchport {

bool staging_on() { return staging.load(std::memory_order_acquire); }

bool staging_native() {
  const Copies* c = copies.load(std::memory_order_acquire);
  return c != nullptr && c->native_d2h != nullptr;
}

bool staging_within() {
  const Copies* c = copies.load(std::memory_order_acquire);
  return c != nullptr && c->native_d2d != nullptr;
}

bool staged_copy_within(int index, uint64_t dst, uint64_t src, uint64_t nbytes) {
  const Copies* c = copies.load(std::memory_order_acquire);
  if (c == nullptr || c->native_d2d == nullptr || index < 0 ||
      static_cast<size_t>(index) >= c->phys.size())
    return false;
  return nbytes == 0 ||
         c->native_d2d(c->context, c->phys[static_cast<size_t>(index)], dst, src, nbytes) == 0;
}

Staged::Staged(int index) : index_(index), copies_(copies.load(std::memory_order_acquire)) {}

uint64_t Staged::bytes(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  auto [lo, hi] = span(t);
  return hi - lo;
}

void Staged::add(const at::Tensor& t, bool overwritten) {
  if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1 || t.numel() == 0)
    return;
  c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
  auto [lo, hi] = span(t);
  // an out= whose span is its elements, which the kernel writes: nothing of it to read
  // (on a synchronous runtime)
  const bool read =
      !(overwritten && !copies_->asynchronous && t.is_non_overlapping_and_dense());
  for (Span& s : spans_) {
    if (s.dev != st) continue;
    s.lo = std::min(s.lo, lo);
    s.hi = std::max(s.hi, hi);
    s.read = s.read || read;
    return;
  }
  spans_.push_back(Span{st, lo, hi, 0, c10::Storage(), read});
}

}  // namespace torchport

namespace {

// The host buffers of the staged copies, kept per thread for the next calls: a warm call
// takes buffers of the sizes earlier calls gave back rather than an aligned malloc and a
// free each (glibc's, for blocks this small, costs more than the copies). A buffer is 64-byte
// aligned as the CPU allocator's, its size class in a header before it; sizes above the
// largest class, and buffers beyond a class's few kept, go back to the C library.
class StagingBuffers final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
    const int k = size_class(n);
    void* block = k >= 0 ? take(k) : nullptr;
    if (block == nullptr) {
      const size_t bytes = kHeader + (k >= 0 ? class_bytes(k) : round_up(n));
      block = std::aligned_alloc(kHeader, bytes);
      if (block == nullptr) throw std::bad_alloc();
      static_cast<int32_t*>(block)[0] = k;
      fresh.fetch_add(1, std::memory_order_relaxed);
    } else {
      reused.fetch_add(1, std::memory_order_relaxed);
    }
    return {static_cast<char*>(block) + kHeader, block, &release,
            c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }  // (data is not ctx)
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static std::atomic<uint64_t> fresh, reused;  // buffers from the C library, from the kept

 private:
  static constexpr size_t kHeader = 64;
  static constexpr int kClasses = 15;  // 64 B .. 1 MiB
  static constexpr size_t kKept = 8;   // per class and thread
  static size_t class_bytes(int k) { return size_t{64} << k; }
  static size_t round_up(size_t n) { return (n + kHeader - 1) / kHeader * kHeader; }
  static int size_class(size_t n) {
    for (int k = 0; k < kClasses; ++k)
      if (n <= class_bytes(k)) return k;
    return -1;
  }

  // A thread's kept buffers; freed with the thread (`alive` stays readable after that, so a
  // buffer given back later goes to the C library).
  struct Kept {
    std::vector<void*> by_class[kClasses];
    ~Kept() {
      alive = false;
      for (auto& list : by_class)
        for (void* b : list) std::free(b);
    }
  };
  static thread_local Kept kept;
  static thread_local bool alive;

  static void* take(int k) {
    if (!alive) return nullptr;
    std::vector<void*>& list = kept.by_class[k];
    if (list.empty()) return nullptr;
    void* b = list.back();
    list.pop_back();
    return b;
  }
  static void release(void* block) {
    if (block == nullptr) return;
    const int k = static_cast<int32_t*>(block)[0];
    if (k >= 0 && alive && kept.by_class[k].size() < kKept) {
      kept.by_class[k].push_back(block);
      return;
    }
    std::free(block);
  }
};
std::atomic<uint64_t> StagingBuffers::fresh{0}, StagingBuffers::reused{0};
thread_local StagingBuffers::Kept StagingBuffers::kept;
thread_local bool StagingBuffers::alive = true;
StagingBuffers staging_buffers;

}  // namespace

namespace torchport {

// A CPU storage of `n` bytes the CPU kernel may grow (an out= it resizes), as a CPU tensor's.
static c10::Storage host_storage(uint64_t n) {
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), n, staging_buffers.allocate(n), &staging_buffers,
      /*resizable=*/true));
}

void Staged::fetch() {
  for (Span& s : spans_) {
    // from a 64-byte boundary: every element's offset from the base is a whole number of
    // elements, whatever the dtypes sharing the storage
    s.base = s.lo & ~uint64_t{63};
    const uint64_t n = s.hi - s.base;
    s.cpu = host_storage(n);
    if (s.read)
      copy(*copies_, /*to_host=*/true, copies_->phys[index_],
           reinterpret_cast<uint64_t>(s.cpu.unsafeGetStorageImpl()->data_ptr().get()),
           address(s.dev) + s.base, n);
  }
}

at::Tensor Staged::cpu(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  for (const Mapped& m : tensors_)
    if (m.dev.unsafeGetTensorImpl() == impl) return m.cpu;
  const c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
  const uint64_t at = static_cast<uint64_t>(t.storage_offset()) * t.itemsize();
  size_t k = spans_.size();
  for (size_t i = 0; i < spans_.size(); ++i)
    if (spans_[i].dev == st && spans_[i].cpu && at >= spans_[i].base) k = i;
  if (k == spans_.size()) {  // no elements, and no span of its storage to sit in: its own
    spans_.push_back(
        Span{t.storage().unsafeGetStorageImpl(), at, at, at, host_storage(0), false});
  }
  const Span& s = spans_[k];
  at::Tensor cpu = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(s.cpu), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  cpu.unsafeGetTensorImpl()->set_sizes_and_strides(
      t.sizes(), t.strides(), static_cast<int64_t>((at - s.base) / t.itemsize()));
  tensors_.push_back(Mapped{t, cpu, k});
  return cpu;
}

void Staged::store(const at::Tensor& dev) {
  if (!dev.defined() || dev.device().type() != c10::DeviceType::PrivateUse1) return;
  at::Tensor cpu = this->cpu(dev);
  size_t k = 0;
  for (const Mapped& m : tensors_)
    if (m.dev.unsafeGetTensorImpl() == dev.unsafeGetTensorImpl()) k = m.span;
  const Span& s = spans_[k];
  TORCH_CHECK(cpu.storage().unsafeGetStorageImpl() == s.cpu.unsafeGetStorageImpl(),
              "torchport: the CPU kernel gave a written argument of a fallback call on "
              "device-only memory another storage, which its copy cannot follow; run it with "
              "TORCHPORT_NATIVE=0 and report it");
  const uint64_t at = static_cast<uint64_t>(cpu.storage_offset()) * cpu.itemsize() + s.base;
  c10::TensorImpl* impl = dev.unsafeGetTensorImpl();
  if (cpu.sizes() != dev.sizes() || cpu.strides() != dev.strides() ||
      at != static_cast<uint64_t>(dev.storage_offset()) * dev.itemsize()) {
    // an out= the CPU kernel resized: the device tensor takes the same layout, its storage
    // grown where the layout reaches past it (as the CPU's resize grows the CPU's)
    const uint64_t need = cpu.numel() == 0 ? 0 : span(cpu).second + s.base;
    if (need > dev.storage().nbytes()) resize_device_storage(dev.storage(), need);
    impl->set_sizes_and_strides(cpu.sizes(), cpu.strides(),
                                static_cast<int64_t>(at / cpu.itemsize()));
  }
  if (dev.numel() == 0) return;
  if (cpu.is_conj() || cpu.is_neg()) store_lazy_bits(cpu);
  auto [lo, hi] = span(dev);
  copy(*copies_, /*to_host=*/false, copies_->phys[index_],
       address(dev.storage().unsafeGetStorageImpl()) + lo,
       reinterpret_cast<uint64_t>(s.cpu.unsafeGetStorageImpl()->data_ptr().get()) + (lo - s.base),
       hi - lo);
}

at::Tensor Staged::on_device(const at::Tensor& cpu) {
  c10::TensorImpl* impl = cpu.unsafeGetTensorImpl();
  for (const Mapped& m : tensors_)
    if (m.cpu.unsafeGetTensorImpl() == impl) return m.dev;
  if (cpu.has_storage()) {
    c10::StorageImpl* st = cpu.storage().unsafeGetStorageImpl();
    for (const Span& s : spans_) {
      if (s.cpu.unsafeGetStorageImpl() != st) continue;
      // a view of an argument's memory: the same view of the device's
      const uint64_t at = static_cast<uint64_t>(cpu.storage_offset()) * cpu.itemsize() + s.base;
      TORCH_CHECK(at % cpu.itemsize() == 0, "torchport: a misaligned view result");
      at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(
          c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s.dev)),
          c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), cpu.dtype());
      view.unsafeGetTensorImpl()->set_sizes_and_strides(
          cpu.sizes(), cpu.strides(), static_cast<int64_t>(at / cpu.itemsize()));
      return view;
    }
  }
  if (cpu.is_conj() || cpu.is_neg())  // a new result with a lazy bit: its values
    return on_device(cpu.resolve_conj().resolve_neg());
  const bool plain = cpu.layout() == c10::Layout::Strided && !cpu.is_quantized() &&
                     !cpu._is_zerotensor() &&
                     !copies_->refused[static_cast<size_t>(cpu.scalar_type())];
  if (plain && cpu.is_non_overlapping_and_dense()) {
    const uint64_t nbytes = static_cast<uint64_t>(cpu.numel()) * cpu.itemsize();
    at::Tensor out = caching_new_tensor(index_, nbytes, cpu.scalar_type(), cpu.sizes(),
                                        cpu.strides(), /*stream=*/0);
    if (nbytes)
      copy(*copies_, /*to_host=*/false, copies_->phys[index_],
           reinterpret_cast<uint64_t>(out.data_ptr()),
           reinterpret_cast<uint64_t>(cpu.data_ptr()), nbytes);
    return out;
  }
  return result_on_device(copies_->result, cpu, index_);  // converted as in Python
}

}  // namespace torchport

namespace torchport {

int staging_configure(PyObject* d2h, PyObject* h2d, PyObject* result, PyObject* refuse,
                      PyObject* phys, PyObject* native, bool asynchronous) {
  if (d2h == Py_None) {
    staging.store(false, std::memory_order_release);
    return 1;
  }
  if (!PyCallable_Check(d2h) || !PyCallable_Check(h2d) || !PyCallable_Check(result) ||
      !PyList_Check(refuse)) {
    PyErr_SetString(PyExc_TypeError, "expected copy_d2h, copy_h2d, result, dtypes, indices");
    return 0;
  }
  auto* made = new Copies();  // never freed: a call may still hold the last one
  std::vector<int64_t> indices;
  if (!read_dtype_set(refuse, made->refused) || !read_ints(phys, indices)) {
    delete made;
    return 0;
  }
  made->phys.assign(indices.begin(), indices.end());
  made->asynchronous = asynchronous;
  if (native != Py_None) {  // (d2h address, h2d address, context, d2d address or 0)
    std::vector<int64_t> entry;
    if (!read_ints(native, entry) || entry.size() != 4 || entry[0] == 0 || entry[1] == 0) {
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError,
                        "expected the native copies' (d2h, h2d, context, d2d)");
      delete made;
      return 0;
    }
    made->native_d2h = reinterpret_cast<torchport::NativeCopy>(entry[0]);
    made->native_h2d = reinterpret_cast<torchport::NativeCopy>(entry[1]);
    made->context = reinterpret_cast<void*>(entry[2]);
    made->native_d2d = reinterpret_cast<torchport::NativeCopy>(entry[3]);
  }
  Py_INCREF(d2h);
  Py_INCREF(h2d);
  Py_INCREF(result);
  made->d2h = d2h;
  made->h2d = h2d;
  made->result = result;
  {
    std::lock_guard<std::mutex> lock(configuring);
    copies.store(made, std::memory_order_release);
  }
  staging.store(true, std::memory_order_release);
  return 1;
}

}  // namespace torchport

// The staged copies' host buffers: made by the C library, and taken from those kept.
extern "C" void torchport_staging_buffer_counts(int64_t* out) {
  out[0] = static_cast<int64_t>(StagingBuffers::fresh.load());
  out[1] = static_cast<int64_t>(StagingBuffers::reused.load());
}
#endif
