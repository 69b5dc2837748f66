// empty.memory_format and empty_strided for PrivateUse1 in C++: a new device tensor over a
// block of the C++ caching allocator (native_caching_allocator.cpp) on the current stream,
// without a Python call per allocation.
//
// The common case -- a strided layout, a dtype the device supports, a visible device (the
// C++ guard's current one where the device has no index), sizes and strides that fit --
// is served here, with what torchport's Python kernels (torchport/ops/core.py) compute:
// contiguous, channels_last or channels_last_3d strides by the same rules, the default
// dtype where none is given. Anything else (negative sizes, mismatched ranks, overflowing
// layouts, an unsupported or quantized dtype, another layout, an invalid device index, a
// memory format those rules reject) calls the Python kernel, so that its result or its
// exception, type and message, is exactly the Python one (a python_error carries the
// exception back through the dispatcher unchanged).
// Switched by torchport/ops/native_factories.py like the view kernels: no static
// registration, registered by torchport_native_factories_enable() and removed by _disable().
#if __has_include(<Python.h>)
#include <ATen/core/Tensor.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/MemoryFormat.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>

#include <bitset>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "native_layer.h"


namespace {

constexpr auto kDevice = c10::DeviceType::PrivateUse1;

// The Python kernels (new references, kept while registered) and what the fast path takes.
PyObject* python_empty = nullptr;
PyObject* python_empty_strided = nullptr;
std::bitset<256> rejected;  // dtypes the device refuses (the Python kernel raises for them)
int visible = 0;
std::unique_ptr<torch::Library> registered;

bool plain_device(const std::optional<c10::Device>& device, int& index) {
  if (device && device->type() != kDevice) return false;
  index = device && device->has_index() ? device->index() : torchport::guard_current_device();
  return index >= 0 && index < visible && torchport::caching_serves();
}

bool plain_dtype(const std::optional<c10::ScalarType>& dtype, c10::ScalarType& scalar) {
  scalar = dtype ? *dtype : c10::get_default_dtype_as_scalartype();
  return !rejected.test(static_cast<size_t>(scalar));
}

bool plain_layout(const std::optional<c10::Layout>& layout,
                  const std::optional<bool>& pin_memory) {
  return (!layout || *layout == c10::Layout::Strided) && !pin_memory.value_or(false);
}

// Bytes of the layout as torchport.memory.tensors.storage_nbytes counts them; false where the
// layout is invalid or does not fit in int64 (the Python kernel says which error).
bool layout_bytes(c10::IntArrayRef sizes, c10::IntArrayRef strides, size_t itemsize,
                  uint64_t& nbytes) {
  if (sizes.size() != strides.size()) return false;
  bool empty = false;
  for (int64_t s : sizes) {
    if (s < 0) return false;
    empty = empty || s == 0;
  }
  nbytes = 0;
  if (empty) return true;
  int64_t extent = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 1) continue;
    if (strides[i] < 0) return false;
    int64_t span = 0;
    if (__builtin_mul_overflow(sizes[i] - 1, strides[i], &span) ||
        __builtin_add_overflow(extent, span, &extent))
      return false;
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(extent, static_cast<int64_t>(itemsize), &bytes)) return false;
  nbytes = static_cast<uint64_t>(bytes);
  return true;
}

// torchport.ops.core.strides_for; false where it would raise or a product overflows.
bool strides_for(c10::IntArrayRef sizes, const std::optional<c10::MemoryFormat>& format,
                 std::vector<int64_t>& strides) {
  size_t n = sizes.size();
  strides.assign(n, 0);
  c10::MemoryFormat f = format.value_or(c10::MemoryFormat::Contiguous);
  bool last = f == c10::MemoryFormat::ChannelsLast && n == 4;
  bool last3d = f == c10::MemoryFormat::ChannelsLast3d && n == 5;
  if (f != c10::MemoryFormat::Contiguous && !last && !last3d) return false;
  if ((last || last3d) && sizes[1] != 0) {
    // innermost first: channels, then the spatial dimensions from the last, then batch
    strides[1] = 1;
    int64_t acc = sizes[1];
    for (size_t i = n - 1; i >= 2; --i) {
      strides[i] = acc;
      if (__builtin_mul_overflow(acc, sizes[i], &acc)) return false;
    }
    strides[0] = acc;
    return true;
  }
  int64_t acc = 1;
  for (size_t i = n; i-- > 0;) {
    strides[i] = acc;
    if (__builtin_mul_overflow(acc, std::max<int64_t>(sizes[i], 1), &acc)) return false;
  }
  return true;
}

