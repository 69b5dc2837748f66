// Host-op kernels in C++: PyTorch's CPU kernel run on CPU tensors over device memory, for a
// device whose memory the host reads and writes at the device address itself (a
// synchronous runtime whose host address of a block is the block's address: the sim by
// default, a unified-memory device). The Python host kernels (torchport/ops/hostkernels)
// do the same with a Python entry per op; this serves their common calls without one. The
// same kernel serves the CPU fallback's warm calls: once the Python fallback
// (torchport/ops/fallback.py) has learnt that an overload takes the CPU (no decomposition,
// not forced), this file's boxed fallback for the device runs its later calls here and
// hands everything else (first calls, views, decompositions, calls these kernels do not
// serve) to the Python fallback, with the arguments PyTorch's own Python fallback passes.
//
// A call is served here when every tensor argument (also in lists) is a plain strided
// tensor of one device of the backend; outside lists, a Python number (a wrapped 0-dim CPU
// tensor) passes as it is, and so does another 0-dim CPU tensor read as an operand where
// CUDA's registration of the op does not compare the devices of its tensors (the op's
// `device_checked` flag, set at registration from hostexec.op_device's tables: those ops
// take the Python kernel, whose device check raises CUDA's error). The CPU kernel sees one
// CPU tensor per device tensor
// and one CPU storage per device storage (its overlap checks see what the CPU's see);
// written arguments are the device tensors' own memory; a result that is an argument is
// that argument, a view of an argument's memory is a device view, and a new result is a
// block of the C++ caching allocator already: while the CPU kernel runs, this thread's CPU
// allocations are the device's blocks on the current stream (HostResultsIn,
// native_block_storage.cpp), and the block moves to a device storage without a copy. An out=
// argument the CPU kernel grows (resize_ itself too) grows into such a block, which the
// device storage then takes in place, as CUDA's resize does. A result made otherwise (a CPU
// kernel's own tensor, a dtype the device refuses) is copied into a new block, or goes to
// the Python `result` function, which adopts or converts it. Where the CPU allocator's
// wrapper cannot serve, a functional op whose first tensor is large (an activation of a
// large batch) is handed to the Python kernel, which computes into new device blocks.
// torchport's own `copy_` is served so too, with the CPU tensor of a copy between the host
// and the device passed to the CPU kernel as it is (and returned as it is), and its own
// `_to_copy` (to the CPU, to the device from the CPU, a dtype on one device), and the
// factories whose CPU kernel is PyTorch's composite one, which runs for the device too.
// A random op taking a generator draws from the CPU generator its device generator owns (the
// device's default one for none: native_generator.cpp), as its Python kernel does.
// Anything else -- another device, a CPU tensor with dimensions (but a copy's), a conjugate
// or negative view, a copy with the host while a side stream is current, an out= argument
// to grow where the CPU allocator's wrapper cannot serve -- is handed to the op's Python
// kernel, so that results and errors stay the Python ones.
// Switched by torchport/ops/native_hostops.py like the view and empty kernels.
#if __has_include(<Python.h>)
#include <ATen/ScalarOps.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>

#include <atomic>
#include <bitset>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <type_traits>
#include <utility>
#include <vector>

#include "native_layer.h"


namespace {

using torchport::cpu_alias;
constexpr auto kDevice = c10::DeviceType::PrivateUse1;

// What the kernels share: the Python `result(cpu_tensor, index)` function for results not
// copied here, the bounds, and the counts tests read.
PyObject* python_result = nullptr;
uint64_t functional_input_max = 0;  // bytes: a larger first input takes the Python kernel
uint64_t copy_max = 0;              // bytes: larger new results go to `result`
bool results_in_blocks = false;     // the CPU kernels' new tensors are device blocks
int visible = 0;
std::bitset<256> refused;  // dtypes the device refuses: their new results go to `result`
std::atomic<int64_t> served{0};
std::atomic<int64_t> handed{0};
std::atomic<int64_t> moved{0};  // new results copied or converted after the CPU kernel
std::mutex registering;
std::unique_ptr<torch::Library> registered;
std::vector<std::string> registered_names;

// The learnt CPU fallback: the Python fallback(keyset, op, *args, **kwargs), whether the
// learnt overloads are served here now, and the calls handed to Python.
PyObject* fallback_python = nullptr;
std::atomic<bool> fallback_serving{false};
std::atomic<int64_t> fallback_calls{0};  // calls this fallback handed to the Python one
std::unique_ptr<torch::Library> fallback_registered;
// The ops routed to that fallback although PyTorch gives the device a kernel for them (a
// CompositeExplicitAutograd one CUDA never runs): their PrivateUse1 kernel is it too.
std::unique_ptr<torch::Library> fallback_routes;

void call_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// An unboxed call's arguments on a stack without counting a reference to its tensors: the
// caller holds them for the call. Their IValues are emptied, uncounted, when it goes.
struct LentStack {
  torch::jit::Stack stack;
  ~LentStack() {
    for (c10::IValue& v : stack)
      if (v.isTensor()) c10::MaybeOwnedTraits<c10::IValue>::destroyBorrow(v);
  }
};
inline c10::IValue lend(const at::Tensor& t) {
  return c10::IValue(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t));
}
inline c10::IValue lend(const c10::Scalar& s) { return c10::IValue(s); }


class HostOp final : public c10::OperatorKernel {
 public:
  HostOp(PyObject* python, bool functional, bool cpu_tensors, bool to_copy, bool composite,
         bool device_checked, bool fallback = false, uint64_t written = 0,
         bool stageable = false, bool staged_core = false, bool overwrites_self = false)
      : python_(python),
        functional_(functional),
        cpu_tensors_(cpu_tensors),
        to_copy_(to_copy),
        composite_(composite),
        device_checked_(device_checked),
        fallback_(fallback),
        written_(written),
        stageable_(stageable || staged_core),
        staged_core_(staged_core),
        overwrites_self_(overwrites_self) {
    Py_INCREF(python_);  // kept for the process, as the Python registration keeps it
  }

