// Host-op kernels on an asynchronous runtime whose stream queues are C++'s (the sim with
// TORCHPORT_SIM_ASYNC=1, native_queues.cpp): a call is queued from C++, its results
// allocated now, the CPU kernel run later by the stream's worker without the GIL, on CPU
// tensors over device memory that the worker makes from what the host read at the call.
//
// What may be queued is the Python kernels' decision (torchport/ops/hostkernels: launching.py,
// inplace.py): per layout of an op's arguments they prove once, on stand-ins, that its out=
// overload (or the in-place op) may run later with the functional kernel's bits and no error
// the layouts decide. The first call with a layout goes to the Python kernel, which, where it
// queued the call, teaches it here (torchport_queued_teach, while a QueuedTeaching is alive);
// later calls with that layout are queued here. The key holds what the Python kernels' keys
// hold (each tensor's dtype, sizes and strides; each number but a float's value; a float
// list's length), so one of ours stands for one of theirs.
//
// Served: calls whose tensors are plain strided tensors of one device (in tensor lists and
// index's `Tensor?[]` too; and the dispatcher's wrapped numbers, which the CPU kernel is
// given as they are), while its default
// stream is current (a side stream takes the Python kernel). An in-place call two of whose
// tensors share memory as different views is the Python kernel's (it checks overlaps).
// Switched by torchport/ops/native_hostops.py.
#if __has_include(<Python.h>)
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <Python.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "native_layer.h"