PyObject* int_list(c10::IntArrayRef values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (!list) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(values[i]);
    if (!v) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), v);
  }
  return list;
}

PyObject* borrowed(PyObject* o) {
  Py_INCREF(o);
  return o;
}

// The Python kernel `fn` on these arguments: its tensor, or its exception rethrown.
at::Tensor call_python(PyObject* fn, c10::IntArrayRef size, const c10::IntArrayRef* stride,
                       const std::optional<c10::ScalarType>& dtype,
                       const std::optional<c10::Layout>& layout,
                       const std::optional<c10::Device>& device,
                       const std::optional<bool>& pin_memory,
                       const std::optional<c10::MemoryFormat>* memory_format) {
  pybind11::gil_scoped_acquire gil;
  auto fail = [] {
    python_error e;
    e.persist();
    throw std::move(e);
  };
  PyObject* args = PyTuple_New(stride ? 2 : 1);
  if (!args) fail();
  PyObject* kwargs = PyDict_New();
  auto done = [&] {
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
  };
  auto set = [&](const char* name, PyObject* value) {
    bool ok = value && PyDict_SetItemString(kwargs, name, value) == 0;
    Py_XDECREF(value);
    return ok;
  };
  PyObject* size_list = int_list(size);
  PyObject* stride_list = stride ? int_list(*stride) : nullptr;
  bool ok = kwargs && size_list && (!stride || stride_list);
  if (size_list) PyTuple_SET_ITEM(args, 0, size_list);
  if (stride_list) PyTuple_SET_ITEM(args, 1, stride_list);
  ok = ok &&
       set("dtype", dtype ? borrowed(reinterpret_cast<PyObject*>(torch::getTHPDtype(*dtype)))
                          : borrowed(Py_None)) &&
       set("layout", layout
                         ? borrowed(reinterpret_cast<PyObject*>(torch::getTHPLayout(*layout)))
                         : borrowed(Py_None)) &&
       set("device", device ? THPDevice_New(*device) : borrowed(Py_None)) &&
       set("pin_memory", pin_memory ? PyBool_FromLong(*pin_memory) : borrowed(Py_None));
  if (ok && memory_format)
    ok = set("memory_format",
             *memory_format ? borrowed(torch::utils::getTHPMemoryFormat(**memory_format))
                            : borrowed(Py_None));
  PyObject* result = ok ? PyObject_Call(fn, args, kwargs) : nullptr;
  done();
  if (!result) fail();
  if (!THPVariable_Check(result)) {
    Py_DECREF(result);
    PyErr_SetString(PyExc_TypeError, "torchport: an empty kernel returned no tensor");
    fail();
  }
  at::Tensor t = THPVariable_Unpack(result);
  Py_DECREF(result);
  return t;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  int index = 0;
  c10::ScalarType scalar{};
  std::vector<int64_t> strides;
  uint64_t nbytes = 0;
  if (plain_layout(layout, pin_memory) && plain_dtype(dtype, scalar) &&
      plain_device(device, index) && strides_for(size, memory_format, strides) &&
      layout_bytes(size, strides, c10::elementSize(scalar), nbytes))
    return torchport::caching_new_tensor(
        index, nbytes, scalar, size, strides,
        torchport::caching_current_stream(static_cast<c10::DeviceIndex>(index)));
  return call_python(python_empty, size, nullptr, dtype, layout, device, pin_memory,
                     &memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  int index = 0;
  c10::ScalarType scalar{};
  uint64_t nbytes = 0;
  if (plain_layout(layout, pin_memory) && plain_dtype(dtype, scalar) &&
      plain_device(device, index) && layout_bytes(size, stride, c10::elementSize(scalar), nbytes))
    return torchport::caching_new_tensor(
        index, nbytes, scalar, size, stride,
        torchport::caching_current_stream(static_cast<c10::DeviceIndex>(index)));
  return call_python(python_empty_strided, size, &stride, dtype, layout, device, pin_memory,
                     nullptr);
}

// A compiled program's buffer: `empty_strided(size, stride, dtype, index)` as a C function
// (its `self` the Python allocator serving what this does not: a refused dtype, a device
// index out of range, an invalid layout, and every call while the kernels above are not
// registered, so that intercepted ops see the program's allocations too).
PyObject* compiled_empty_strided(PyObject* fallback, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs == 4 && registered && THPDtype_Check(args[2]) && PyLong_CheckExact(args[3]) &&
      PyTuple_Check(args[0]) && PyTuple_Check(args[1]) &&
      PyTuple_GET_SIZE(args[0]) == PyTuple_GET_SIZE(args[1]) && PyTuple_GET_SIZE(args[0]) <= 16) {
    const Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
    int64_t sizes[16], strides[16];
    bool ints = true;
    for (Py_ssize_t i = 0; ints && i < n; ++i) {
      PyObject* a = PyTuple_GET_ITEM(args[0], i);
      PyObject* b = PyTuple_GET_ITEM(args[1], i);
      ints = PyLong_CheckExact(a) && PyLong_CheckExact(b);
      if (ints) {
        sizes[i] = PyLong_AsLongLong(a);
        strides[i] = PyLong_AsLongLong(b);
      }
    }
    const long index = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) {
      PyErr_Clear();
      ints = false;
    }
    const c10::ScalarType scalar = reinterpret_cast<THPDtype*>(args[2])->scalar_type;
    uint64_t nbytes = 0;
    c10::IntArrayRef size(sizes, static_cast<size_t>(n)), stride(strides, static_cast<size_t>(n));
    if (ints && index >= 0 && index < visible && torchport::caching_serves() &&
        !rejected.test(static_cast<size_t>(scalar)) &&
        layout_bytes(size, stride, c10::elementSize(scalar), nbytes)) {
      try {
        return THPVariable_Wrap(torchport::caching_new_tensor(
            static_cast<int>(index), nbytes, scalar, size, stride,
            torchport::caching_current_stream(static_cast<c10::DeviceIndex>(index))));
      } catch (python_error& e) {
        e.restore();
        return nullptr;
      } catch (const std::exception&) {
        // out of memory: the Python allocator's path (its retry, its error's type)
      }
    }
  }
  return PyObject_Vectorcall(fallback, args, static_cast<size_t>(nargs), nullptr);
}