  // A tensor argument this kernel maps: a plain strided tensor of a visible device, the same
  // device as the others (`index`, set by the first); `cpu_scalar`: a Python number passes as
  // it is, and a 0-dim CPU tensor for a copy or for an op whose devices CUDA's registration
  // does not compare (TensorIterator's CPU scalar); for the others it takes the Python
  // kernel, whose device check raises CUDA's error (hostexec.op_device); any strided CPU
  // tensor passes for a copy between the host and the device (`host` then set).
  bool servable(const at::Tensor& t, bool cpu_scalar, int& index, bool& host) const {
    if (!t.defined()) return true;
    if (t.device().type() != kDevice) {
      if (t.device().type() != c10::DeviceType::CPU) return false;
      if (cpu_scalar && t.dim() == 0 &&
          (cpu_tensors_ || !device_checked_ || t.unsafeGetTensorImpl()->is_wrapped_number()))
        return true;
      if (!cpu_tensors_ || t.layout() != c10::Layout::Strided ||
          t.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
        return false;
      host = true;
      return true;
    }
    const int d = t.device().index();
    if ((index >= 0 && d != index) || d < 0 || d >= visible ||
        t.layout() != c10::Layout::Strided || t.is_conj() || t.is_neg() ||
        t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
        (functional_ && index < 0 && !results_in_blocks && !torchport::staging_on() &&
         static_cast<uint64_t>(t.numel()) * t.itemsize() > functional_input_max))
      return false;
    index = d;
    return true;
  }

  // The unboxed entry of an op of tensors and numbers returning one tensor: queued from its
  // arguments as they are where queued() would queue it, else the boxed kernel. A boxed
  // call's stack holds a counted reference to each argument; for a tensor Python holds, the
  // first such reference also takes its PyObject's, under the GIL, and gives it back after.
  template <class... Args>
  at::Tensor functional_call(const c10::OperatorHandle& op, const at::Tensor& self,
                             const Args&... args) {
    c10::SmallVector<at::Tensor, 1> results;
    if (queued_unboxed(op, results, self, args...)) return results.empty() ? self : results[0];
    torch::jit::Stack stack;
    boxed_call(op, stack, self, args...);
    return std::move(stack.back()).toTensor();
  }

  // The same for an op writing its first argument and returning it.
  template <class... Args>
  at::Tensor& in_place_call(const c10::OperatorHandle& op, at::Tensor& self,
                            const Args&... args) {
    c10::SmallVector<at::Tensor, 1> results;
    if (!queued_unboxed(op, results, self, args...)) {
      torch::jit::Stack stack;
      boxed_call(op, stack, self, args...);
    }
    return self;
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    if (torchport::queued_mode()) {  // (a random op draws at the call: its Python kernel)
      if (random(op)) return python(op, stack);
      const bool core = to_copy_ || cpu_tensors_ || fallback_;
      if (!core && queued(op, stack)) return;
      if (core && !host_turn(op, *stack, false)) return python(op, stack);
    }
    if (to_copy_) return to_copy(op, stack);
    if (composite_) return composite(op, stack);
    // device-only memory: the learnt fallback's calls through the runtime's copies, and the
    // core kernels' blocking copies of small tensors
    const bool staged = (fallback_ || staged_core_) && torchport::staging_on();
    if (staged && !stageable_) return python(op, stack);
    const auto& schema = op.schema();
    const size_t nargs = schema.arguments().size();
    const size_t first = stack->size() - nargs;
    if (staged && staged_core_ && !staged_core_servable(schema, *stack, first))
      return python(op, stack);
    int index = -1;
    bool host = false;
    int drawn = -1;  // a random op's generator argument
    // 1. Is the call one this kernel serves?
    for (size_t i = 0; i < nargs; ++i) {
      const c10::IValue& v = (*stack)[first + i];
      if (v.isGenerator() || (v.isNone() && is_generator(schema.arguments()[i]))) {
        drawn = static_cast<int>(i);
      } else if (v.isTensor()) {
        // a 0-dim CPU tensor is an operand, never an output: CUDA raises for a written one
        const auto* alias = schema.arguments()[i].alias_info();
        if (!servable(v.toTensor(), /*cpu_scalar=*/alias == nullptr || !alias->isWrite(), index,
                      host))
          return python(op, stack);
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList())
          if (!servable(t, false, index, host)) return python(op, stack);
      } else if (v.isList()) {
        if (v.isIntList() || v.isDoubleList() || v.isBoolList()) continue;
        for (const c10::IValue& e : v.toListRef()) {  // Tensor?[] (indices), Scalar[]
          if (e.isTensor() ? !servable(e.toTensor(), false, index, host)
                           : !(e.isNone() || e.isScalar()))
            return python(op, stack);
        }
      } else if (v.isObject()) {
        return python(op, stack);
      }
    }
    // (once the interpreter exits, the allocator serves no more blocks: an op that makes
    // no tensor, Tensor.item in a finaliser, still runs here)
    if (index < 0 || (!torchport::caching_serves() && makes_tensors(schema)))
      return python(op, stack);
    // A blocking copy with the host waits for the device's current stream: the Python
    // kernel orders it so where a side stream is current.
    if (host && torchport::caching_current_stream(static_cast<c10::DeviceIndex>(index)) != 0)
      return python(op, stack);
    // (a staged call's copies are ordered after the default stream's work only)
    if (staged && torchport::caching_current_stream(static_cast<c10::DeviceIndex>(index)) != 0)
      return python(op, stack);
    if (staged && overwrites_self_ && !host) {
      // a copy within the device of one span of bytes: the runtime's copy in C (the same
      // elements: nothing to copy; spans that overlap otherwise: the Python kernel's error)
      const at::Tensor self = (*stack)[first].toTensor();
      const at::Tensor& src = (*stack)[first + 1].toTensor();
      if (plain_within(self, src)) {
        const auto dst = reinterpret_cast<uint64_t>(self.data_ptr());
        const auto from = reinterpret_cast<uint64_t>(src.data_ptr());
        const uint64_t nbytes = static_cast<uint64_t>(self.numel()) * self.itemsize();
        if (dst != from && (dst < from + nbytes && from < dst + nbytes))
          return python(op, stack);
        if (dst != from && !torchport::staged_copy_within(index, dst, from, nbytes))
          return python(op, stack);
        torch::jit::drop(*stack, nargs);
        stack->emplace_back(self);
        served.fetch_add(1, std::memory_order_relaxed);
        return;
      }
    }
    std::optional<torchport::Staged> staging;
    // A staged call's copies call the runtime's Python (where it gives no C copies): one
    // hold of Ctrl-C for all of them and the CPU kernel between (each copy would otherwise
    // query SIGINT's handler, a system call); released before the Python fallback takes
    // the call over.
    std::optional<torchport::CallbackInterrupts> held;
    if (staged) {
      if (!torchport::staging_native()) held.emplace();
      staging.emplace(index);
      for (size_t i = 0; i < nargs; ++i) {
        const c10::IValue& v = (*stack)[first + i];
        const c10::Argument& a = schema.arguments()[i];
        if (v.isTensor()) {  // an out= (written, keyword-only, not written unannounced)
          staging->add(v.toTensor(), (a.kwarg_only() && a.alias_info() != nullptr &&
                                      a.alias_info()->isWrite()) ||
                                         (i == 0 && overwrites_self_));
        } else if (v.isTensorList()) {
          for (const at::Tensor& t : v.toTensorList()) staging->add(t);
        } else if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
          for (const c10::IValue& e : v.toListRef())
            if (e.isTensor()) staging->add(e.toTensor());
        }
      }
      staging->fetch();
    }