namespace {

constexpr auto kDevice = c10::DeviceType::PrivateUse1;

std::mutex configuring;
std::atomic<bool> enabled{false};
thread_local torchport::QueuedTeaching* teaching = nullptr;

template <typename T>
void put(std::string& key, T v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

void put_tensor(std::string& key, const at::Tensor& t) {
  // (three appends, not one a field: the key is built at every call)
  const c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
  char head[6] = {'T', static_cast<char>(t.scalar_type())};
  const auto dim = static_cast<int32_t>(sizes.size());
  std::memcpy(head + 2, &dim, sizeof(dim));
  key.append(head, sizeof(head));
  key.append(reinterpret_cast<const char*>(sizes.data()), sizes.size() * sizeof(int64_t));
  key.append(reinterpret_cast<const char*>(strides.data()), strides.size() * sizeof(int64_t));
}

// Is `t` a tensor a queued call may take (setting `index` from the first)?
bool takes(const at::Tensor& t, int& index) {
  if (t.device().type() != kDevice || t.layout() != c10::Layout::Strided || t.is_conj() ||
      t.is_neg() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
    return false;
  const int d = t.device().index();
  if (index >= 0 && d != index) return false;
  index = d;
  return true;
}

// Is `argument` a `Tensor?[]` (index's indices)?
bool is_optional_tensor_list(const c10::Argument& argument) {
  const auto list = argument.type()->cast<c10::ListType>();
  if (!list) return false;
  const auto element = list->getElementType()->cast<c10::OptionalType>();
  return element && element->getElementType()->kind() == c10::TypeKind::TensorType;
}

// The queue C++ queues device `index`'s calls on: its default stream's, while that stream is
// the current one (null: none, or a side stream is current).
torchport::queues::Queue* serving_queue(int index) {
  torchport::queues::Queue* queue =
      enabled.load(std::memory_order_acquire) ? torchport::queues::default_queue(index) : nullptr;
  if (queue == nullptr ||
      torchport::caching_current_stream(static_cast<c10::DeviceIndex>(index)) != 0)
    return nullptr;
  return queue;
}

// The queued call's results in its arguments' place: the new tensors (`out`), or the written
// argument an in-place op returns.
void return_results(const c10::FunctionSchema& schema, size_t first,
                    c10::SmallVectorImpl<at::Tensor>& results, bool out, torch::jit::Stack* stack) {
  c10::IValue self = (*stack)[first];
  stack->resize(first);
  if (out) {
    for (at::Tensor& r : results) stack->emplace_back(std::move(r));
  } else if (!schema.returns().empty()) {
    stack->push_back(std::move(self));
  }
}

}  // namespace

namespace torchport {

bool layout_key(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                size_t first, std::string& key, int& index,
                c10::SmallVectorImpl<std::pair<const void*, const void*>>& tensors) {
  const auto& arguments = schema.arguments();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        put(key, 'u');
        continue;
      }
      if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
        // a Python number in a tensor's place (`x * 2`): its Python kernel was handed the
        // number, and its key holds an integer's value, a float's type
        put(key, 'w');
        put(key, static_cast<int8_t>(t.scalar_type()));
        if (c10::isComplexType(t.scalar_type())) return false;
        if (!c10::isFloatingType(t.scalar_type())) put(key, t.item<int64_t>());
        continue;
      }
      if (!takes(t, index)) return false;
      put_tensor(key, t);
      tensors.emplace_back(t.storage().data(), t.unsafeGetTensorImpl());
    } else if (v.isTensorList()) {
      put(key, 'L');
      put(key, static_cast<int64_t>(v.toTensorList().size()));
      for (const at::Tensor& t : v.toTensorList()) {
        if (!t.defined() || !takes(t, index)) return false;
        put_tensor(key, t);
        tensors.emplace_back(t.storage().data(), t.unsafeGetTensorImpl());
      }
    } else if (v.isList() && is_optional_tensor_list(arguments[i])) {
      // index's indices (x[:, i] is [None, i]): the same as a tensor list's, None kept
      const c10::List<c10::IValue> l = v.toList();
      put(key, 'O');
      put(key, static_cast<int64_t>(l.size()));
      for (const c10::IValue& e : l) {
        if (e.isNone() || (e.isTensor() && !e.toTensor().defined())) {
          put(key, 'n');
          continue;
        }
        if (!e.isTensor() || !takes(e.toTensor(), index)) return false;
        put_tensor(key, e.toTensor());
        tensors.emplace_back(e.toTensor().storage().data(), e.toTensor().unsafeGetTensorImpl());
      }
    } else if (v.isNone()) {
      put(key, 'n');
    } else if (arguments[i].type()->kind() == c10::TypeKind::TensorType) {
      return false;  // a number in a tensor's place
    } else if (v.isInt()) {
      put(key, 'i');
      put(key, v.toInt());
    } else if (v.isDouble()) {
      put(key, 'd');  // a float's value decides no layout and no error of these ops
    } else if (v.isBool()) {
      put(key, 'b');
      put(key, v.toBool());
    } else if (v.isIntList()) {
      put(key, 'I');
      const auto l = v.toIntList();
      put(key, static_cast<int64_t>(l.size()));
      for (int64_t x : l) put(key, x);
    } else if (v.isDoubleList()) {
      put(key, 'D');
      put(key, static_cast<int64_t>(v.toDoubleList().size()));
    } else if (v.isBoolList()) {
      put(key, 'B');
      for (bool x : v.toBoolList()) put(key, x);
    } else if (v.isList()) {
      // Scalar[] (a foreach op's per-tensor numbers): an integer's value; a float's only
      // outside foreach ops, whose results are their tensors' shapes whatever the floats
      // (an optimizer's step sizes change every step)
      const c10::List<c10::IValue> l = v.toList();
      const bool foreach = schema.name().rfind("aten::_foreach_", 0) == 0;
      put(key, 'S');
      put(key, static_cast<int64_t>(l.size()));
      for (const c10::IValue& e : l) {
        if (e.isDouble()) {
          put(key, 'd');
          if (!foreach) put(key, e.toDouble());
        } else if (e.isInt()) {
          put(key, 'i');
          put(key, e.toInt());
        } else if (e.isBool()) {
          put(key, 'b');
          put(key, e.toBool());
        } else {
          return false;  // complex numbers, tensors, None
        }
      }
    } else if (v.isString()) {
      put(key, 's');
      const auto& s = v.toStringRef();
      put(key, static_cast<int64_t>(s.size()));
      key.append(s);
    } else {
      return false;  // complex numbers, lists of optional tensors, devices, generators
    }
  }
  return index >= 0;
}

