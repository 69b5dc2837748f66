// PrivateUse1's profiler stubs: device time of each op in torch.profiler.
//
// In the profiler state KINETO_PRIVATEUSE1_FALLBACK, PyTorch's kineto profiler asks the
// PrivateUse1 stubs (registerPrivateUse1Methods) for an event at every op's start and end
// (ThreadLocalSubqueue::begin_op, onFunctionExit) and, when the results are read, for the
// time between the two (KinetoEvent::privateuse1ElapsedUs): the "Self <device>" columns of
// key_averages(). PyTorch's default stubs throw from every method ("PrivateUse1 used in
// profiler but not enabled"), caught and printed with a C++ backtrace for every op.
//
// These do what CUDA's stubs (torch/csrc/profiler/stubs/cuda.cpp) do with CUDA events, with
// the vendor runtime's events, through callbacks that torchport/device/profiling.py sets: record
// creates a timing event on the current device's current stream and records it; elapsed
// synchronises two events and gives the microseconds between them; releasing the last
// reference destroys the event. A callback never throws (it answers 0 where the runtime
// failed), and none is made while an exception unwinds (Python's error indicator may be
// set then) or from inside another callback on the same thread (a runtime whose event
// calls run torch ops would recurse): those ops get no device time.
// Built with the other csrc/*.cpp by torchport/core/native.py; enabled by
// torchport_profiler_enable().
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>

#include <c10/core/DeviceGuard.h>
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/profiler/stubs/base.h>

#include "native_layer.h"

// PyTorch's registry of kineto activity profilers for PrivateUse1
// (torch/csrc/profiler/standalone/privateuse1_profiler.h); its header needs kineto's
// include directory and USE_KINETO, which this build does not pass, so the two exported
// functions used here are declared.
namespace torch::profiler::impl {
class PrivateUse1ProfilerRegistry {
 public:
  static PrivateUse1ProfilerRegistry& instance();
  bool hasFactory() const;
};
}  // namespace torch::profiler::impl

namespace {

using RecordFn = std::int64_t (*)(std::int32_t* device);
using ElapsedFn = double (*)(std::int64_t start, std::int64_t end);
using ReleaseFn = void (*)(std::int64_t event);
using SynchronizeFn = void (*)();

std::atomic<RecordFn> record_fn{nullptr};
std::atomic<ElapsedFn> elapsed_fn{nullptr};
std::atomic<ReleaseFn> release_fn{nullptr};
std::atomic<SynchronizeFn> synchronize_fn{nullptr};
std::atomic<int> visible{0};

thread_local bool in_callback = false;

// May this thread call into Python now?
bool may_call() { return !in_callback && std::uncaught_exceptions() == 0; }

struct CallbackScope {
  CallbackScope() { in_callback = true; }
  ~CallbackScope() { in_callback = false; }
  torchport::CallbackInterrupts interrupts;
};

void release(void* handle) {
  ReleaseFn fn = release_fn.load();
  if (fn != nullptr && may_call()) {
    CallbackScope scope;
    fn(static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(handle)));
  }
}

struct Stubs final : public torch::profiler::impl::ProfilerStubs {
  void record(c10::DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event,
              std::int64_t* cpu_ns) const override {
    std::int32_t index = 0;
    std::int64_t handle = 0;
    if (cpu_ns != nullptr) *cpu_ns = c10::getTime();
    RecordFn fn = record_fn.load();
    if (fn != nullptr && may_call()) {
      CallbackScope scope;
      handle = fn(&index);
    }
    if (device != nullptr) *device = static_cast<c10::DeviceIndex>(index);
    if (handle > 0) {
      event->reset(reinterpret_cast<void*>(static_cast<std::intptr_t>(handle)), &release);
    } else {
      event->reset();
    }
  }

  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* start,
                const torch::profiler::impl::ProfilerVoidEventStub* end) const override {
    if (start == nullptr || end == nullptr || !*start || !*end) return 0.0f;
    ElapsedFn fn = elapsed_fn.load();
    if (fn == nullptr || !may_call()) return 0.0f;
    CallbackScope scope;
    double us = fn(static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(start->get())),
                   static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(end->get())));
    return us > 0.0 ? static_cast<float>(us) : 0.0f;
  }

  // No annotation API in the runtime interface: the ranges are in the profiler's own trace.
  void mark(const char*) const override {}
  void rangePush(const char*) const override {}
  void rangePop() const override {}

  void onEachDevice(std::function<void(int)> op) const override {
    int count = visible.load();
    if (count <= 0) return;
    c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, 0));
    for (int i = 0; i < count; ++i) {
      guard.set_index(static_cast<c10::DeviceIndex>(i));
      op(i);
    }
  }

  void synchronize() const override {
    SynchronizeFn fn = synchronize_fn.load();
    if (fn != nullptr && may_call()) {
      CallbackScope scope;
      fn();
    }
  }

  bool enabled() const override { return true; }
};

}  // namespace

// Sets the callbacks and registers these stubs for PrivateUse1 with `count` visible
// devices (once; later calls only replace the callbacks). Returns 1.
extern "C" int torchport_profiler_enable(int count, RecordFn record, ElapsedFn elapsed,
                                         ReleaseFn release_event, SynchronizeFn synchronize) {
  visible.store(count);
  record_fn.store(record);
  elapsed_fn.store(elapsed);
  release_fn.store(release_event);
  synchronize_fn.store(synchronize);
  static Stubs* stubs = [] {
    auto* s = new Stubs();  // never destroyed: events may be released at exit
    torch::profiler::impl::registerPrivateUse1Methods(s);
    return s;
  }();
  return stubs != nullptr;
}

// Forgets the callbacks (at interpreter exit): events released later are not destroyed,
// and ops recorded later get no device time.
extern "C" void torchport_profiler_disable() {
  record_fn.store(nullptr);
  elapsed_fn.store(nullptr);
  release_fn.store(nullptr);
  synchronize_fn.store(nullptr);
}

// 1 where a kineto activity profiler of PrivateUse1 is registered (a vendor's C++,
// REGISTER_PRIVATEUSE1_PROFILER): PyTorch's own KINETO_PRIVATEUSE1 state then serves.
extern "C" int torchport_profiler_kineto_registered() {
  return torch::profiler::impl::PrivateUse1ProfilerRegistry::instance().hasFactory() ? 1 : 0;
}
