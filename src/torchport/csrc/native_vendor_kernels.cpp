// A vendor's out= kernels (KernelSet.out_kernel, c_out_kernel) called from C++: the out=
// overload and the functional and in-place overloads torchport derives from it
// (torchport/ops/derive.py) are boxed kernels here, which call the vendor's kernel with ready
// outputs without a Python entry of their own. A Python kernel registered with
// torch.library costs PyTorch's boxing into Python objects, the derive wrapper's checks, the
// output specs' cache lookup and the allocator's Python calls on every call (30 us for a
// kernel that does nothing); here a call costs a layout key, one map lookup and the call of
// the vendor's function (a Python function with the GIL, a C function without it).
//
// What the Python derive path decides per call -- the meta kernel's output specs, an out= to
// resize, the CPU's memory-overlap verdict, a dtype the kernel does not declare -- a meta
// kernel decides from the layout of the arguments (torchport::layout_key), so it is asked
// once per layout: the first call with a layout asks the overload's Python planner
// (derive.planner), which answers with the new outputs' specs, or None: such calls are the
// Python kernel's (an out= it resizes, a declined dtype). Calls whose written tensor is not
// contiguous or shares memory with another argument (the overlap checks the CPU decides
// from memory) and calls the key does not stand for (another device type, a generator)
// take the Python kernel too, as do all calls while ops are intercepted (op statistics,
// forced fallback: python_only). A kernel that declines (torchport.ops.Decline;
// TORCHPORT_DECLINE from C) sends the call to the op's next path, as in Python.
// A C kernel gets the arguments as torchport_kernel.h describes (DLPack tensors); the
// Python twin (torchport/ops/c_kernels.py) packs the same for calls Python serves.
// Switched by torchport/ops/native_vendor.py.
#if __has_include(<Python.h>)
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "native_layer.h"
#include "torchport_kernel.h"

namespace {

enum Kind : int { kOut = 0, kFunctional = 1, kInplace = 2 };

struct Spec {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
  uint64_t nbytes;
};
// The planner's answer for a layout: C++ serves (new outputs laid out as `specs` say, for a
// functional overload), or the Python kernel does.
struct Plan {
  bool serve = false;
  std::vector<Spec> specs;
};

std::atomic<bool> python_only{false};
PyObject* decline_type = nullptr;   // torchport.ops.Decline
PyObject* stream_handle = nullptr;  // index -> the runtime's handle of its current stream
std::atomic<int64_t> served{0};
std::atomic<int64_t> handed{0};
std::atomic<int64_t> declined{0};
std::mutex registering;
// The registrations of one kernel set: withdrawn together (torchport_vendor_kernels_remove),
// with the references to the Python objects its kernels call.
struct Group {
  std::unique_ptr<torch::Library> library;
  std::vector<std::string> names;
  std::vector<PyObject*> references;
};
std::unordered_map<int64_t, Group> groups;

c10::OperatorHandle find_op(const std::string& name) {
  const size_t dot = name.find('.');
  return c10::Dispatcher::singleton().findSchemaOrThrow(
      ("aten::" + name.substr(0, dot)).c_str(),
      dot == std::string::npos ? "" : name.substr(dot + 1).c_str());
}

// Keyword names of `schema`'s kwarg-only arguments (null: positional), interned.
std::vector<PyObject*> keyword_names(const c10::FunctionSchema& schema) {
  std::vector<PyObject*> names;
  for (const c10::Argument& a : schema.arguments())
    names.push_back(a.kwarg_only() ? PyUnicode_InternFromString(a.name().c_str()) : nullptr);
  return names;
}

// `fn(*args, **kwargs)` for `schema`'s arguments in `values`, as a Python kernel receives
// them (a Python number where the dispatcher wrapped one). The GIL held; null: its error.
PyObject* call_object(PyObject* fn, const c10::FunctionSchema& schema,
                      const std::vector<PyObject*>& names, const c10::IValue* values) {
  const auto& arguments = schema.arguments();
  Py_ssize_t npos = 0;
  for (PyObject* n : names) npos += n == nullptr;
  PyObject* args = PyTuple_New(npos);
  PyObject* kwargs = static_cast<size_t>(npos) < names.size() ? PyDict_New() : nullptr;
  PyObject* result = nullptr;
  Py_ssize_t p = 0;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& v = values[i];
    PyObject* o = v.isTensor() && !v.toTensor().unsafeGetTensorImpl()->is_wrapped_number()
                      ? THPVariable_Wrap(v.toTensor())
                      : torchport::python_argument(arguments[i], v);
    if (o == nullptr) goto done;
    if (names[i] == nullptr) {
      PyTuple_SET_ITEM(args, p++, o);
    } else {
      const int rc = PyDict_SetItem(kwargs, names[i], o);
      Py_DECREF(o);
      if (rc < 0) goto done;
    }
  }
  result = PyObject_Call(fn, args, kwargs);
done:
  Py_DECREF(args);
  Py_XDECREF(kwargs);
  return result;
}

