// What the parts of torchport's one C++ library call of each other (they are compiled
// together by torchport/core/native.py): tensors over the caching allocator's blocks
// (native_block_storage.cpp), the device guard (native_guard.cpp), the device generators
// (native_generator.cpp) and the rest. The allocator's own files share native_allocator.h.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
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
// native_queues.cpp: the C++ queue of logical device `index`'s default stream, where the
// runtime's stream queues are C++'s (null: none), for the allocator's stream-aware frees:
// the ticket of the last job queued stands for an event recorded there (the jobs run in
// order), with nothing queued for it.
namespace queues {
class Queue;
Queue* default_queue(int index);
int64_t last_ticket(Queue* q);
bool done(Queue* q, int64_t ticket);  // ticket 0: everything queued so far
}  // namespace queues
// native_generator.cpp
const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);
at::Generator drawing_generator(const c10::IValue& given, c10::DeviceIndex index);
// While alive, the CPU's default generator draws the numbers of CPU generator `gen`.
class DefaultDrawsFrom {
 public:
  explicit DefaultDrawsFrom(at::Generator gen);
  ~DefaultDrawsFrom();
  DefaultDrawsFrom(const DefaultDrawsFrom&) = delete;
  DefaultDrawsFrom& operator=(const DefaultDrawsFrom&) = delete;

 private:
  void swap();
  at::Generator gen_;
};
}  // namespace torchport

#if __has_include(<Python.h>)
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <Python.h>

#include <c10/util/FunctionRef.h>
#include <c10/util/SmallVector.h>

#include <bitset>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torchport {
// native_hostops.cpp: the pending Python error thrown to the dispatcher's caller (as
// PyTorch's bindings rethrow it: the same exception reaches Python).
[[noreturn]] void raise_python();
// native_hostops.cpp: `t`'s CPU tensor, over a CPU storage of exactly its storage's bytes
// (`grow`: one the CPU kernel may grow, through the CPU allocator, where the device storage
// may grow); `tensors` and `storages` pair the device's with the CPU's already made, so
// that tensors and storages the call shares stay shared.
at::Tensor cpu_alias(const at::Tensor& t,
                     c10::SmallVectorImpl<std::pair<at::Tensor, at::Tensor>>& tensors,
                     c10::SmallVectorImpl<std::pair<c10::StorageImpl*, c10::Storage>>& storages,
                     bool grow = false);
// native_hostops.cpp: cpu_alias's tensors made later, by the thread that runs a queued call:
// `add` reads now what cpu_alias reads (a later in-place change of the tensor's sizes,
// strides or storage is not the queued call's), `make` puts each CPU tensor in its slot of
// the call's stack (`element` >= 0: in its place in the list there). A queue's worker then allocates and frees them itself (the host thread
// allocating memory another thread frees costs both malloc's arena lock), and not on the
// host's time.
class AliasesLater {
 public:
  void add(uint32_t slot, const at::Tensor& t, int32_t element = -1);
  void make(torch::jit::Stack& stack) const;
  bool empty() const { return tensors_.empty(); }
  void clear() {
    tensors_.clear();
    sizes_strides_.clear();
  }