    // 2. CPU tensors over the device tensors' memory: one per tensor, one storage per storage.
    // device -> CPU; holding the device tensors: an argument only the stack held (a
    // temporary of a composite op) keeps its memory until the CPU kernel is done with it
    c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 6> tensors;
    c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 6> storages;
    c10::SmallVector<c10::IValue, 8> originals;  // what an op writing its arguments was given
    if (!functional_ || host) originals.assign((*stack).begin() + first, (*stack).end());
    // A random op draws from the CPU generator of the device's generator (the default one
    // of the device for none), as the Python kernels do: the CPU's numbers for the seed.
    if (drawn >= 0) {
      at::Generator cpu = torchport::drawing_generator(
          (*stack)[first + drawn], static_cast<c10::DeviceIndex>(index));
      if (!cpu.defined()) {  // another type's: its error there
        held.reset();
        return python(op, stack);
      }
      (*stack)[first + drawn] = c10::IValue(std::move(cpu));
    }
    // One taking no generator (native_dropout) draws from the CPU's default generator, which
    // draws the device's numbers while its CPU kernel runs.
    std::optional<torchport::DefaultDrawsFrom> drawing;
    if (drawn < 0 && random(op)) {
      at::Generator cpu = torchport::drawing_generator(c10::IValue(),
                                                       static_cast<c10::DeviceIndex>(index));
      if (!cpu.defined()) {
        held.reset();
        return python(op, stack);
      }
      drawing.emplace(std::move(cpu));
    }
    // the CPU kernel may grow the storages of an op writing its arguments (an out= it
    // resizes): into blocks of the device, which the device storages then take
    const bool grow = !functional_ && !host && results_in_blocks && !staged;
    auto to_cpu = [&](const at::Tensor& t) {
      return staged ? staging->cpu(t) : cpu_alias(t, tensors, storages, grow);
    };
    for (size_t i = 0; i < nargs; ++i) {
      c10::IValue& v = (*stack)[first + i];
      if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        if (t.defined() && t.device().type() == kDevice) v = c10::IValue(to_cpu(t));
      } else if (v.isTensorList()) {
        c10::List<at::Tensor> mapped;
        mapped.reserve(v.toTensorList().size());
        for (const at::Tensor& t : v.toTensorList())
          mapped.push_back(t.defined() ? to_cpu(t) : t);
        v = c10::IValue(std::move(mapped));
      } else if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
        c10::impl::GenericList mapped(v.toList().elementType());
        mapped.reserve(v.toList().size());
        for (const c10::IValue& e : v.toListRef())
          mapped.push_back(e.isTensor() && e.toTensor().defined()
                               ? c10::IValue(to_cpu(e.toTensor()))
                               : e);
        v = c10::IValue(std::move(mapped));
      }
    }

    // 3. The CPU kernel (its new tensors in blocks of the device; a copy with the host
    // allocates the host's). Where it raises, the device tensors are as they were: a block
    // it grew a storage into returns as the CPU storage dies.
    try {
      torchport::HostResultsIn results(host || !results_in_blocks || staged ? -1 : index);
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    } catch (const c10::Error& e) {
      // an out= argument to grow where the CPU storages cannot grow: nothing computed yet,
      // the Python kernel resizes the device tensor
      if (grow || functional_ || std::strstr(e.what(), "not resizable") == nullptr) throw;
      drawing.reset();
      restore(stack, first, originals);
      held.reset();
      return python(op, stack);
    }

    if (staged) return staged_results(schema, stack, originals, *staging);
    // 4. Storages the CPU kernel grew, then written arguments whose layout it changed (an
    // out= it resized).
    if (grow)
      for (auto& [dev, cpu] : storages)
        if (cpu.unsafeGetStorageImpl()->data_ptr().get() != dev->data_ptr().get())
          torchport::host_storage_grown(
              cpu.unsafeGetStorageImpl(),
              c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(dev)), index);
    for (size_t i = 0; i < originals.size(); ++i) {
      const c10::AliasInfo* info = schema.arguments()[i].alias_info();
      if (info == nullptr || !info->isWrite() || !originals[i].isTensor()) continue;
      const at::Tensor& dev = originals[i].toTensor();
      c10::TensorImpl* impl = dev.unsafeGetTensorImpl();
      for (auto& [held, cpu] : tensors) {
        if (held.unsafeGetTensorImpl() != impl) continue;
        TORCH_CHECK(cpu.storage().unsafeGetStorageImpl() ==
                        mapped_storage(held.storage().unsafeGetStorageImpl(), storages),
                    "torchport: the CPU kernel of ", schema.name(), " gave its written "
                    "argument '", schema.arguments()[i].name(), "' another storage, which "
                    "the device tensor cannot follow; run it with TORCHPORT_NATIVE=0 and "
                    "report it");
        if (cpu.sizes() != dev.sizes() || cpu.strides() != dev.strides() ||
            cpu.storage_offset() != dev.storage_offset())
          impl->set_sizes_and_strides(cpu.sizes(), cpu.strides(), cpu.storage_offset());
        if (cpu.is_conj() || cpu.is_neg()) torchport::store_lazy_bits(cpu);
      }
    }

    // 5. Results on the device.
    const size_t nret = schema.returns().size();
    for (size_t r = stack->size() - nret; r < stack->size(); ++r) {
      c10::IValue& v = (*stack)[r];
      if (v.isTensor()) {
        if (v.toTensor().defined() && !(host && given(v.toTensor(), originals)))
          v = c10::IValue(on_device(v.toTensor(), index, tensors, storages));
      } else if (v.isTensorList()) {
        c10::List<at::Tensor> results;
        results.reserve(v.toTensorList().size());
        for (const at::Tensor& t : v.toTensorList())
          results.push_back(t.defined() ? on_device(t, index, tensors, storages) : t);
        v = c10::IValue(std::move(results));
      }
    }
    served.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  // torchport's `_to_copy` (Tensor.to with a dtype or device, .cpu(), .float()): the CPU
  // kernel on the CPU tensor over the device tensor's memory (or the CPU tensor itself) makes
  // the result, which a copy to the device then copies (or adopts) into a new block.
  // _to_copy(Tensor self, *, ScalarType? dtype, Layout? layout, Device? device,
  //          bool? pin_memory, bool non_blocking, MemoryFormat? memory_format)
  void to_copy(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    const size_t first = stack->size() - 7;
    const at::Tensor self = (*stack)[first].toTensor();
    const c10::IValue& layout = (*stack)[first + 2];
    const c10::IValue& device = (*stack)[first + 3];
    const c10::IValue& pin = (*stack)[first + 4];
    if ((!layout.isNone() && layout.toLayout() != c10::Layout::Strided) ||
        (!pin.isNone() && pin.toBool()) || self.layout() != c10::Layout::Strided ||
        self.is_conj() || self.is_neg() || self.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
      return python(op, stack);
    const bool from_device = self.device().type() == kDevice;
    const c10::Device to = device.isNone() ? self.device() : device.toDevice();
    // (once the interpreter exits, the allocator serves no more blocks; a copy to the host,
    // `t.cpu()` in a finaliser, needs none)
    if (to.type() == kDevice && !torchport::caching_serves()) return python(op, stack);
    int index = -1;
    if (to.type() == kDevice) {
      index = to.has_index() ? to.index() : torchport::guard_current_device();
      if ((from_device && index != self.device().index()) ||
          (!from_device && self.device().type() != c10::DeviceType::CPU))
        return python(op, stack);
    } else if (to.type() == c10::DeviceType::CPU && from_device) {
      index = self.device().index();
    }
    if (index < 0 || index >= visible) return python(op, stack);
    const c10::IValue& dtype = (*stack)[first + 1];
    if (to.type() == kDevice &&
        refused[static_cast<size_t>(dtype.isNone() ? self.scalar_type() : dtype.toScalarType())])
      return python(op, stack);  // its error
    // a copy with the host waits for the current stream: the Python kernel orders it so
    if ((!from_device || to.type() != kDevice) &&
        torchport::caching_current_stream(static_cast<c10::DeviceIndex>(index)) != 0)
      return python(op, stack);
    // device-only memory: a small tensor's bytes between the host and the device through
    // the runtime's copies, in the default stream's order (staged_core_servable)
    const bool staged = staged_core_ && torchport::staging_on();
    if (staged && ((from_device && to.type() == kDevice &&
                    plain_bytes(self, dtype.isNone() ? self.scalar_type() : dtype.toScalarType(),
                                (*stack)[first + 6])) ||
                   self.is_quantized() ||
                   self._is_zerotensor() || torchport::Staged::bytes(self) > copy_max ||
                   ((*stack)[first + 5].isBool() && (*stack)[first + 5].toBool()) ||
                   torchport::caching_current_stream(static_cast<c10::DeviceIndex>(index)) != 0))
      return python(op, stack);
    std::optional<torchport::CallbackInterrupts> held;
    std::optional<torchport::Staged> staging;
    c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 6> tensors;
    c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 6> storages;
    if (staged) {
      if (!torchport::staging_native()) held.emplace();
      staging.emplace(index);
      if (from_device) {
        staging->add(self);
        staging->fetch();
        (*stack)[first] = c10::IValue(staging->cpu(self));
      } else if ((dtype.isNone() || dtype.toScalarType() == self.scalar_type()) &&
                 ((*stack)[first + 6].isNone() ||
                  (*stack)[first + 6].toMemoryFormat() == c10::MemoryFormat::Preserve) &&
                 self.is_non_overlapping_and_dense()) {
        // a host tensor to the device as it is: its bytes, its strides (the CPU's
        // _to_copy would copy them first)
        at::Tensor result = staging->on_device(self);
        torch::jit::drop(*stack, 7);
        stack->emplace_back(std::move(result));
        served.fetch_add(1, std::memory_order_relaxed);
        return;
      }
    } else if (from_device) {
      (*stack)[first] = c10::IValue(cpu_alias(self, tensors, storages));
    }
    (*stack)[first + 3] = c10::IValue(c10::Device(c10::DeviceType::CPU));
    {
      torchport::HostResultsIn results(
          to.type() == kDevice && results_in_blocks && !staged ? index : -1);
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    }
    if (to.type() == kDevice) {
      at::Tensor cpu = stack->back().toTensor();
      tensors.clear();
      storages.clear();  // the result is new: nothing of it is an argument's
      stack->back() = c10::IValue(staged ? staging->on_device(cpu)
                                         : on_device(cpu, index, tensors, storages));
    }
    served.fetch_add(1, std::memory_order_relaxed);
  }

  // A copy within the device that is one span of bytes (the same dtype, both contiguous,
  // `format` of a _to_copy none, preserve or contiguous): the runtime's copy_d2d serves it,
  // on the device. Any other goes through the host (a cast, a transpose made contiguous),
  // as the Python kernel copies it too.
  static bool plain_bytes(const at::Tensor& src, c10::ScalarType dtype, const c10::IValue& format) {
    if (!format.isNone() && format.toMemoryFormat() != c10::MemoryFormat::Preserve &&
        format.toMemoryFormat() != c10::MemoryFormat::Contiguous)
      return false;
    return src.scalar_type() == dtype && src.is_contiguous();
  }

  // `self.copy_(src)` within one device as one span of bytes.
  static bool plain_within(const at::Tensor& self, const at::Tensor& src) {
    return self.sizes().equals(src.sizes()) && self.is_contiguous() &&
           plain_bytes(src, self.scalar_type(), c10::IValue());
  }

  // A core kernel's call on device-only memory served here: a copy between the host and the
  // device, one within the device that is not one span of bytes (a span stays the runtime's
  // copy_d2d or the vendor's kernel, on the device), or Tensor.item; a blocking one
  // (non_blocking copies keep their Python kernel's ordering on the stream); each device
  // tensor spanning at most `copy_max` bytes (a larger one is copied once by the Python
  // kernel, where this copies it into staging and then again).
  bool staged_core_servable(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                            size_t first) const {
    const auto& arguments = schema.arguments();
    if (overwrites_self_ && stack[first].isTensor() && stack[first + 1].isTensor()) {
      const at::Tensor& self = stack[first].toTensor();
      const at::Tensor& src = stack[first + 1].toTensor();
      if (self.device().type() == kDevice && src.device().type() == kDevice &&
          (self.device() != src.device() ||
           (plain_within(self, src) && !torchport::staging_within())))
        return false;
    }
    for (size_t i = 0; i < arguments.size(); ++i) {
      const c10::IValue& v = stack[first + i];
      if (v.isBool() && v.toBool() && arguments[i].name() == "non_blocking") return false;
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kDevice &&
          torchport::Staged::bytes(v.toTensor()) > copy_max)
        return false;
    }
    return true;
  }

  // A staged call's written arguments copied back (its schema's and the hidden ones the
  // Python fallback taught), then its results on the device.
  void staged_results(const c10::FunctionSchema& schema, torch::jit::Stack* stack,
                      const c10::SmallVectorImpl<c10::IValue>& originals,
                      torchport::Staged& staging) {
    for (size_t i = 0; i < originals.size(); ++i) {
      const c10::AliasInfo* info = schema.arguments()[i].alias_info();
      if (!((info != nullptr && info->isWrite()) || (i < 64 && (written_ >> i) & 1))) continue;
      const c10::IValue& v = originals[i];
      if (v.isTensor()) {
        staging.store(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) staging.store(t);
      }
    }
    const size_t nret = schema.returns().size();
    // (a host tensor given and returned, a copy's destination, is returned as it is)
    auto given_host = [&](const at::Tensor& t) {
      if (t.device().type() == kDevice) return false;
      for (const c10::IValue& o : originals)
        if (o.isTensor() && o.toTensor().unsafeGetTensorImpl() == t.unsafeGetTensorImpl())
          return true;
      return false;
    };
    for (size_t r = stack->size() - nret; r < stack->size(); ++r) {
      c10::IValue& v = (*stack)[r];
      if (v.isTensor()) {
        if (v.toTensor().defined() && !given_host(v.toTensor()))
          v = c10::IValue(staging.on_device(v.toTensor()));
      } else if (v.isTensorList()) {
        c10::List<at::Tensor> results;
        results.reserve(v.toTensorList().size());
        for (const at::Tensor& t : v.toTensorList())
          results.push_back(t.defined() ? staging.on_device(t) : t);
        v = c10::IValue(std::move(results));
      }
    }
    served.fetch_add(1, std::memory_order_relaxed);
  }

  // Is the argument a random op's generator (Generator?)?
  static bool is_generator(const c10::Argument& a) {
    const c10::TypePtr& t = a.real_type();
    return t->kind() == c10::TypeKind::OptionalType &&
           t->castRaw<c10::OptionalType>()->getElementType()->kind() ==
               c10::TypeKind::GeneratorType;
  }

  // Does the op draw random numbers (PyTorch's tag, or a generator argument)?
  bool random(const c10::OperatorHandle& op) {
    int8_t known = random_.load(std::memory_order_relaxed);
    if (known < 0) {
      known = op.hasTag(at::Tag::nondeterministic_seeded) ? 1 : 0;
      for (const c10::Argument& a : op.schema().arguments())
        if (is_generator(a)) known = 1;
      random_.store(known, std::memory_order_relaxed);
    }
    return known == 1;
  }

  // Does the op return a tensor (anything but numbers: Tensor.item does not)?
  static bool makes_tensors(const c10::FunctionSchema& schema) {
    for (const c10::Argument& r : schema.returns())
      if (r.type()->kind() != c10::TypeKind::NumberType &&
          r.type()->kind() != c10::TypeKind::IntType &&
          r.type()->kind() != c10::TypeKind::FloatType &&
          r.type()->kind() != c10::TypeKind::BoolType)
        return true;
    return false;
  }

  // A factory whose CPU kernel is PyTorch's composite one (full, arange, zeros_like): that
  // kernel, as for the CPU; it makes its tensor on the device its arguments name (the
  // device's empty) and fills it there (these host-op kernels). Pinned memory, and calls
  // once the interpreter exits, take the Python kernel.
  void composite(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    const auto& arguments = op.schema().arguments();
    const size_t first = stack->size() - arguments.size();
    if (!torchport::caching_serves()) return python(op, stack);
    for (size_t i = 0; i < arguments.size(); ++i) {
      const c10::IValue& v = (*stack)[first + i];
      if (arguments[i].name() == "pin_memory" && v.isBool() && v.toBool())
        return python(op, stack);
      // (a random one given another type's generator: the error names the op called)
      if (v.isGenerator() && v.toGenerator().device().type() != kDevice)
        return python(op, stack);
    }
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    served.fetch_add(1, std::memory_order_relaxed);
  }

  // Is `cpu` a CPU tensor the caller passed (the host side of a copy, returned as it is)?
  static bool given(const at::Tensor& cpu, const c10::SmallVectorImpl<c10::IValue>& originals) {
    for (const c10::IValue& v : originals)
      if (v.isTensor() && v.toTensor().unsafeGetTensorImpl() == cpu.unsafeGetTensorImpl())
        return true;
    return false;
  }

  // The CPU storage standing for device storage `st` (null: none).
  static c10::StorageImpl* mapped_storage(
      c10::StorageImpl* st,
      const c10::SmallVectorImpl<std::pair<c10::StorageImpl*, c10::Storage>>& storages) {
    for (auto& [dev, cpu] : storages)
      if (dev == st) return cpu.unsafeGetStorageImpl();
    return nullptr;
  }

  // A result of the CPU kernel as the device's: an argument itself, a view of an argument's
  // memory, or a new tensor copied (or handed to `result`).
  static at::Tensor on_device(const at::Tensor& cpu, int index,
                              const c10::SmallVectorImpl<std::pair<at::Tensor, at::Tensor>>& tensors,
                              const c10::SmallVectorImpl<std::pair<c10::StorageImpl*, c10::Storage>>& storages) {
    c10::TensorImpl* impl = cpu.unsafeGetTensorImpl();
    for (auto& [dev, alias] : tensors)
      if (alias.unsafeGetTensorImpl() == impl) return dev;
    if (cpu.has_storage()) {
      c10::StorageImpl* st = cpu.storage().unsafeGetStorageImpl();
      for (size_t i = 0; i < storages.size(); ++i) {
        if (storages[i].second.unsafeGetStorageImpl() != st) continue;
        c10::Storage dev_storage(
            c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storages[i].first));
        at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(
            std::move(dev_storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
            cpu.dtype());
        view.unsafeGetTensorImpl()->set_sizes_and_strides(cpu.sizes(), cpu.strides(),
                                                         cpu.storage_offset());
        return view;
      }
    }
    const uint64_t nbytes = static_cast<uint64_t>(cpu.numel()) * cpu.itemsize();
    const bool plain = cpu.layout() == c10::Layout::Strided && !cpu.is_quantized() &&
                       !cpu._is_zerotensor() && !refused[static_cast<size_t>(cpu.scalar_type())] &&
                       !cpu.is_conj() && !cpu.is_neg();
    if (plain) {  // computed into a block of the device already
      at::Tensor taken = torchport::host_result_on_device(cpu, index);
      if (taken.defined()) return taken;
    }
    moved.fetch_add(1, std::memory_order_relaxed);
    if (plain && nbytes <= copy_max && cpu.is_non_overlapping_and_dense()) {
      at::Tensor out = torchport::caching_new_tensor(
          index, nbytes, cpu.scalar_type(), cpu.sizes(), cpu.strides(),
          torchport::caching_current_stream(static_cast<c10::DeviceIndex>(index)));
      if (nbytes) std::memcpy(out.data_ptr(), cpu.data_ptr(), nbytes);
      return out;
    }
    return torchport::result_on_device(python_result, cpu, index);
  }

  // Queued mode, for the copies, Tensor.item and the learnt CPU fallback's calls: may the
  // host run the call now, as a synchronous runtime's? Those with the host (a CPU tensor, a
  // copy to or from it, a number read back) and the fallback's are run by their Python
  // kernels on the host after the current stream's queued work: here the same, once that
  // work has run. A copy within the device is queued by its Python kernel: here only where
  // nothing is queued. A side stream current, a non-blocking copy and a failure a
  // synchronising call must report take the Python kernel.
  // `with_host`: only a call with the host, else none.
  bool host_turn(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                 bool with_host) const {
    const auto& schema = op.schema();
    const auto& arguments = schema.arguments();
    const size_t first = stack.size() - arguments.size();
    int index = -1;
    bool host = fallback_;
    auto see = [&](const at::Tensor& t) {
      if (!t.defined()) return;
      if (t.device().type() != kDevice)
        host = true;
      else if (index < 0)
        index = t.device().index();
    };
    for (size_t i = 0; i < arguments.size(); ++i) {
      const c10::IValue& v = stack[first + i];
      if (v.isTensor()) {
        see(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) see(t);
      } else if (v.isList()) {
        for (const c10::IValue& e : v.toListRef())
          if (e.isTensor()) see(e.toTensor());
      } else if (v.isDevice()) {  // _to_copy's
        const c10::Device d = v.toDevice();
        if (d.type() != kDevice)
          host = true;
        else if (index < 0)
          index = d.has_index() ? d.index() : torchport::guard_current_device();
      } else if (v.isBool() && v.toBool() && arguments[i].name() == "non_blocking") {
        return false;
      }
    }
    for (const c10::Argument& r : schema.returns())
      if (r.type()->kind() != c10::TypeKind::TensorType) host = true;
    return index >= 0 && (host || !with_host) && torchport::queued_host_turn(index, host);
  }

  static void restore(torch::jit::Stack* stack, size_t first,
                      const c10::SmallVectorImpl<c10::IValue>& originals) {
    stack->resize(first);
    stack->insert(stack->end(), originals.begin(), originals.end());
  }

  // An asynchronous runtime with C++ queues: the call queued as the Python kernel taught it
  // for this layout (native_queued_ops.cpp), or the Python kernel, which may teach it; true.
  // False: the host's turn to compute the call now, as a synchronous runtime's -- one with a
  // CPU tensor (a 0-dim operand), which no layout key stands for and the Python kernel runs
  // on the host after the current stream's queued work (host_turn waited for it).
  bool queued(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    if (!composite_) {
      thread_local std::string key;  // (its memory kept from call to call)
      if (torchport::queued_serve(op, stack, queued_, key)) {
        served.fetch_add(1, std::memory_order_relaxed);
        return true;
      }
      if (!key.empty()) {
        std::string learning = key;  // (the Python kernel's own calls reuse `key`)
        torchport::QueuedTeaching teaching(op);
        python(op, stack);
        teaching.keep(queued_, std::move(learning));
        return true;
      }
      if (host_turn(op, *stack, true)) return false;
    }
    python(op, stack);
    return true;
  }

  // queued()'s call queued from the C++ queue's learnt layouts, from an unboxed call: true,
  // its new results in `results` (none for one written in place). False: the boxed kernel's.
  template <class... Args>
  bool queued_unboxed(const c10::OperatorHandle& op, c10::SmallVectorImpl<at::Tensor>& results,
                      const Args&... args) {
    if (!torchport::queued_mode() || composite_ || to_copy_ || cpu_tensors_ || fallback_ ||
        random(op))
      return false;
    LentStack lent;
    lent.stack.reserve(sizeof...(Args));
    (lent.stack.push_back(lend(args)), ...);
    thread_local std::string key;
    if (!torchport::queued_serve(op, &lent.stack, queued_, key, &results)) return false;
    served.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  template <class... Args>
  void boxed_call(const c10::OperatorHandle& op, torch::jit::Stack& stack, const Args&... args) {
    stack.reserve(sizeof...(Args));
    (stack.emplace_back(args), ...);
    (*this)(op, c10::DispatchKeySet(), &stack);
  }

  // The op's Python kernel (the Python fallback for a learnt one) on the arguments on the
  // stack; its results replace them.
  void python(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    handed.fetch_add(1, std::memory_order_relaxed);
    if (fallback_) return call_fallback(op, stack);
    torchport::python_kernel_call(python_, nullptr, op, stack);
  }

  PyObject* python_;
  bool functional_;
  bool cpu_tensors_;
  bool to_copy_;
  bool composite_;
  bool device_checked_;  // CUDA's registration compares its tensors' devices, CPU scalars too
  bool fallback_;        // a learnt overload of the CPU fallback
  uint64_t written_;     // (learnt) the arguments it writes, by index, its schema's or not
  bool stageable_;       // (learnt) served through the runtime's copies on device-only memory
  bool staged_core_;     // a core kernel (a copy, Tensor.item) served so on device-only memory
  bool overwrites_self_;  // (copy_) every element of its first argument is written
  torchport::QueuedCalls queued_;
  std::atomic<int8_t> random_{-1};  // random(op), once known
};