// The planner's list of (sizes, strides, dtype) as specs; false with a Python error.
bool read_specs(PyObject* list, std::vector<Spec>& specs) {
  PyObject* fast = PySequence_Fast(list, "expected a list of output specs");
  if (!fast) return false;
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fast); ++i) {
    PyObject *sizes, *strides, *dtype;
    Spec s;
    ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "OOO", &sizes, &strides, &dtype) &&
         torchport::read_ints(sizes, s.sizes) && torchport::read_ints(strides, s.strides);
    if (ok && !THPDtype_Check(dtype)) {
      PyErr_SetString(PyExc_TypeError, "expected a torch.dtype");
      ok = false;
    }
    if (!ok) break;
    s.dtype = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
    uint64_t extent = 1;
    for (size_t d = 0; d < s.sizes.size(); ++d) {
      if (s.sizes[d] == 0) extent = 0;
      if (extent) extent += static_cast<uint64_t>((s.sizes[d] - 1) * s.strides[d]);
    }
    s.nbytes = extent * c10::elementSize(s.dtype);
    specs.push_back(std::move(s));
  }
  Py_DECREF(fast);
  return ok;
}

// DLPack's type of `t` (false: none torchport gives a C kernel: quantized, float8, bits).
bool dl_dtype(c10::ScalarType t, DLDataType& out) {
  using S = c10::ScalarType;
  uint8_t code;
  switch (t) {
    case S::Bool: code = kDLBool; break;
    case S::Byte: case S::UInt16: case S::UInt32: case S::UInt64: code = kDLUInt; break;
    case S::Char: case S::Short: case S::Int: case S::Long: code = kDLInt; break;
    case S::Half: case S::Float: case S::Double: code = kDLFloat; break;
    case S::BFloat16: code = kDLBfloat; break;
    case S::ComplexHalf: case S::ComplexFloat: case S::ComplexDouble: code = kDLComplex; break;
    default: return false;
  }
  out.code = code;
  out.bits = static_cast<uint8_t>(c10::elementSize(t) * 8);
  out.lanes = 1;
  return true;
}

bool dl_tensor(const at::Tensor& t, DLTensor& out) {
  if (!dl_dtype(t.scalar_type(), out.dtype)) return false;
  out.data = t.numel() ? t.data_ptr() : nullptr;
  out.device.device_type = t.device().type() == c10::DeviceType::CPU ? kDLCPU : kDLExtDev;
  out.device.device_id = t.device().type() == c10::DeviceType::CPU ? 0 : t.device().index();
  out.ndim = static_cast<int32_t>(t.dim());
  out.shape = const_cast<int64_t*>(t.sizes().data());
  out.strides = const_cast<int64_t*>(t.strides().data());
  out.byte_offset = 0;
  return true;
}

// A number (also a wrapped one) as a C kernel's argument.
void number(const c10::Scalar& s, TorchportArg& a) {
  if (s.isBoolean()) {
    a.kind = TORCHPORT_ARG_BOOL;
    a.i = s.toBool();
  } else if (s.isIntegral(false)) {
    a.kind = TORCHPORT_ARG_INT;
    a.i = s.toLong();
  } else if (s.isComplex()) {
    a.kind = TORCHPORT_ARG_COMPLEX;
    a.f[0] = s.toComplexDouble().real();
    a.f[1] = s.toComplexDouble().imag();
  } else {
    a.kind = TORCHPORT_ARG_FLOAT;
    a.f[0] = s.toDouble();
  }
}