 private:
  // (plain data, so that moving a job into its queue copies bytes rather than element by
  // element)
  struct Read {
    uint32_t slot;
    int32_t element;
    const void* tensor;   // the device tensor's and its storage's identities: what the call
    const void* storage;  // shares stays shared
    void* data;
    size_t nbytes;
    int64_t offset;
    caffe2::TypeMeta dtype;
    uint32_t at, dim;  // its sizes, then its strides, in sizes_strides_ from `at`
  };
  c10::SmallVector<Read, 3> tensors_;
  c10::SmallVector<int64_t, 24> sizes_strides_;
};
// native_hostops.cpp: a CPU result as a device tensor by the Python `result(cpu, index)`
// function of the host-op kernels (a large one adopted, another dtype converted). Takes the
// GIL.
at::Tensor result_on_device(PyObject* result, const at::Tensor& cpu, int index);
// native_hostops.cpp: a written argument's CPU tensor with a lazy conjugate or negative bit
// the CPU kernel set: its memory made to hold the values the bit means.
void store_lazy_bits(const at::Tensor& cpu);
// native_staged.cpp: the learnt fallback's calls on device-only memory, through the
// runtime's copies (configured by torchport_fallback_staged).
bool staging_on();
// Are the runtime's copies C entry points (no Python, no GIL, where they take the copy)?
bool staging_native();
// Does the runtime give its copy within a device in C (NativeCopies.copy_d2d)?
bool staging_within();
// `nbytes` from device address `src` to `dst` of device `index` by that C copy, in the
// default stream's order: true once done; false where it declined (nothing copied).
bool staged_copy_within(int index, uint64_t dst, uint64_t src, uint64_t nbytes);
// Serve through `d2h` and `h2d` (the runtime's copy methods; `result`: a result not copied,
// as a device tensor; `refuse`: the dtypes the device refuses; `phys`: the runtime's index
// of each device; `native`: None, or the addresses of its C copies, their context and the
// copy within a device (0: none), Runtime.native_copies; `asynchronous`: its queues run
// behind the host), or no longer (`d2h` None): 1; 0 with a Python error. Holds the GIL.
int staging_configure(PyObject* d2h, PyObject* h2d, PyObject* result, PyObject* refuse,
                      PyObject* phys, PyObject* native, bool asynchronous);
struct Copies;
// One call's host copies of the bytes its device tensors span: `add` each device tensor the
// call passes, `fetch` (copies them to the host), then `cpu` maps each to a CPU tensor over
// its copy (tensors and storages the call shares stay shared), `store` copies a written one
// back, and `on_device` makes a result the device's (an argument, a view of an argument's
// memory, or a new block filled by a copy).
class Staged {
 public:
  explicit Staged(int index);
  void add(const at::Tensor& t, bool overwritten = false);  // (an out= the kernel writes)
  void fetch();
  at::Tensor cpu(const at::Tensor& t);
  void store(const at::Tensor& dev);
  at::Tensor on_device(const at::Tensor& cpu);
  // The bytes of its storage a tensor's elements span (what `fetch` copies of it alone).
  static uint64_t bytes(const at::Tensor& t);

 private:
  struct Span {
    c10::StorageImpl* dev;
    uint64_t lo, hi, base;  // the bytes the call's tensors span; the copy starts at `base`
    c10::Storage cpu;       // (a CPU kernel may grow it: an out= it resizes)
    bool read;              // fetched (not only dense out= tensors the kernel overwrites)
  };
  struct Mapped {
    at::Tensor dev, cpu;
    size_t span;
  };
  int index_;
  const Copies* copies_;
  c10::SmallVector<Span, 6> spans_;
  c10::SmallVector<Mapped, 6> tensors_;
};
// native_hostops.cpp: `fn(*prefix, *args, **kwargs)` (`prefix` a tuple, or null) for the op's
// arguments on `stack` as a Python kernel receives them (dtype, layout and memory-format
// objects; kwarg-only ones by name); its results replace them. Takes the GIL.
void python_kernel_call(PyObject* fn, PyObject* prefix, const c10::OperatorHandle& op,
                        torch::jit::Stack* stack);
// native_hostops.cpp: an argument as a Python kernel receives it (a new reference; null with
// a Python error). Takes no GIL: the caller holds it.
PyObject* python_argument(const c10::Argument& arg, const c10::IValue& v);
// native_queued_ops.cpp: the ints of a Python sequence; false with a Python error.
bool read_ints(PyObject* seq, std::vector<int64_t>& out);
// native_factories.cpp: the dtypes of `list` (a Python list of torch.dtype) set in `out`;
// false with a Python TypeError for anything else.
bool read_dtype_set(PyObject* list, std::bitset<256>& out);

