// PrivateUse1's random-number generators in C++: torch.Generator(device="sim:1") and the
// device's default generators (torch.sim.default_generators).
//
// PyTorch makes a device generator only through the C++ accelerator hooks (getNewGenerator
// for torch.Generator(device=...), getDefaultGenerator for the per-device default ones);
// PyTorch's Python-backend hooks implement neither. The device's kernels are CPU kernels,
// which accept only a CPU generator, so each device generator here owns a CPU generator
// (at::CPUGeneratorImpl) and answers everything about its state from it: the same state
// format (torch.sim.get_rng_state is a CPU state), the same numbers as a CPU generator with
// the same seed. An op given a device generator runs its CPU kernel with the inner one
// (torchport_generator_inner, from ops/hostexec.py). The default generator of a device
// owns the CPU generator torchport's random ops on that device already draw from
// (Backend.generators[i], handed over by torchport_generators_adopt), so that
// torch.sim.manual_seed, torch.manual_seed, torch.sim.default_generators[i] and
// get/set_rng_state all act on one state.
// Built with the other csrc/*.cpp by torchport/core/native.py; the parts that take or return
// Python objects need Python's headers (and libtorch_python), and are left out without them.
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/ivalue.h>
#include <c10/core/DeviceType.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "native_layer.h"

namespace torchport {

namespace {

// A device generator: device PrivateUse1:index, state in an owned CPU generator. PyTorch
// holds this generator's mutex_ around every call it makes here; CPU kernels hold the
// inner generator's mutex while they draw, so each call takes that one too.
class DeviceGenerator final : public c10::GeneratorImpl {
 public:
  DeviceGenerator(c10::DeviceIndex index, at::Generator inner, bool is_default = false)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        inner_(std::move(inner)),
        is_default_(is_default) {}