bool queued_mode() { return enabled.load(std::memory_order_relaxed); }

bool queued_host_turn(int index, bool wait) {
  queues::Queue* queue = serving_queue(index);
  return queue != nullptr && queues::host_turn(queue, wait);
}

bool queued_serve(const c10::OperatorHandle& op, torch::jit::Stack* stack, QueuedCalls& calls,
                  std::string& key, c10::SmallVectorImpl<at::Tensor>* unboxed) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t first = stack->size() - nargs;
  int index = -1;
  c10::SmallVector<std::pair<const void*, const void*>, 6> tensors;  // (memory, tensor)
  key.clear();
  if (!layout_key(schema, *stack, first, key, index, tensors)) {
    key.clear();
    return false;
  }
  queues::Queue* queue = serving_queue(index);
  if (queue == nullptr || !caching_serves()) {
    key.clear();
    return false;
  }
  std::shared_ptr<const QueuedLaunch> launch;
  {
    std::lock_guard<std::mutex> l(calls.m);
    auto it = calls.by_layout.find(key);
    if (it != calls.by_layout.end()) launch = it->second;
  }
  if (!launch) return false;  // the Python kernel decides, and may teach
  if (unboxed && launch->copied) {
    key.clear();
    return false;
  }
  if (!launch->out && !launch->copied) {
    // in place: a written tensor sharing memory with another argument is the Python
    // kernel's to check (a partial overlap the CPU refuses)
    std::sort(tensors.begin(), tensors.end());
    for (size_t i = 1; i < tensors.size(); ++i)
      if (tensors[i].first == tensors[i - 1].first && tensors[i].second != tensors[i - 1].second) {
        key.clear();
        return false;
      }
  }

  // The results now, then the CPU kernel's arguments: CPU tensors over device memory.
  c10::SmallVector<at::Tensor, 2> results;
  for (const QueuedSpec& s : launch->specs)
    results.push_back(caching_new_tensor(index, s.nbytes, s.dtype, s.sizes, s.strides, 0));
  if (!launch->copied) {
    // the worker makes the CPU tensors when it runs the call (in lists: their places)
    const auto fill = [&](torch::jit::Stack& job, AliasesLater& aliases) {
      job.resize(nargs);
      for (size_t i = 0; i < nargs; ++i) {
        const c10::IValue& v = (*stack)[first + i];
        const auto slot = static_cast<uint32_t>(i);
        if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kDevice) {
          aliases.add(slot, v.toTensor());
        } else if (v.isTensorList()) {
          const c10::List<at::Tensor> list = v.toTensorList();
          c10::List<at::Tensor> later;
          later.reserve(list.size());
          for (size_t k = 0; k < list.size(); ++k) {
            later.push_back(at::Tensor());
            aliases.add(slot, list.get(k), static_cast<int32_t>(k));
          }
          job[i] = std::move(later);
        } else if (v.isList() && is_optional_tensor_list(schema.arguments()[i])) {
          const c10::List<c10::IValue> list = v.toList();
          c10::List<std::optional<at::Tensor>> later;
          later.reserve(list.size());
          for (size_t k = 0; k < list.size(); ++k) {
            later.push_back(std::nullopt);
            const c10::IValue& e = list.get(k);
            if (e.isTensor() && e.toTensor().defined())
              aliases.add(slot, e.toTensor(), static_cast<int32_t>(k));
          }
          job[i] = std::move(later);
        } else {
          job[i] = v;
        }
      }
      for (const at::Tensor& r : results) {
        aliases.add(static_cast<uint32_t>(job.size()), r);
        job.emplace_back();
      }
    };
    queues::submit_op_filled(queue, launch->out ? *launch->out : op, fill);
    if (unboxed) {
      if (launch->out)  // (return_results' rule: in place, the call returns its first argument)
        for (at::Tensor& r : results) unboxed->push_back(std::move(r));
    } else {
      return_results(schema, first, results, launch->out.has_value(), stack);
    }
    return true;
  }
  c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 6> aliases;
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 6> storages;
  torch::jit::Stack job;
  job.reserve(nargs + results.size());
  for (size_t i = 0; i < nargs; ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kDevice) {
      job.emplace_back(cpu_alias(v.toTensor(), aliases, storages));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> mapped;
      mapped.reserve(v.toTensorList().size());
      for (const at::Tensor& t : v.toTensorList()) mapped.push_back(cpu_alias(t, aliases, storages));
      job.emplace_back(std::move(mapped));
    } else if (v.isList() && is_optional_tensor_list(schema.arguments()[i])) {
      c10::List<std::optional<at::Tensor>> mapped;
      for (const c10::IValue& e : v.toList()) {
        if (e.isTensor() && e.toTensor().defined())
          mapped.push_back(cpu_alias(e.toTensor(), aliases, storages));
        else
          mapped.push_back(std::nullopt);
      }
      job.emplace_back(std::move(mapped));
    } else {
      job.push_back(v);
    }
  }
  // copied: the CPU tensors now (the results' go to the job's `outs`)
  std::vector<at::Tensor> outs;
  outs.reserve(results.size());
  for (const at::Tensor& r : results) outs.push_back(cpu_alias(r, aliases, storages));
  queues::submit_copied(queue, op, std::move(job), std::move(outs));
  stack->resize(first);
  stack->emplace_back(c10::List<at::Tensor>(c10::ArrayRef<at::Tensor>(results)));
  return true;
}