PyMethodDef compiled_empty_strided_def = {
    "empty_strided", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(compiled_empty_strided)),
    METH_FASTCALL, "A compiled program's buffer (size, stride, dtype, device index)."};

void keep(PyObject*& slot, PyObject* fn) {
  Py_XINCREF(fn);
  Py_XDECREF(slot);
  slot = fn;
}

}  // namespace

bool torchport::read_dtype_set(PyObject* list, std::bitset<256>& out) {
  if (!PyList_Check(list)) {
    PyErr_SetString(PyExc_TypeError, "expected a list of torch.dtype");
    return false;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i) {
    PyObject* d = PyList_GET_ITEM(list, i);
    if (!THPDtype_Check(d)) {
      PyErr_SetString(PyExc_TypeError, "expected a list of torch.dtype");
      return false;
    }
    out.set(static_cast<size_t>(reinterpret_cast<THPDtype*>(d)->scalar_type));
  }
  return true;
}

// Registers the two kernels (once) with the Python kernels `empty` and `strided` for
// everything but the plain cases, the dtypes `refused` (a list of torch.dtype) the device
// refuses, and `devices` visible devices: 1; 0 with a Python error for bad arguments.
// Called through ctypes.PyDLL (with the GIL).
extern "C" int torchport_native_factories_enable(PyObject* empty, PyObject* strided,
                                                 PyObject* refused, int devices) {
  if (!PyCallable_Check(empty) || !PyCallable_Check(strided) || !PyList_Check(refused)) {
    PyErr_SetString(PyExc_TypeError, "expected two kernels and a list of dtypes");
    return 0;
  }
  std::bitset<256> dtypes;
  if (!torchport::read_dtype_set(refused, dtypes)) return 0;
  keep(python_empty, empty);
  keep(python_empty_strided, strided);
  rejected = dtypes;
  visible = devices;
  if (!registered) {
    try {
      auto lib = std::make_unique<torch::Library>(
          torch::Library::IMPL, "aten", std::make_optional(c10::DispatchKey::PrivateUse1),
          __FILE__, __LINE__);
      lib->impl("empty.memory_format", TORCH_FN(empty_memory_format));
      lib->impl("empty_strided", TORCH_FN(empty_strided));
      registered = std::move(lib);
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return 0;
    }
  }
  return 1;
}

// The allocator compiled programs call (torchport/graph/inductor.py): a C function taking
// (size, stride, dtype, index) like `fallback`, the Python one it hands the rest to. A new
// reference; NULL with a Python error. Through ctypes.PyDLL.
extern "C" PyObject* torchport_compiled_empty_strided(PyObject* fallback) {
  if (!PyCallable_Check(fallback)) {
    PyErr_SetString(PyExc_TypeError, "expected a callable");
    return nullptr;
  }
  return PyCFunction_NewEx(&compiled_empty_strided_def, fallback, nullptr);
}

// Removes them again (the dispatcher then finds the Python kernels once registered).
extern "C" void torchport_native_factories_disable() { registered.reset(); }
#endif