// The overloads the Python fallback taught, by the address of their schema (stable while
// the op is registered; the name is compared too, in case an op's registration was removed
// and another took its place).
struct Learnt {
  c10::OperatorName name;
  std::shared_ptr<HostOp> kernel;
};
std::mutex learning;
std::unordered_map<const c10::FunctionSchema*, Learnt> learnt;

std::shared_ptr<HostOp> learnt_kernel(const c10::OperatorHandle& op) {
  std::lock_guard<std::mutex> lock(learning);
  auto it = learnt.find(&op.schema());
  if (it == learnt.end() || !(it->second.name == op.operator_name())) return nullptr;
  return it->second.kernel;  // (held by the call: forgetting it meanwhile is safe)
}

// The device's boxed fallback while the C++ host-op kernels serve: a learnt overload's
// kernel (which hands the calls it does not serve to the Python fallback), else the Python
// fallback, which learns.
class LearntFallback final : public c10::OperatorKernel {
 public:
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                  torch::jit::Stack* stack) {
    if (fallback_serving.load(std::memory_order_acquire)) {
      std::shared_ptr<HostOp> kernel = learnt_kernel(op);
      if (kernel) return (*kernel)(op, ks, stack);
    }
    fallback_calls.fetch_add(1, std::memory_order_relaxed);
    call_fallback(op, stack);
  }
};

}  // namespace