class VendorOp final : public c10::OperatorKernel {
 public:
  VendorOp(const std::string& name, const std::string& out_name, int kind, PyObject* python,
           PyObject* planner, PyObject* next, PyObject* fn, uintptr_t c_fn)
      : op_(find_op(name)),
        out_op_(find_op(out_name)),
        out_name_(out_name),
        kind_(kind),
        python_(python),
        planner_(planner),
        next_(next),
        fn_(fn),
        c_fn_(reinterpret_cast<TorchportKernel>(c_fn)),
        op_names_(keyword_names(op_.schema())),
        out_names_(keyword_names(out_op_.schema())) {
    // (the references are its group's: kept until the group is removed)
    const auto& arguments = op_.schema().arguments();
    for (size_t i = 0; i < arguments.size(); ++i) {
      const c10::AliasInfo* alias = arguments[i].alias_info();
      if (alias != nullptr && alias->isWrite()) written_.push_back(i);
    }
    for (const c10::Argument& a : out_op_.schema().arguments()) {
      const c10::Type* t = a.real_type().get();
      if (auto opt = t->castRaw<c10::OptionalType>()) t = opt->getElementType().get();
      argument_names_.push_back(a.name());
      dtype_arg_.push_back(t->kind() == c10::TypeKind::ScalarTypeType);
    }
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    if (python_only.load(std::memory_order_relaxed)) return handed_to(python_, op, stack);
    const auto& schema = op.schema();
    const size_t first = stack->size() - schema.arguments().size();
    std::string key;
    int index = -1;
    c10::SmallVector<std::pair<const void*, const void*>, 6> tensors;  // (memory, tensor)
    if (!torchport::layout_key(schema, *stack, first, key, index, tensors) ||
        !writes_alone(*stack, first, tensors))
      return handed_to(python_, op, stack);
    const std::shared_ptr<const Plan> plan = planned(*stack, first, key);
    if (!plan || !plan->serve || (kind_ == kFunctional && !torchport::caching_serves()))
      return handed_to(python_, op, stack);

    // The out= overload's arguments: the call's, then the outputs.
    torch::jit::Stack call(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
    c10::SmallVector<at::Tensor, 2> outs;
    if (kind_ == kFunctional) {
      const int64_t stream = torchport::caching_current_stream(static_cast<c10::DeviceIndex>(index));
      for (const Spec& s : plan->specs) {
        outs.push_back(torchport::caching_new_tensor(index, s.nbytes, s.dtype, s.sizes, s.strides,
                                                     stream));
        call.emplace_back(outs.back());
      }
    } else if (kind_ == kInplace) {
      outs.push_back(call[0].toTensor());
      call.emplace_back(outs.back());
    } else {
      for (size_t w : written_) outs.push_back(call[w].toTensor());
    }
    if (!(c_fn_ != nullptr ? call_c(call, index) : call_python(call))) {
      declined.fetch_add(1, std::memory_order_relaxed);
      return handed_to(next_, op, stack);
    }
    stack->resize(first);
    if (kind_ != kInplace || !schema.returns().empty())
      for (at::Tensor& o : outs) stack->emplace_back(std::move(o));
    served.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  // Are the written tensors contiguous, each on memory no other argument shares (the Python
  // kernel asks the CPU's overlap checks otherwise)?
  bool writes_alone(const torch::jit::Stack& stack, size_t first,
                    const c10::SmallVectorImpl<std::pair<const void*, const void*>>& tensors) const {
    if (kind_ == kFunctional) return true;
    for (size_t w : written_) {
      const c10::IValue& v = stack[first + w];
      if (!v.isTensor() || !v.toTensor().defined() || !v.toTensor().is_contiguous()) return false;
      const void* memory = v.toTensor().storage().data();
      int n = 0;
      for (const auto& [m, impl] : tensors) n += m == memory;
      if (n != 1) return false;
    }
    return true;
  }

  // The planner's answer for `key` (asked once); null: the planner raised (the Python kernel
  // raises the error itself).
  std::shared_ptr<const Plan> planned(const torch::jit::Stack& stack, size_t first,
                                      const std::string& key) {
    {
      std::lock_guard<std::mutex> l(m_);
      auto it = plans_.find(key);
      if (it != plans_.end()) return it->second;
    }
    auto plan = std::make_shared<Plan>();
    {
      pybind11::gil_scoped_acquire gil;
      PyObject* r = call_object(planner_, op_.schema(), op_names_, &stack[first]);
      if (r != nullptr && r != Py_None) {
        plan->serve = read_specs(r, plan->specs);
      }
      Py_XDECREF(r);
      if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) torchport::raise_python();  // Ctrl-C
        PyErr_Clear();
        return nullptr;
      }
    }
    std::lock_guard<std::mutex> l(m_);
    if (plans_.size() >= 4096) plans_.clear();  // layouts of a dynamic program
    plans_[key] = plan;
    return plan;
  }

