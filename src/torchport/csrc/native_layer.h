// What the parts of torchport's one C++ library call of each other (they are compiled
// together by torchport/core/native.py): tensors over the caching allocator's blocks
// (native_block_storage.cpp), the device guard (native_guard.cpp), the device generators
// (native_generator.cpp) and the rest. The allocator's own files share native_allocator.h.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <cstddef>
#include <cstdint>

namespace torchport {
// native_block_storage.cpp
bool caching_serves();
int64_t caching_current_stream(c10::DeviceIndex device);
at::Tensor caching_new_tensor(int device, uint64_t nbytes, c10::ScalarType scalar,
                              c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t stream);
void resize_device_storage(const c10::Storage& storage, size_t newsize);
// The CPU allocator wrapped once so that a thread running a host-op kernel for a device
// allocates that device's blocks (false where another CPU allocator outranks the wrapper).
bool host_results_install();
// While alive, this thread's CPU allocations are blocks of `device` (-1: the host's).
class HostResultsIn {
 public:
  explicit HostResultsIn(int device);
  ~HostResultsIn();
  HostResultsIn(const HostResultsIn&) = delete;
  HostResultsIn& operator=(const HostResultsIn&) = delete;

 private:
  int saved_;
};
// A CPU kernel's new result made under HostResultsIn(device), as a device tensor over the
// same block (no copy); undefined where its memory is not such a block held by it alone.
at::Tensor host_result_on_device(const at::Tensor& cpu, int device);
// The CPU storage over device storage `dev` that a host-op kernel's CPU kernel grew under
// HostResultsIn(device) (an out= it resized): `dev` takes its new block in place (every
// tensor on `dev` sees it), the old block returns; `cpu` still points at the memory.
void host_storage_grown(c10::StorageImpl* cpu, const c10::Storage& dev, int device);
// native_guard.cpp
c10::DeviceIndex guard_device_count();
c10::DeviceIndex guard_current_device();
void guard_set_device(c10::DeviceIndex index);
int guard_call(int op, long long a, long long b, long long c, long long* iout);
// native_interrupts.cpp: alive around every call into a Python callback. While the main
// thread is inside one, SIGINT is held and raised again once the callback has returned, where
// Python's next bytecode is its C++ caller's caller's (a SIGINT raised inside the callback
// could fire before any try of the callback's, where nothing can catch it); so is a Ctrl-C
// the callback caught itself (torchport/core/interrupts.py).
class CallbackInterrupts {
 public:
  CallbackInterrupts();
  ~CallbackInterrupts();
  CallbackInterrupts(const CallbackInterrupts&) = delete;
  CallbackInterrupts& operator=(const CallbackInterrupts&) = delete;

 private:
  bool main_;
};
// native_generator.cpp
const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);
}  // namespace torchport

#if __has_include(<Python.h>)
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <Python.h>

#include <bitset>

namespace torchport {
// native_hostops.cpp: the pending Python error thrown to the dispatcher's caller (as
// PyTorch's bindings rethrow it: the same exception reaches Python).
[[noreturn]] void raise_python();
// native_hostops.cpp: `fn(*prefix, *args, **kwargs)` (`prefix` a tuple, or null) for the op's
// arguments on `stack` as a Python kernel receives them (dtype, layout and memory-format
// objects; kwarg-only ones by name); its results replace them. Takes the GIL.
void python_kernel_call(PyObject* fn, PyObject* prefix, const c10::OperatorHandle& op,
                        torch::jit::Stack* stack);
// native_factories.cpp: the dtypes of `list` (a Python list of torch.dtype) set in `out`;
// false with a Python TypeError for anything else.
bool read_dtype_set(PyObject* list, std::bitset<256>& out);
}  // namespace torchport
#endif