namespace torchport {

namespace {

// A CPU storage over device memory (`resizable`: one the CPU kernel may grow, through the
// CPU allocator).
c10::Storage cpu_storage_over(void* data, size_t nbytes, bool resizable) {
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, c10::DataPtr(data, c10::Device(c10::kCPU)),
      resizable ? c10::GetCPUAllocator() : nullptr, resizable));
}

at::Tensor cpu_tensor_over(c10::Storage storage, caffe2::TypeMeta dtype, c10::IntArrayRef sizes,
                           c10::IntArrayRef strides, int64_t offset) {
  at::Tensor cpu = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype);
  cpu.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return cpu;
}

}  // namespace

// `t`'s CPU tensor, over a CPU storage of exactly its storage's bytes (`grow`: one the CPU
// kernel may grow, through the CPU allocator, where the device storage may grow).
at::Tensor cpu_alias(const at::Tensor& t,
                     c10::SmallVectorImpl<std::pair<at::Tensor, at::Tensor>>& tensors,
                     c10::SmallVectorImpl<std::pair<c10::StorageImpl*, c10::Storage>>& storages,
                     bool grow) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  for (auto& [dev, cpu] : tensors)
    if (dev.unsafeGetTensorImpl() == impl) return cpu;
  c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
  c10::Storage storage;
  for (auto& [dev, cpu] : storages)
    if (dev == st) storage = cpu;
  if (!storage) {
    storage = cpu_storage_over(const_cast<void*>(st->data_ptr().get()), st->nbytes(),
                               grow && st->resizable());
    storages.emplace_back(st, storage);
  }
  at::Tensor cpu = cpu_tensor_over(std::move(storage), t.dtype(), t.sizes(), t.strides(),
                                   t.storage_offset());
  tensors.emplace_back(t, cpu);
  return cpu;
}