  // The vendor's Python kernel on the out= overload's arguments; false: it declined.
  bool call_python(const torch::jit::Stack& call) {
    pybind11::gil_scoped_acquire gil;
    PyObject* r = call_object(fn_, out_op_.schema(), out_names_, call.data());
    if (r != nullptr) {
      Py_DECREF(r);
      return true;
    }
    if (PyErr_ExceptionMatches(decline_type)) {
      PyErr_Clear();
      return false;
    }
    torchport::raise_python();
  }

  // The vendor's C kernel on the out= overload's arguments (no GIL); false: it declined, or a
  // tensor has a type DLPack's C kernels are not given.
  bool call_c(const torch::jit::Stack& call, int index) {
    const size_t n = call.size();
    std::vector<TorchportArg> args(n);
    std::vector<std::vector<DLTensor>> tensor_lists;
    std::vector<std::vector<int64_t>> int_lists;
    std::vector<std::vector<double>> float_lists;
    tensor_lists.reserve(n);
    int_lists.reserve(n);
    float_lists.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      TorchportArg& a = args[i];
      std::memset(&a, 0, sizeof a);
      a.name = argument_names_[i].c_str();
      const c10::IValue& v = call[i];
      if (v.isNone()) {
        a.kind = TORCHPORT_ARG_NONE;
      } else if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        if (!t.defined()) {
          a.kind = TORCHPORT_ARG_NONE;
        } else if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
          number(t.item(), a);  // as Python receives it: a number
        } else {
          a.kind = TORCHPORT_ARG_TENSOR;
          if (!dl_tensor(t, a.tensor)) return false;
        }
      } else if (v.isTensorList()) {
        auto& list = tensor_lists.emplace_back();
        for (const at::Tensor& t : v.toTensorList()) {
          list.emplace_back();
          if (!t.defined() || !dl_tensor(t, list.back())) return false;
        }
        a.kind = TORCHPORT_ARG_TENSOR_LIST;
        a.count = static_cast<int32_t>(list.size());
        a.tensors = list.data();
      } else if (dtype_arg_[i]) {
        a.kind = TORCHPORT_ARG_DTYPE;
        if (!dl_dtype(v.toScalarType(), a.dtype)) return false;
      } else if (v.isIntList()) {
        auto& list = int_lists.emplace_back(v.toIntVector());
        a.kind = TORCHPORT_ARG_INT_LIST;
        a.count = static_cast<int32_t>(list.size());
        a.ints = list.data();
      } else if (v.isDoubleList()) {
        auto& list = float_lists.emplace_back(v.toDoubleVector());
        a.kind = TORCHPORT_ARG_FLOAT_LIST;
        a.count = static_cast<int32_t>(list.size());
        a.floats = list.data();
      } else if (v.isString()) {
        a.kind = TORCHPORT_ARG_STRING;
        a.str = v.toStringRef().c_str();
        a.count = static_cast<int32_t>(v.toStringRef().size());
      } else if (v.isScalar()) {
        number(v.toScalar(), a);
      } else {
        return false;  // not a C kernel's argument (c_kernels.py refuses such schemas)
      }
    }
    int64_t stream = torchport::caching_current_stream(static_cast<c10::DeviceIndex>(index));
    if (stream != 0) {  // a side stream: the runtime's handle of it
      pybind11::gil_scoped_acquire gil;
      PyObject* h = PyObject_CallFunction(stream_handle, "i", index);
      if (h == nullptr) torchport::raise_python();
      stream = PyLong_AsLongLong(h);
      Py_DECREF(h);
      if (stream == -1 && PyErr_Occurred()) torchport::raise_python();
    }
    char error[1024] = {0};
    TorchportCall c{TORCHPORT_KERNEL_ABI, static_cast<int32_t>(n), args.data(), index, stream,
                    error, sizeof error};
    const int32_t rc = c_fn_(&c);
    if (rc == TORCHPORT_DECLINE) return false;
    error[sizeof error - 1] = '\0';
    TORCH_CHECK(rc == TORCHPORT_OK, out_name_, ": the vendor's C kernel failed: ",
                rc == TORCHPORT_ERROR ? std::string(error) : "returned " + std::to_string(rc));
    return true;
  }

  // `fn` (the op's Python kernel, or its next path) on the call; its results replace it.
  void handed_to(PyObject* fn, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    handed.fetch_add(1, std::memory_order_relaxed);
    torchport::python_kernel_call(fn, nullptr, op, stack);
  }

  c10::OperatorHandle op_, out_op_;
  std::string out_name_;
  int kind_;
  PyObject *python_, *planner_, *next_, *fn_;
  TorchportKernel c_fn_;
  std::vector<PyObject*> op_names_, out_names_;
  std::vector<size_t> written_;
  std::vector<std::string> argument_names_;
  std::vector<bool> dtype_arg_;
  std::mutex m_;
  std::unordered_map<std::string, std::shared_ptr<const Plan>> plans_;
};

}  // namespace

