// The device's boxed fallbacks (dense, sparse, quantized) from torchport's exit handler on. PyTorch's boxed Python
// fallback hands the Python function the op's Python object, which it looks up with
// `import torch` the first time it meets the op (torch::detail::getTorchApiFunction, cached
// per op); once the interpreter tears its modules down, that import fails, and an op first
// met in a finaliser then (a `__del__` of a module global) would raise where the CPU's
// kernel computes. From the exit handler on, these fallbacks replace the Python registrations
// (torchport/ops/fallback.py): each finds the op's Python object through the `torch.ops`
// object it was given while the interpreter could still import, and calls the same Python
// fallback; where even that lookup fails (the op's packet cannot be made any more), PyTorch's
// C++ CPU fallback runs the op (at::native::cpu_fallback: copies to the host and back).
#if __has_include(<Python.h>)
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUFallback.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "native_layer.h"

namespace {

PyObject* torch_ops = nullptr;  // the `torch.ops` module object
std::mutex lookup;
std::unordered_map<std::string, PyObject*> ops;  // "ns::name.overload" -> OpOverload
std::vector<std::unique_ptr<torch::Library>> registered;

// The op's OpOverload (a new reference), or null without a Python error where it cannot be
// made. Holds the GIL.
PyObject* op_object(const c10::OperatorHandle& op) {
  const auto& name = op.operator_name();
  const std::string key = name.name + "." + name.overload_name;
  {
    std::lock_guard<std::mutex> lock(lookup);
    auto it = ops.find(key);
    if (it != ops.end()) return Py_NewRef(it->second);
  }
  const auto sep = name.name.find("::");
  if (sep == std::string::npos) return nullptr;
  const std::string ns = name.name.substr(0, sep), base = name.name.substr(sep + 2);
  const std::string overload = name.overload_name.empty() ? "default" : name.overload_name;
  PyObject* space = PyObject_GetAttrString(torch_ops, ns.c_str());
  PyObject* packet = space ? PyObject_GetAttrString(space, base.c_str()) : nullptr;
  PyObject* found = packet ? PyObject_GetAttrString(packet, overload.c_str()) : nullptr;
  Py_XDECREF(packet);
  Py_XDECREF(space);
  if (!found) {
    PyErr_Clear();
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(lookup);
  auto [it, added] = ops.emplace(key, found);
  if (!added) Py_DECREF(found);
  return Py_NewRef(it->second);
}

// The fallback of one dispatch key: its Python fallback(keyset, op, *args, **kwargs) (the
// keyset passed as None: torchport's fallbacks do not read it), else PyTorch's CPU fallback
// with the matching CPU key.
class ExitFallback final : public c10::OperatorKernel {
 public:
  ExitFallback(PyObject* python, c10::DispatchKey cpu_key) : python_(python), cpu_key_(cpu_key) {
    Py_INCREF(python_);  // kept for the process
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet,
                  torch::jit::Stack* stack) {
    PyObject* prefix = nullptr;
    {
      pybind11::gil_scoped_acquire gil;
      PyObject* found = op_object(op);
      if (found) {
        prefix = PyTuple_Pack(2, Py_None, found);
        Py_DECREF(found);
        if (!prefix) torchport::raise_python();
      }
    }
    if (!prefix) {
      at::native::cpu_fallback(op, stack, false, cpu_key_);
      return;
    }
    struct Release {
      PyObject* p;
      ~Release() {
        pybind11::gil_scoped_acquire gil;
        Py_DECREF(p);
      }
    } release{prefix};
    torchport::python_kernel_call(python_, prefix, op, stack);
  }

 private:
  PyObject* python_;
  c10::DispatchKey cpu_key_;
};

}  // namespace

// From now on, the fallback of dispatch key `key` (a name with "PrivateUse1" in it) is one
// calling `fallback` (a Python fallback whose registration the caller has removed) with op
// objects found through `ops` (the `torch.ops` object): 1; 0 with a Python error. Called
// through ctypes.PyDLL (with the GIL).
extern "C" int torchport_exit_fallback_install(PyObject* fallback, PyObject* ops_module,
                                               const char* key) {
  if (!PyCallable_Check(fallback) || !key) {
    PyErr_SetString(PyExc_TypeError, "expected a Python fallback, torch.ops and a key name");
    return 0;
  }
  try {
    std::string cpu = key;
    const auto at = cpu.find("PrivateUse1");
    TORCH_CHECK(at != std::string::npos, "not a key of the device: ", key);
    cpu.replace(at, std::strlen("PrivateUse1"), "CPU");
    auto lib = std::make_unique<torch::Library>(
        torch::Library::IMPL, "_", std::make_optional(c10::parseDispatchKey(key)), __FILE__,
        __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunctor(
        std::make_unique<ExitFallback>(fallback, c10::parseDispatchKey(cpu))));
    if (!torch_ops) torch_ops = Py_NewRef(ops_module);
    registered.push_back(std::move(lib));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return 0;
  }
  return 1;
}
#endif