void AliasesLater::add(uint32_t slot, const at::Tensor& t, int32_t element) {
  static_assert(std::is_trivially_copyable_v<Read>);
  const c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
  Read& r = tensors_.emplace_back();
  r.slot = slot;
  r.element = element;
  r.tensor = t.unsafeGetTensorImpl();
  r.storage = st;
  r.data = const_cast<void*>(st->data_ptr().get());
  r.nbytes = st->nbytes();
  r.offset = t.storage_offset();
  r.dtype = t.dtype();
  r.at = static_cast<uint32_t>(sizes_strides_.size());
  r.dim = static_cast<uint32_t>(t.dim());
  sizes_strides_.append(t.sizes().begin(), t.sizes().end());
  sizes_strides_.append(t.strides().begin(), t.strides().end());
}

void AliasesLater::make(torch::jit::Stack& stack) const {
  // (a list in the stack is the job's own, made for it: set in place)
  const auto made = [&](const Read& r) -> at::Tensor {
    const c10::IValue& v = stack[r.slot];
    if (r.element < 0) return v.toTensor();
    if (v.isTensorList()) return v.toTensorList().get(r.element);
    return *v.toOptionalTensorList().get(r.element);
  };
  const auto put = [&](const Read& r, at::Tensor cpu) {
    c10::IValue& v = stack[r.slot];
    if (r.element < 0) v = std::move(cpu);
    else if (v.isTensorList()) v.toTensorList().set(r.element, std::move(cpu));
    else v.toOptionalTensorList().set(r.element, std::optional<at::Tensor>(std::move(cpu)));
  };
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Read& r = tensors_[i];
    const Read* same = nullptr;  // the same tensor, or the same storage, made before
    for (size_t j = 0; j < i && (same == nullptr || same->tensor != r.tensor); ++j)
      if (tensors_[j].storage == r.storage) same = &tensors_[j];
    if (same != nullptr && same->tensor == r.tensor) {
      put(r, made(*same));
      continue;
    }
    const c10::IntArrayRef sizes(sizes_strides_.data() + r.at, r.dim),
        strides(sizes_strides_.data() + r.at + r.dim, r.dim);
    c10::Storage storage = same != nullptr ? made(*same).storage()
                                           : cpu_storage_over(r.data, r.nbytes, false);
    put(r, cpu_tensor_over(std::move(storage), r.dtype, sizes, strides, r.offset));
  }
}

// The CPU kernel set a lazy bit on its written argument's CPU tensor (linalg_lu_solve.out
// with left=False conjugates its out=): its memory holds the values before the bit, and
// the device tensor (which has none: one with a bit takes the Python kernel) must hold the
// values the bit means, as the Python kernels store them.
void store_lazy_bits(const at::Tensor& cpu) {
  at::Tensor raw = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(cpu.storage()), c10::DispatchKeySet(c10::DispatchKey::CPU), cpu.dtype());
  raw.unsafeGetTensorImpl()->set_sizes_and_strides(cpu.sizes(), cpu.strides(),
                                                   cpu.storage_offset());
  if (cpu.is_conj()) raw.conj_physical_();
  if (cpu.is_neg()) raw.neg_();
}

at::Tensor result_on_device(PyObject* result, const at::Tensor& cpu, int index) {
  pybind11::gil_scoped_acquire gil;
  PyObject* t = THPVariable_Wrap(cpu);
  if (!t) raise_python();
  PyObject* got = PyObject_CallFunction(result, "Oi", t, index);
  Py_DECREF(t);
  if (!got) raise_python();
  if (!THPVariable_Check(got)) {
    Py_DECREF(got);
    PyErr_SetString(PyExc_TypeError, "torchport: a host result function returned no tensor");
    raise_python();
  }
  at::Tensor dev = THPVariable_Unpack(got);
  Py_DECREF(got);
  return dev;
}

[[noreturn]] void raise_python() {
  python_error e;
  e.persist();
  throw std::move(e);
}

// An argument as the Python kernel receives it (dtype, layout and memory format objects,
// not the integers the dispatcher holds them as).
static py::object argument_object(const c10::Argument& arg, const c10::IValue& v) {
  if (v.isNone()) return py::none();
  const c10::Type* t = arg.real_type().get();
  if (auto opt = t->castRaw<c10::OptionalType>()) t = opt->getElementType().get();
  switch (t->kind()) {
    case c10::TypeKind::ScalarTypeType:
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(v.toScalarType())));
    case c10::TypeKind::LayoutType:
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPLayout(v.toLayout())));
    case c10::TypeKind::MemoryFormatType:
      return py::reinterpret_borrow<py::object>(
          torch::utils::getTHPMemoryFormat(v.toMemoryFormat()));
    default:
      return torch::jit::toPyObject(v);
  }
}

PyObject* python_argument(const c10::Argument& arg, const c10::IValue& v) {
  try {
    return argument_object(arg, v).release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

static void push_results(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                         const py::object& result);

void python_kernel_call(PyObject* fn, PyObject* prefix, const c10::OperatorHandle& op,
                        torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t first = stack->size() - arguments.size();
  pybind11::gil_scoped_acquire gil;
  py::object result;
  try {
    py::list args;
    if (prefix)
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(prefix); ++i)
        args.append(py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(prefix, i)));
    py::dict kwargs;
    for (size_t i = 0; i < arguments.size(); ++i) {
      py::object o = argument_object(arguments[i], (*stack)[first + i]);
      if (arguments[i].kwarg_only())
        kwargs[py::str(arguments[i].name())] = o;
      else
        args.append(o);
    }
    stack->resize(first);
    result = py::reinterpret_borrow<py::object>(fn)(*py::tuple(args), **kwargs);
  } catch (py::error_already_set& e) {
    e.restore();
    raise_python();
  }
  push_results(op, stack, result);
}

// A Python kernel's `result` on the stack as the op's returns (holding the GIL).
static void push_results(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                         const py::object& result) {
  const auto& returns = op.schema().returns();
  try {
    if (returns.size() == 1) {
      stack->push_back(torch::jit::toIValue(result, returns[0].real_type()));
    } else if (!returns.empty()) {
      py::tuple items = py::reinterpret_borrow<py::tuple>(result);
      for (size_t i = 0; i < returns.size(); ++i)
        stack->push_back(torch::jit::toIValue(items[i], returns[i].real_type()));
    }
  } catch (py::error_already_set& e) {
    e.restore();
    raise_python();
  }
}

}  // namespace torchport