extern "C" {
// The Decline exception and the Python `stream_handle(index) -> int` function (a side stream's
// runtime handle, for C kernels): 1; 0 with a Python error. Through ctypes.PyDLL.
int torchport_vendor_kernels_configure(PyObject* decline, PyObject* handle) {
  if (!PyExceptionClass_Check(decline) || !PyCallable_Check(handle)) {
    PyErr_SetString(PyExc_TypeError, "expected an exception class and a callable");
    return 0;
  }
  std::lock_guard<std::mutex> lock(registering);
  Py_INCREF(decline);
  Py_INCREF(handle);
  Py_XDECREF(decline_type);
  Py_XDECREF(stream_handle);
  decline_type = decline;
  stream_handle = handle;
  return 1;
}

// Register overload `name` ("add.Tensor") of the vendor's out= kernel `out_name` ("add.out"),
// `kind` 0 (the out= overload), 1 (functional) or 2 (in place), with the Python kernel
// `python` for the calls C++ does not serve, the planner, the next path for a declined call,
// and the vendor's kernel `fn` (its C function's address `c_fn`, or 0): 1; 0 with a Python
// error. An overload registered before (in any group) stays. The registration belongs to
// group `group` (a kernel set's), which torchport_vendor_kernels_remove withdraws. Through
// ctypes.PyDLL.
int torchport_vendor_kernels_add(const char* name, const char* out_name, int kind,
                                 PyObject* python, PyObject* planner, PyObject* next,
                                 PyObject* fn, uint64_t c_fn, int64_t group) {
  if (decline_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "torchport_vendor_kernels_configure first");
    return 0;
  }
  std::lock_guard<std::mutex> lock(registering);
  try {
    for (const auto& g : groups)
      for (const auto& n : g.second.names)
        if (n == name) return 1;
    Group& g = groups[group];
    if (!g.library)
      g.library = std::make_unique<torch::Library>(
          torch::Library::IMPL, "aten", std::make_optional(c10::DispatchKey::PrivateUse1),
          __FILE__, __LINE__);
    g.library->impl(name, torch::CppFunction::makeFromBoxedFunctor(std::make_unique<VendorOp>(
                              name, out_name, kind, python, planner, next, fn,
                              static_cast<uintptr_t>(c_fn))));
    g.names.emplace_back(name);
    for (PyObject* o : {python, planner, next, fn}) {
      Py_INCREF(o);
      g.references.push_back(o);
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return 0;
  }
  return 1;
}

// Withdraw group `group`'s registrations (the dispatcher's next kernel serves their overloads
// again) and release its Python objects; no call of them may be running. Through
// ctypes.PyDLL (the GIL held).
void torchport_vendor_kernels_remove(int64_t group) {
  Group g;
  {
    std::lock_guard<std::mutex> lock(registering);
    auto it = groups.find(group);
    if (it == groups.end()) return;
    g = std::move(it->second);
    groups.erase(it);
  }
  g.library.reset();  // deregisters; the kernels' functors go with it
  for (PyObject* o : g.references) Py_DECREF(o);
}

// While set, every call takes its Python kernel (ops intercepted; tests of the Python path).
void torchport_vendor_kernels_python_only(int on) { python_only.store(on != 0); }

// Calls served from C++, handed to Python (the op's kernel or next path), declined by the
// vendor's kernel, since the process started.
void torchport_vendor_kernels_counts(int64_t* out) {
  out[0] = served.load();
  out[1] = handed.load();
  out[2] = declined.load();
}
}
#endif