QueuedTeaching::QueuedTeaching(const c10::OperatorHandle& op) : op(op), saved_(teaching) {
  teaching = this;
}

QueuedTeaching::~QueuedTeaching() { teaching = saved_; }

void QueuedTeaching::keep(QueuedCalls& calls, std::string key) {
  if (!taught) return;
  std::lock_guard<std::mutex> l(calls.m);
  if (calls.by_layout.size() >= 4096) calls.by_layout.clear();  // layouts of a dynamic program
  calls.by_layout[std::move(key)] = std::move(taught);
}

bool read_ints(PyObject* seq, std::vector<int64_t>& out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (!fast) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (out[i] == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
  }
  Py_DECREF(fast);
  return true;
}

}  // namespace torchport

namespace {
// The asking kernel's QueuedTeaching, where it asks for the op `name`, `overload`.
torchport::QueuedTeaching* asking_for(const char* name, const char* overload) {
  torchport::QueuedTeaching* t = teaching;
  if (t == nullptr) return nullptr;
  const c10::OperatorName& asking = t->op.operator_name();
  return asking.name == name && asking.overload_name == overload ? t : nullptr;
}

// `specs` (a list of (sizes, strides, dtype, nbytes)) into `out`; false with a Python error.
bool read_specs(PyObject* specs, std::vector<torchport::QueuedSpec>& out) {
  PyObject* fast = PySequence_Fast(specs, "expected a list of output specs");
  if (!fast) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    PyObject *sizes, *strides, *dtype;
    unsigned long long nbytes;
    torchport::QueuedSpec s;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "OOOK", &sizes, &strides,
                          &dtype, &nbytes) ||
        !THPDtype_Check(dtype) || !torchport::read_ints(sizes, s.sizes) ||
        !torchport::read_ints(strides, s.strides)) {
      Py_DECREF(fast);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "expected a torch.dtype");
      return false;
    }
    s.dtype = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
    s.nbytes = nbytes;
    out.push_back(std::move(s));
  }
  Py_DECREF(fast);
  return true;
}
}  // namespace