namespace {

// The Python fallback on the call on the stack, given what PyTorch's own boxed Python
// fallback gives it (its registration and this one must not differ for the Python side):
// the keyset (None: torchport's fallbacks do not read it), the op's Python object, the
// positional arguments but the trailing ones that hold their default, and the keyword-only
// ones that do not hold theirs. Its results replace the arguments.
void call_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t n = arguments.size();
  const size_t first = stack->size() - n;
  auto defaulted = [&](size_t i) {
    const auto& d = arguments[i].default_value();
    return d.has_value() && *d == (*stack)[first + i];
  };
  size_t keywords = n;
  while (keywords > 0 && arguments[keywords - 1].kwarg_only()) --keywords;
  size_t positional = keywords;
  while (positional > 0 && defaulted(positional - 1)) --positional;
  pybind11::gil_scoped_acquire gil;
  py::object result;
  try {
    py::tuple args(2 + positional);
    args[0] = py::none();
    args[1] = py::reinterpret_borrow<py::object>(torch::detail::getTorchApiFunction(op));
    for (size_t i = 0; i < positional; ++i)
      args[2 + i] = torchport::argument_object(arguments[i], (*stack)[first + i]);
    py::dict kwargs;
    for (size_t i = keywords; i < n; ++i)
      if (!defaulted(i))
        kwargs[py::str(arguments[i].name())] =
            torchport::argument_object(arguments[i], (*stack)[first + i]);
    stack->resize(first);
    result = py::reinterpret_borrow<py::object>(fallback_python)(*args, **kwargs);
  } catch (py::error_already_set& e) {
    e.restore();
    torchport::raise_python();
  }
  torchport::push_results(op, stack, result);
}

// An op of tensors and numbers returning one new tensor, or one writing its first argument
// and returning it: its kernel's unboxed entry. Unboxed calls (every call from C++: the
// Python bindings, autograd, composite ops) then reach the kernel with their arguments as
// they are. Its boxed entry unboxes a boxed call's stack for it.
using TensorArg = const at::Tensor&;
using ScalarArg = const c10::Scalar&;

template <class... Args>
torch::CppFunction functional_entry(std::shared_ptr<HostOp> k, c10::OperatorHandle op) {
  return torch::CppFunction([k, op](TensorArg self, Args... args) -> at::Tensor {
    return k->functional_call(op, self, args...);
  });
}

template <class... Args>
torch::CppFunction in_place_entry(std::shared_ptr<HostOp> k, c10::OperatorHandle op) {
  return torch::CppFunction([k, op](at::Tensor& self, Args... args) -> at::Tensor& {
    return k->in_place_call(op, self, args...);
  });
}

// The op's arguments as letters ('T' a tensor, 'W' a tensor it writes, 'S' a number), with
// '>' then the return ('T', 'W'); empty for any other schema.
std::string arguments_shape(const c10::FunctionSchema& schema) {
  auto letter = [](const c10::Argument& a) -> char {
    const c10::TypeKind kind = a.type()->kind();
    if (kind == c10::TypeKind::NumberType) return a.alias_info() ? 0 : 'S';
    if (kind != c10::TypeKind::TensorType) return 0;
    if (!a.alias_info()) return 'T';
    return a.alias_info()->isWrite() ? 'W' : 0;
  };
  std::string shape;
  for (const c10::Argument& a : schema.arguments()) {
    const char c = letter(a);
    if (!c) return "";
    shape += c;
  }
  if (schema.returns().size() != 1 || schema.is_vararg() || schema.is_varret()) return "";
  const char r = letter(schema.returns()[0]);
  if (!r) return "";
  return shape + '>' + r;
}

// The kernel for the op `name` ("add.Tensor"): unboxed and boxed where its schema is one of
// the shapes below, boxed only otherwise.
torch::CppFunction host_op_entry(const char* name, std::unique_ptr<HostOp> kernel) {
  const char* dot = std::strchr(name, '.');
  const c10::OperatorName opname(std::string("aten::") + (dot ? std::string(name, dot) : name),
                                 dot ? dot + 1 : "");
  const auto op = c10::Dispatcher::singleton().findSchema(opname);
  const std::string shape = op ? arguments_shape(op->schema()) : "";
  std::shared_ptr<HostOp> k(std::move(kernel));
  using T = TensorArg;
  using S = ScalarArg;
  if (shape == "T>T") return functional_entry<>(k, *op);
  if (shape == "TT>T") return functional_entry<T>(k, *op);
  if (shape == "TS>T") return functional_entry<S>(k, *op);
  if (shape == "TTS>T") return functional_entry<T, S>(k, *op);
  if (shape == "TSS>T") return functional_entry<S, S>(k, *op);
  if (shape == "TTT>T") return functional_entry<T, T>(k, *op);
  if (shape == "TTTSS>T") return functional_entry<T, T, S, S>(k, *op);
  if (shape == "W>W") return in_place_entry<>(k, *op);
  if (shape == "WT>W") return in_place_entry<T>(k, *op);
  if (shape == "WS>W") return in_place_entry<S>(k, *op);
  if (shape == "WTS>W") return in_place_entry<T, S>(k, *op);
  if (shape == "WSS>W") return in_place_entry<S, S>(k, *op);
  struct Boxed final : public c10::OperatorKernel {
    std::shared_ptr<HostOp> k;
    void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                    torch::jit::Stack* stack) {
      (*k)(op, ks, stack);
    }
  };
  auto boxed = std::make_unique<Boxed>();
  boxed->k = std::move(k);
  return torch::CppFunction::makeFromBoxedFunctor(std::move(boxed));
}

}  // namespace

// Serve the ops in `kernels` (a dict: overload name -> (Python kernel, functional flag, CPU
// tensors of any size pass, a composite factory, CUDA compares its tensors' devices))
// from C++, with `result` for the results not copied here (and those of the dtypes in
// `refuse`, a list of torch.dtype, which it refuses), `devices` visible devices, functional
// inputs up to `input_max` bytes and copies up to `copy_max` bytes; `staged`: the device's
// memory is device-only, and these are core kernels whose small blocking calls go through
// the runtime's copies (native_staged.cpp): 1; 0 with a Python error. Ops already served
// stay. Called through ctypes.PyDLL (with the GIL).
extern "C" int torchport_native_hostops_enable(PyObject* kernels, PyObject* result,
                                               PyObject* refuse, int devices,
                                               int64_t input_max, int64_t max_copy,
                                               int staged) {
  if (!PyDict_Check(kernels) || !PyCallable_Check(result) || !PyList_Check(refuse)) {
    PyErr_SetString(PyExc_TypeError, "expected a dict of kernels, a callable and a list");
    return 0;
  }
  std::bitset<256> dtypes;
  if (!torchport::read_dtype_set(refuse, dtypes)) return 0;
  std::lock_guard<std::mutex> lock(registering);
  refused = dtypes;
  Py_INCREF(result);
  Py_XDECREF(python_result);
  python_result = result;
  visible = devices;
  functional_input_max = static_cast<uint64_t>(input_max);
  copy_max = static_cast<uint64_t>(max_copy);
  // (staged calls make their results in host memory and copy them)
  results_in_blocks = staged == 0 && torchport::host_results_install();
  try {
    if (!registered) {
      registered = std::make_unique<torch::Library>(
          torch::Library::IMPL, "aten", std::make_optional(c10::DispatchKey::PrivateUse1),
          __FILE__, __LINE__);
      registered_names.clear();
    }
    PyObject *key = nullptr, *value = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kernels, &pos, &key, &value)) {
      const char* name = PyUnicode_AsUTF8(key);
      if (!name || !PyTuple_Check(value) || PyTuple_GET_SIZE(value) != 5 ||
          !PyCallable_Check(PyTuple_GET_ITEM(value, 0))) {
        if (!PyErr_Occurred())
          PyErr_SetString(PyExc_TypeError, "expected name -> (kernel, functional, cpu_tensors, "
                          "composite, device_checked)");
        return 0;
      }
      bool done = false;
      for (const auto& n : registered_names) done = done || n == name;
      if (done) continue;
      const bool copy = std::strcmp(name, "copy_") == 0;  // (writes all of its first argument)
      registered->impl(name, host_op_entry(name, std::make_unique<HostOp>(
                                 PyTuple_GET_ITEM(value, 0),
                                 PyObject_IsTrue(PyTuple_GET_ITEM(value, 1)) == 1,
                                 PyObject_IsTrue(PyTuple_GET_ITEM(value, 2)) == 1,
                                 std::strcmp(name, "_to_copy") == 0,
                                 PyObject_IsTrue(PyTuple_GET_ITEM(value, 3)) == 1,
                                 PyObject_IsTrue(PyTuple_GET_ITEM(value, 4)) == 1,
                                 /*fallback=*/false, /*written=*/0, /*stageable=*/false,
                                 /*staged_core=*/staged != 0,
                                 /*overwrites_self=*/staged != 0 && copy)));
      registered_names.emplace_back(name);
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return 0;
  }
  return 1;
}