  void set_current_seed(uint64_t seed) override {
    std::lock_guard<std::mutex> lock(inner_.mutex());
    impl()->set_current_seed(seed);
  }
  uint64_t current_seed() const override { return impl()->current_seed(); }
  uint64_t seed() override {
    std::lock_guard<std::mutex> lock(inner_.mutex());
    return impl()->seed();
  }
  // The state is the CPU's mt19937 state, which has no Philox offset to move: the offset
  // is 0 (so that pickling, which saves and restores it for device generators, works).
  void set_offset(uint64_t offset) override {
    TORCH_CHECK(offset == 0, c10::get_privateuse1_backend(),
                " generators hold the CPU's mt19937 state, which has no offset (asked for ",
                offset, "); restore a state with set_state(get_state()) instead");
  }
  uint64_t get_offset() const override { return 0; }
  void set_state(const c10::TensorImpl& new_state) override {
    std::lock_guard<std::mutex> lock(inner_.mutex());
    impl()->set_state(new_state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    std::lock_guard<std::mutex> lock(impl()->mutex_);
    return impl()->get_state();
  }
  // As CUDA's: a generator of this device sharing this one's state.
  c10::intrusive_ptr<c10::GeneratorImpl> graphsafe_get_state() const override {
    return c10::make_intrusive<DeviceGenerator>(device_.index(), inner_);
  }
  // As CUDA's: this generator shares `state`'s state from now on. Not for a default
  // generator, whose state the device's random ops hold on to.
  void graphsafe_set_state(const c10::intrusive_ptr<c10::GeneratorImpl>& state) override {
    auto* other = dynamic_cast<DeviceGenerator*>(state.get());
    TORCH_CHECK(other != nullptr, "graphsafe_set_state of a ", c10::get_privateuse1_backend(),
                " generator expects a ", c10::get_privateuse1_backend(),
                " generator's graphsafe_get_state(), got one of device ", state->device());
    TORCH_CHECK(!is_default_, "graphsafe_set_state cannot rebind the default generator of ",
                device_, " (the device's random ops draw from its state); copy a state in "
                "with set_state(other.get_state()) instead");
    at::Generator shared = other->inner();
    std::lock_guard<std::mutex> lock(inner_mutex_);
    inner_ = std::move(shared);
  }

  // The CPU generator holding the state (what the device's CPU kernels draw from).
  at::Generator inner() const {
    std::lock_guard<std::mutex> lock(inner_mutex_);
    return inner_;
  }

 private:
  c10::GeneratorImpl* impl() const { return inner_.unsafeGetGeneratorImpl(); }

  DeviceGenerator* clone_impl() const override {
    std::lock_guard<std::mutex> lock(impl()->mutex_);
    return new DeviceGenerator(device_.index(), at::Generator(impl()->clone()));
  }

  at::Generator inner_;
  bool is_default_;
  mutable std::mutex inner_mutex_;  // guards rebinding inner_ (graphsafe_set_state)
};

// The default generators, one per visible device; never destroyed (PyTorch may hold a
// reference to one while the process's static objects are torn down at exit). A second
// adoption (a registration retried after it failed) makes a new vector: the references
// getDefaultGenerator gave out stay valid.
std::mutex defaults_mutex;
std::vector<at::Generator>* defaults = nullptr;

const std::vector<at::Generator>& adopted() {
  std::lock_guard<std::mutex> lock(defaults_mutex);
  TORCH_CHECK_NOT_IMPLEMENTED(
      defaults != nullptr, c10::get_privateuse1_backend(),
      " has no device generators: torchport's C++ library was built without Python's headers "
      "(install the python3-dev package, then remove the cache directory to rebuild it); "
      "seed the device with torch.", c10::get_privateuse1_backend(), ".manual_seed instead");
  return *defaults;
}

c10::DeviceIndex resolve(c10::DeviceIndex index, std::size_t count) {
  if (index < 0) {
    index = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->getDevice().index();
  }
  if (index < 0 || static_cast<std::size_t>(index) >= count) {
    const std::string name = c10::get_privateuse1_backend();
    // 101: CUDA's code for an invalid device ordinal
    throw c10::AcceleratorError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, 101,
        name + ": invalid device ordinal " + std::to_string(index) + " for a generator; " +
            std::to_string(count) + " " + name + " device(s) are visible (TORCHPORT_VISIBLE_DEVICES)");
  }
  return index;
}

}  // namespace

// The default generator of device `index` (-1: the current device).
const at::Generator& default_generator(c10::DeviceIndex index) {
  const auto& gens = adopted();
  return gens[static_cast<std::size_t>(resolve(index, gens.size()))];
}

// The CPU generator a CPU kernel draws from for a random op's `generator` argument on device
// `index`: a device generator's own (of any index, as CUDA's kernels take one), or for none
// the default generator's of device `index`; undefined for a generator of another type, or
// where the device has no generators (its Python kernel then raises or draws).
at::Generator drawing_generator(const c10::IValue& given, c10::DeviceIndex index) {
  c10::GeneratorImpl* impl = nullptr;
  at::Generator held;
  if (given.isNone()) {
    std::lock_guard<std::mutex> lock(defaults_mutex);
    if (defaults == nullptr || index < 0 || static_cast<std::size_t>(index) >= defaults->size())
      return at::Generator();
    held = (*defaults)[static_cast<std::size_t>(index)];
  } else if (given.isGenerator()) {
    held = given.toGenerator();
  } else {
    return at::Generator();
  }
  impl = held.unsafeGetGeneratorImpl();
  auto* device = dynamic_cast<DeviceGenerator*>(impl);
  return device == nullptr ? at::Generator() : device->inner();
}

// While alive, the CPU's default generator draws the numbers of `gen` (a CPU generator), for
// a CPU kernel with no generator argument (native_dropout): the two swap their engines and
// cached normal samples, and swap them back after (also when the kernel raises). Drawing so
// is what the Python kernels do with the generators' states (hostexec.drawing_from).
DefaultDrawsFrom::DefaultDrawsFrom(at::Generator gen) : gen_(std::move(gen)) { swap(); }
DefaultDrawsFrom::~DefaultDrawsFrom() { swap(); }

void DefaultDrawsFrom::swap() {
  at::Generator fallback = at::detail::getDefaultCPUGenerator();
  if (fallback.unsafeGetGeneratorImpl() == gen_.unsafeGetGeneratorImpl()) return;
  auto* a = at::check_generator<at::CPUGeneratorImpl>(fallback);
  auto* b = at::check_generator<at::CPUGeneratorImpl>(gen_);
  std::scoped_lock lock(fallback.mutex(), gen_.mutex());
  at::mt19937 engine = a->engine();
  a->set_engine(b->engine());
  b->set_engine(engine);
  std::optional<float> f = a->next_float_normal_sample();
  a->set_next_float_normal_sample(b->next_float_normal_sample());
  b->set_next_float_normal_sample(f);
  std::optional<double> d = a->next_double_normal_sample();
  a->set_next_double_normal_sample(b->next_double_normal_sample());
  b->set_next_double_normal_sample(d);
}

// A new generator of device `index` (-1: the current device), seeded as CUDA's and the
// CPU's new generators are.
at::Generator new_generator(c10::DeviceIndex index) {
  index = resolve(index, adopted().size());
  return at::make_generator<DeviceGenerator>(
      index, at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val));
}

}  // namespace torchport