extern "C" {
// Queue host-op calls from C++ on the default streams' queues `queues` (a list of queue
// handles by device index; empty: no longer). Called through ctypes.PyDLL (with the GIL).
int torchport_queued_enable(PyObject* queues) {
  std::vector<torchport::queues::Queue*> found;
  if (!PyList_Check(queues)) {
    PyErr_SetString(PyExc_TypeError, "expected a list of queue handles");
    return 0;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(queues); ++i) {
    void* q = PyLong_AsVoidPtr(PyList_GET_ITEM(queues, i));
    if (PyErr_Occurred()) return 0;
    found.push_back(static_cast<torchport::queues::Queue*>(q));
  }
  std::lock_guard<std::mutex> l(configuring);
  for (size_t i = 0; i < found.size(); ++i)  // the allocator's, for good
    torchport::queues::set_default_queue(static_cast<int>(i), found[i]);
  enabled.store(!found.empty());
  return 1;
}

// `dst.copy_(src)` within one device queued on its default stream, where C++ queues host
// ops and the default stream is current (the Python copy kernel checked the call: shapes,
// overlaps, conj/neg bits): 1; 0: not queued here; -1 with a Python error. Through
// ctypes.PyDLL. The worker copies between CPU tensors over the two tensors' memory, without
// the GIL.
int torchport_queued_copy(PyObject* dst, PyObject* src) {
  if (!THPVariable_Check(dst) || !THPVariable_Check(src)) {
    PyErr_SetString(PyExc_TypeError, "expected two tensors");
    return -1;
  }
  const at::Tensor& d = THPVariable_Unpack(dst);
  const at::Tensor& s = THPVariable_Unpack(src);
  int index = -1;
  if (!enabled.load() || !takes(d, index) || !takes(s, index)) return 0;
  torchport::queues::Queue* queue = serving_queue(index);
  if (queue == nullptr) return 0;
  try {
    static const c10::OperatorHandle copy =
        c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
    c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 2> aliases;
    c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 2> storages;
    torch::jit::Stack job;
    job.emplace_back(torchport::cpu_alias(d, aliases, storages));
    job.emplace_back(torchport::cpu_alias(s, aliases, storages));
    job.emplace_back(false);
    torchport::queues::submit_op(queue, copy, std::move(job));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return -1;
  }
  return 1;
}

// The Python kernel of the op being called from C++ (`name`, `overload`) queued this call: in
// place (`out` None), or `out` (the out= overload's (name, overload)) into new tensors laid
// out as `specs` says (a list of (sizes, strides, dtype, nbytes)). 1: learned; 0: no C++
// kernel is asking (or it asks for another op). Through ctypes.PyDLL.
int torchport_queued_teach(const char* name, const char* overload, PyObject* out,
                           PyObject* specs) {
  torchport::QueuedTeaching* t = asking_for(name, overload);
  if (t == nullptr) return 0;
  auto launch = std::make_shared<torchport::QueuedLaunch>();
  try {
    if (out != Py_None) {
      const char* out_name = nullptr;
      const char* out_overload = nullptr;
      if (!PyArg_ParseTuple(out, "ss", &out_name, &out_overload)) return -1;
      launch->out = c10::Dispatcher::singleton().findSchemaOrThrow(out_name, out_overload);
      if (!read_specs(specs, launch->specs)) return -1;
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return -1;
  }
  t->taught = std::move(launch);
  return 1;
}

// The Python kernel of the op being called from C++ (`name`, `overload`), whose result is a
// list of tensors, queued its functional kernel, the results copied into new tensors laid out
// as `specs` says (a list of (sizes, strides, dtype, nbytes)). 1: learned; 0: no C++ kernel
// is asking (or it asks for another op). Through ctypes.PyDLL.
int torchport_queued_teach_copied(const char* name, const char* overload, PyObject* specs) {
  torchport::QueuedTeaching* t = asking_for(name, overload);
  if (t == nullptr) return 0;
  auto launch = std::make_shared<torchport::QueuedLaunch>();
  launch->copied = true;
  if (!read_specs(specs, launch->specs)) return -1;
  t->taught = std::move(launch);
  return 1;
}
}
#endif