// A CPU storage over `nbytes` at `ptr` (memory the caller keeps alive) that a CPU kernel may
// grow: growing moves it to new host memory, and nothing past `nbytes` is written. The
// Python host kernels' out= arguments (torchport/ops/hostexec.py). NULL with a Python error.
extern "C" PyObject* torchport_growable_host_storage(uint64_t ptr, uint64_t nbytes) {
  try {
    return THPStorage_Wrap(c10::Storage(c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), nbytes,
        c10::DataPtr(reinterpret_cast<void*>(ptr), c10::Device(c10::kCPU)),
        c10::GetCPUAllocator(), /*resizable=*/true)));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// A Python number as the 0-dim CPU tensor the dispatcher made of it (`x + 1`, `copysign(x,
// 2.0)`): marked a wrapped number, so type promotion treats it as a scalar, as it did before
// the boxed call to Python turned it back into a number. NULL with a Python error.
extern "C" PyObject* torchport_wrapped_number(PyObject* value) {
  try {
    c10::Scalar s;
    if (PyBool_Check(value)) {
      s = c10::Scalar(value == Py_True);
    } else if (PyLong_Check(value)) {
      long long v = PyLong_AsLongLong(value);
      if (v == -1 && PyErr_Occurred()) return nullptr;
      s = c10::Scalar(static_cast<int64_t>(v));
    } else if (PyFloat_Check(value)) {
      s = c10::Scalar(PyFloat_AS_DOUBLE(value));
    } else if (PyComplex_Check(value)) {
      s = c10::Scalar(c10::complex<double>(PyComplex_RealAsDouble(value),
                                           PyComplex_ImagAsDouble(value)));
    } else {
      PyErr_SetString(PyExc_TypeError, "expected a Python bool, int, float or complex");
      return nullptr;
    }
    at::Tensor t = c10::scalar_to_tensor(s);
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    return THPVariable_Wrap(std::move(t));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// Removes them all (the dispatcher then finds the Python kernels once registered).
extern "C" void torchport_native_hostops_disable() {
  std::lock_guard<std::mutex> lock(registering);
  registered.reset();
  registered_names.clear();
}

// From now on the device's boxed fallback (dispatch key PrivateUse1) is this file's, which
// serves the learnt overloads while switched on and calls the Python `fallback(keyset, op,
// *args, **kwargs)` for the rest (the caller has removed that one's registration): 1; 0 with
// a Python error. Called through ctypes.PyDLL (with the GIL).
extern "C" int torchport_fallback_install(PyObject* fallback) {
  if (!PyCallable_Check(fallback)) {
    PyErr_SetString(PyExc_TypeError, "expected the Python fallback");
    return 0;
  }
  std::lock_guard<std::mutex> lock(registering);
  try {
    fallback_routes.reset();
    fallback_registered.reset();
    Py_INCREF(fallback);
    Py_XDECREF(fallback_python);
    fallback_python = fallback;
    fallback_registered = std::make_unique<torch::Library>(
        torch::Library::IMPL, "_", std::make_optional(c10::DispatchKey::PrivateUse1), __FILE__,
        __LINE__);
    fallback_registered->fallback(
        torch::CppFunction::makeFromBoxedFunctor(std::make_unique<LearntFallback>()));
  } catch (const std::exception& e) {
    fallback_registered.reset();
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return 0;
  }
  return 1;
}

// Routes overload `name` (`"native_layer_norm"`, `"addr.out"`) of aten to that fallback:
// registered as its PrivateUse1 kernel, until the fallback is removed. 1; 0 with a Python
// error (no fallback installed, or PyTorch refused). Called through ctypes.PyDLL (with the
// GIL).
extern "C" int torchport_fallback_route(const char* name) {
  std::lock_guard<std::mutex> lock(registering);
  if (!fallback_registered) {
    PyErr_SetString(PyExc_RuntimeError, "no C++ fallback is installed to route ops to");
    return 0;
  }
  try {
    if (!fallback_routes)
      fallback_routes = std::make_unique<torch::Library>(
          torch::Library::IMPL, "aten", std::make_optional(c10::DispatchKey::PrivateUse1),
          __FILE__, __LINE__);
    fallback_routes->impl(
        name, torch::CppFunction::makeFromBoxedFunctor(std::make_unique<LearntFallback>()));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return 0;
  }
  return 1;
}

// Removes that fallback and its routes (the caller registers the Python ones again).
extern "C" void torchport_fallback_uninstall() {
  std::lock_guard<std::mutex> lock(registering);
  fallback_serving.store(false);
  fallback_routes.reset();
  fallback_registered.reset();
}

// The Python fallback has learnt that overload `name`.`overload` takes the CPU fallback and
// that its schema is one the host-op kernels serve (`functional`: it writes no argument,
// `device_checked`: CUDA's registration compares its tensors' devices; `written`: the
// arguments it writes, bit i for argument i, those its schema does not mark too;
// `stageable`: its calls may run through the runtime's copies on device-only memory,
// native_staged.cpp): 1; 0 where no such op is registered. Called through ctypes.PyDLL
// (with the GIL).
extern "C" int torchport_fallback_learn(const char* name, const char* overload, int functional,
                                        int device_checked, uint64_t written, int stageable) {
  auto op = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!op) return 0;
  auto kernel = std::make_shared<HostOp>(Py_None, functional != 0, false, false, false,
                                         device_checked != 0, /*fallback=*/true, written,
                                         stageable != 0);
  std::lock_guard<std::mutex> lock(learning);
  learnt.insert_or_assign(&op->schema(), Learnt{op->operator_name(), std::move(kernel)});
  return 1;
}

// The learnt overloads on device-only memory, served through the runtime's copies
// (native_staged.cpp: `d2h`, `h2d`, `result`, `refuse`, `phys`, one runtime index per
// visible device, `native` the runtime's C copies or None, `asynchronous`: its queues run
// behind the host), or no longer (`d2h` None): 1; 0 with a Python error. Called through
// ctypes.PyDLL (with the GIL).
extern "C" int torchport_fallback_staged(PyObject* d2h, PyObject* h2d, PyObject* result,
                                         PyObject* refuse, PyObject* phys, PyObject* native,
                                         int asynchronous) {
  std::lock_guard<std::mutex> lock(registering);
  if (d2h != Py_None && PyList_Check(phys)) visible = static_cast<int>(PyList_GET_SIZE(phys));
  return torchport::staging_configure(d2h, h2d, result, refuse, phys, native,
                                      asynchronous != 0);
}

// Serve the learnt overloads in C++ (1) or hand every call to the Python fallback (0).
extern "C" void torchport_fallback_serve(int on) {
  fallback_serving.store(on != 0, std::memory_order_release);
}

// Forgets the learnt overloads (the Python fallback decides their paths again).
extern "C" void torchport_fallback_forget() {
  std::lock_guard<std::mutex> lock(learning);
  learnt.clear();
}

// Overloads learnt, and calls the C++ fallback handed to the Python one, since the process
// started (the learnt kernels count their calls with the others below).
extern "C" void torchport_fallback_counts(int64_t* out) {
  {
    std::lock_guard<std::mutex> lock(learning);
    out[0] = static_cast<int64_t>(learnt.size());
  }
  out[1] = fallback_calls.load();
}

// Calls served in C++, calls handed to the Python kernels, and new results copied or
// converted after the CPU kernel made them in host memory, since the process started.
extern "C" void torchport_native_hostops_counts(int64_t* out) {
  out[0] = served.load();
  out[1] = handed.load();
  out[2] = moved.load();
}
#endif