// native_queues.cpp: the sim's stream queues in asynchronous mode.
namespace queues {
void set_default_queue(int index, Queue* q);
// `op`'s CPU kernel on `stack` queued on `q` (run in the caller where `q` runs inline),
// waiting for room where the queue is full; its ticket. `name`: what a failure is reported
// under (null: the op's).
// (`aliases`: the CPU tensors the worker makes into `stack` before the call.)
int64_t submit_op(Queue* q, const c10::OperatorHandle& op, torch::jit::Stack&& stack,
                  const char* name = nullptr, AliasesLater&& aliases = AliasesLater());
// The same, on the stack and aliases `fill` writes where the job waits (empty, with the
// buffers of an earlier job: neither allocated nor moved per call).
int64_t submit_op_filled(Queue* q, const c10::OperatorHandle& op,
                         c10::function_ref<void(torch::jit::Stack&, AliasesLater&)> fill);
// Queue `op`'s functional CPU kernel on `stack`, its list of results then copied into `outs`
// (CPU tensors over device memory, laid out as the results must be: a result of another
// shape or dtype fails the queue).
int64_t submit_copied(Queue* q, const c10::OperatorHandle& op, torch::jit::Stack&& stack,
                      std::vector<at::Tensor>&& outs);
// May the host read or write what the work queued on `q` so far uses? Its turn comes once
// that work has run (`wait`: waits for it, without the GIL, Ctrl-C raising; else only where
// it has) and no failure is kept for a synchronising call to report.
bool host_turn(Queue* q, bool wait);
}  // namespace queues

// native_queued_ops.cpp: host-op kernels on an asynchronous runtime whose queues are C++'s.
// What a host-op kernel learned from its Python kernel for a layout of its arguments: the
// Python kernel queued the call (in place, the out= overload `out` into new tensors laid out
// as `specs` say, or, `copied`, the functional kernel, its list of results copied into new
// tensors laid out as `specs` say).
struct QueuedSpec {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
  uint64_t nbytes;
};
struct QueuedLaunch {
  std::optional<c10::OperatorHandle> out;  // none: in place, or copied
  bool copied = false;
  std::vector<QueuedSpec> specs;
};
// One op's learned launches, by the layouts of its arguments.
struct QueuedCalls {
  std::mutex m;
  std::unordered_map<std::string, std::shared_ptr<const QueuedLaunch>> by_layout;
};
// The layout key of the op's arguments on `stack` (from `first`): each tensor's dtype, sizes
// and strides, each number but a float's value (its type), a float list's length, strings;
// what a meta kernel decides a call's results and errors from. False: a call no key stands
// for (a tensor of another device type or of a second device, a complex number, a list of
// optional tensors, a device, a generator, no device tensor). `index`: the device; `tensors`:
// (memory, tensor) of each tensor argument.
bool layout_key(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t first,
                std::string& key, int& index,
                c10::SmallVectorImpl<std::pair<const void*, const void*>>& tensors);
// Is the runtime asynchronous with C++ queues (the host-op kernels then queue)?
bool queued_mode();
// queues::host_turn on device `index`'s default stream, while it is the current one.
bool queued_host_turn(int index, bool wait);
// Queue the call on `stack` as `calls` learned it: true, its results on the stack. False:
// not served; `key` is then the layout key to learn under (empty: nothing to learn).
// `unboxed`: the stack holds an unboxed call's arguments, its tensors lent (no reference
// counted), and stays as it is; a call queued puts its new results there (none where it
// returns its first argument), and one whose results come as a list is not served.
bool queued_serve(const c10::OperatorHandle& op, torch::jit::Stack* stack, QueuedCalls& calls,
                  std::string& key, c10::SmallVectorImpl<at::Tensor>* unboxed = nullptr);
// While alive: the op's Python kernel may teach what it queued (torchport_queued_teach).
class QueuedTeaching {
 public:
  explicit QueuedTeaching(const c10::OperatorHandle& op);
  ~QueuedTeaching();
  // What was taught, learned under `key`.
  void keep(QueuedCalls& calls, std::string key);
  QueuedTeaching(const QueuedTeaching&) = delete;
  QueuedTeaching& operator=(const QueuedTeaching&) = delete;

  const c10::OperatorHandle& op;
  std::shared_ptr<QueuedLaunch> taught;

 private:
  QueuedTeaching* saved_;
};
}  // namespace torchport
#endif