#if __has_include(<Python.h>)
#include <torch/csrc/Generator.h>

namespace {

// Runs `body` turning a C++ exception into the matching Python one (these functions are
// called through ctypes.PyDLL, which raises the error set here); `fail` is returned then.
template <typename T, typename F>
T guarded(T fail, F body) {
  try {
    return body();
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return fail;
}

}  // namespace

// Makes the CPU generators in the sequence `cpu_generators` (one per visible device, in
// order) the states of the devices' default generators; returns their number, or -1 with
// a Python error set.
extern "C" int torchport_generators_adopt(PyObject* cpu_generators) {
  return guarded(-1, [&]() -> int {
    PyObject* seq = PySequence_Fast(cpu_generators, "expected a sequence of torch.Generator");
    if (seq == nullptr) return -1;
    auto gens = std::make_unique<std::vector<at::Generator>>();
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    try {
      for (Py_ssize_t i = 0; i < n; ++i) {
        at::Generator cpu = THPGenerator_Unwrap(PySequence_Fast_GET_ITEM(seq, i));
        TORCH_CHECK_TYPE(cpu.device().type() == c10::DeviceType::CPU,
                         "a device's default generator holds a CPU generator, got one of ",
                         cpu.device());
        gens->push_back(at::make_generator<torchport::DeviceGenerator>(
            static_cast<c10::DeviceIndex>(i), std::move(cpu), true));
      }
    } catch (...) {
      Py_DECREF(seq);
      throw;
    }
    Py_DECREF(seq);
    std::lock_guard<std::mutex> lock(torchport::defaults_mutex);
    torchport::defaults = gens.release();  // an earlier vector stays alive (see above)
    return static_cast<int>(n);
  });
}

// torch.Generator of device `index`'s default generator (new reference), or NULL with a
// Python error set.
extern "C" PyObject* torchport_generator_default(int index) {
  return guarded<PyObject*>(nullptr, [&]() {
    return THPGenerator_initDefaultGenerator(
        torchport::default_generator(static_cast<c10::DeviceIndex>(index)));
  });
}

// The CPU generator holding the state of the device generator `generator` (a
// torch.Generator of this device type), as a torch.Generator (new reference); NULL with
// a Python error set for any other object.
extern "C" PyObject* torchport_generator_inner(PyObject* generator) {
  return guarded<PyObject*>(nullptr, [&]() {
    at::Generator gen = THPGenerator_Unwrap(generator);
    auto* impl = dynamic_cast<torchport::DeviceGenerator*>(gen.unsafeGetGeneratorImpl());
    TORCH_CHECK_TYPE(impl != nullptr, "expected a ", c10::get_privateuse1_backend(),
                     " generator, got one of device ", gen.device());
    return THPGenerator_Wrap(impl->inner());
  });
}
#endif
