// The device guard of PrivateUse1 in C++: current device, streams and events.
//
// PyTorch asks this guard for the current device (resolving "sim" without an index in
// torch.tensor, Tensor.to, torch.accelerator), for the current stream of each device (the
// autograd engine records it for every tensor that requires grad and makes it current again
// for the backward of its node), and for events and synchronization (torch.Stream,
// torch.Event, torch.accelerator.synchronize, the autograd engine, c10d). PyTorch's
// Python-backend guard (torch/csrc/acc) answers "device 0, default stream, nothing to wait
// for". This one keeps the per-thread current device and the per-thread current stream of
// each device in C++ (read without Python, several times per op), and enters Python only
// where the runtime must act: making a stream, events, queries and synchronization. Those
// go through one callback that torchport's stream layer (streams.py) sets; it maps stream
// ids to the runtime's stream handles (id 0 is a device's default stream) and event ids to
// the runtime's events, and reports a failure by returning -1 after
// torchport_guard_fail(message).
// Built with the other csrc/*.cpp by torchport/core/native.py; enabled by
// torchport_guard_enable().
#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include <c10/core/Allocator.h>
#include <c10/core/DeviceCapability.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "native_layer.h"

namespace {

// What the callback is asked to do; the arguments are (a, b, c), results in *iout/*dout.
enum Op : int {
  NEW_STREAM = 0,      // (index, priority, from the pool) -> *iout = stream id
  QUERY_STREAM = 1,    // (index, stream id) -> returns 1 when its work completed
  SYNC_STREAM = 2,     // (index, stream id)
  SYNC_DEVICE = 3,     // (index)
  EVENT_CREATE = 4,    // (index, timing) -> *iout = event id (> 0)
  EVENT_RECORD = 5,    // (event, index, stream id)
  EVENT_BLOCK = 6,     // (event, index, stream id): the stream waits for the event
  EVENT_QUERY = 7,     // (event) -> returns 1 when the captured work completed
  EVENT_SYNC = 8,      // (event)
  EVENT_ELAPSED = 9,   // (event, end event) -> *dout = milliseconds
  EVENT_DESTROY = 10,  // (event)
  RECORD_DATA = 11,    // (address, index, stream id): the block is used by the stream
};
using Callback = int (*)(int op, long long a, long long b, long long c, long long* iout,
                         double* dout);

constexpr int kMaxDevices = 128;  // c10::DeviceIndex is an int8_t
thread_local c10::DeviceIndex current_index = 0;
thread_local std::array<c10::StreamId, kMaxDevices> current_streams{};  // 0: default
thread_local std::string failure;
std::atomic<c10::DeviceIndex> device_count{1};
std::atomic<Callback> callback{nullptr};
c10::DeviceCapability capability;

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < device_count.load(),
              "invalid device ordinal ", static_cast<int>(index), ": ",
              static_cast<int>(device_count.load()),
              " device(s) of this type are visible (TORCHPORT_VISIBLE_DEVICES)");
}

// Calls into Python; raises the callback's failure as a c10::Error.
int call(Op op, long long a, long long b = 0, long long c = 0, long long* iout = nullptr,
         double* dout = nullptr) {
  Callback fn = callback.load();
  TORCH_CHECK(fn != nullptr, "the device's stream layer is not available (the process is "
                             "exiting, or torchport registered no backend)");
  long long i = 0;
  double d = 0;
  torchport::CallbackInterrupts interrupts;
  int rc = fn(op, a, b, c, iout ? iout : &i, dout ? dout : &d);
  if (rc < 0) {
    std::string message = failure.empty() ? std::string("device runtime call failed") : failure;
    failure.clear();
    TORCH_CHECK(false, message);
  }
  return rc;
}

long long event_id(void* event) { return reinterpret_cast<long long>(event); }

struct Guard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (d.index() != current_index) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(type(), current_index); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == type(), "expected a PrivateUse1 device, got ", d);
    if (d.index() < 0) return;  // "the current device": nothing to change
    check_index(d.index());
    current_index = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count.load()) current_index = d.index();
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count.load(); }

  // ---- streams: ids only, per thread and device ------------------------------------
  c10::Stream getStream(c10::Device d) const noexcept override {
    c10::DeviceIndex index = resolve(d);
    return c10::Stream(c10::Stream::UNSAFE, device(index), current_streams[index]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, device(resolve(d)), 0);
  }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    return stream(d, priority, false);
  }
  // CUDA's pool: a few streams per device and priority, handed out round-robin
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority) const override {
    return stream(d, high_priority ? -1 : 0, true);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    c10::DeviceIndex index = resolve(s.device());
    c10::Stream old(c10::Stream::UNSAFE, device(index), current_streams[index]);
    current_streams[index] = s.id();
    return old;
  }
  bool queryStream(const c10::Stream& s) const override {
    return call(QUERY_STREAM, resolve(s.device()), s.id()) == 1;
  }
  void synchronizeStream(const c10::Stream& s) const override {
    call(SYNC_STREAM, resolve(s.device()), s.id());
  }
  void synchronizeDevice(const c10::DeviceIndex index) const override {
    c10::DeviceIndex i = index < 0 ? current_index : index;
    check_index(i);
    call(SYNC_DEVICE, i);
  }
  void recordDataPtrOnStream(const c10::DataPtr& data, const c10::Stream& s) const override {
    if (data.get() == nullptr) return;
    call(RECORD_DATA, reinterpret_cast<long long>(data.get()), resolve(s.device()), s.id());
  }

  // ---- events: ids of the stream layer's runtime events ------------------------------
  void record(void** event, const c10::Stream& s, const c10::DeviceIndex index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(index == -1 || index == s.device_index(), "Event device index ",
                static_cast<int>(index), " does not match recording stream's device index ",
                static_cast<int>(s.device_index()), ".");
    c10::DeviceIndex i = resolve(s.device());
    if (*event == nullptr) {
      long long id = 0;
      // BACKEND_DEFAULT is what torch.Event(enable_timing=True) asks for, as on CUDA
      call(EVENT_CREATE, i, flag == c10::EventFlag::BACKEND_DEFAULT ? 1 : 0, 0, &id);
      *event = reinterpret_cast<void*>(id);
    }
    call(EVENT_RECORD, event_id(*event), i, s.id());
  }
  void block(void* event, const c10::Stream& s) const override {
    if (event == nullptr) return;  // never recorded: nothing to wait for
    call(EVENT_BLOCK, event_id(event), resolve(s.device()), s.id());
  }
  bool queryEvent(void* event) const override {
    return event == nullptr || call(EVENT_QUERY, event_id(event)) == 1;
  }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) call(EVENT_SYNC, event_id(event));
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start != nullptr && end != nullptr,
                "Both events must be recorded before calculating elapsed time.");
    double ms = 0;
    call(EVENT_ELAPSED, event_id(start), event_id(end), 0, nullptr, &ms);
    return ms;
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    if (event == nullptr || callback.load() == nullptr) return;
    try {
      call(EVENT_DESTROY, event_id(event));
    } catch (...) {  // a destructor: the event is gone either way
    }
  }

  c10::DeviceCapability getDeviceCapability(c10::Device) const override { return capability; }

 private:
  c10::Stream stream(c10::Device d, int priority, bool pooled) const {
    c10::DeviceIndex index = resolve(d);
    check_index(index);
    long long id = 0;
    call(NEW_STREAM, index, priority, pooled ? 1 : 0, &id);
    return c10::Stream(c10::Stream::UNSAFE, device(index), id);
  }
  static c10::DeviceIndex resolve(c10::Device d) {
    c10::DeviceIndex index = d.index() < 0 ? current_index : d.index();
    return index < kMaxDevices ? index : 0;
  }
  c10::Device device(c10::DeviceIndex index) const { return c10::Device(type(), index); }
};

Guard guard;

}  // namespace

namespace torchport {
// The guard's device state, for the accelerator hooks (native_hooks.cpp).
c10::DeviceIndex guard_device_count() { return device_count.load(); }
c10::DeviceIndex guard_current_device() { return current_index; }
void guard_set_device(c10::DeviceIndex index) {
  guard.setDevice(c10::Device(c10::DeviceType::PrivateUse1, index));
}
// A call into the stream layer (Op, arguments, *iout), for the caching allocator's events
// (native_caching_allocator.cpp); raises its failure as a c10::Error.
int guard_call(int op, long long a, long long b, long long c, long long* iout) {
  return call(static_cast<Op>(op), a, b, c, iout);
}
}  // namespace torchport

// Puts this guard in the registry's PrivateUse1 slot, over the Python one registered
// before, for `count` visible devices; returns 1.
extern "C" int torchport_guard_enable(int count) {
  device_count.store(static_cast<c10::DeviceIndex>(count > 0 ? count : 1));
  c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::PrivateUse1)]
      .store(&guard);
  return 1;
}

// The calling thread's current device (what PyTorch's C++ resolves "sim" to).
extern "C" int torchport_guard_get_device() { return current_index; }

// Makes `index` the calling thread's current device; the caller has validated it.
extern "C" void torchport_guard_set_device(int index) {
  current_index = static_cast<c10::DeviceIndex>(index);
}

// The id of the calling thread's current stream on device `index` (0: the default stream).
extern "C" long long torchport_guard_get_stream(int index) {
  return index >= 0 && index < kMaxDevices ? current_streams[index] : 0;
}

// Makes stream `id` the calling thread's current stream on device `index`.
extern "C" void torchport_guard_set_stream(int index, long long id) {
  if (index >= 0 && index < kMaxDevices) current_streams[index] = id;
}

// The stream layer's callback (nullptr: none, e.g. at exit; stream and event calls then fail
// and destroying an event does nothing).
extern "C" void torchport_guard_set_callback(Callback fn) { callback.store(fn); }

// No callback from now on: run when the interpreter has finished (Py_AtExit), after the
// last finaliser, before C++ destructors at process exit could call into a dead Python.
extern "C" void torchport_guard_detach() { callback.store(nullptr); }

// The message of the failure the callback is about to report (it then returns -1).
extern "C" void torchport_guard_fail(const char* message) { failure = message ? message : ""; }

// Marks the scalar types named (c10 names, comma-separated: "ComplexHalf,Float8_e5m2")
// unsupported in the capability torch.accelerator.get_device_capability reports.
extern "C" void torchport_guard_set_unsupported(const char* names) {
  std::string list = std::string(",") + (names ? names : "") + ",";
#define TORCHPORT_CLEAR(_1, n)                                      \
  if (list.find(std::string(",") + #n + ",") != std::string::npos) \
    capability.capability_data.supported_scalar_types.has_##n = 0;
  AT_FORALL_SCALAR_TYPES_WITH_COMPLEX_AND_QINTS(TORCHPORT_CLEAR)
#undef TORCHPORT_CLEAR
}

// A stream of device `index`'s pool (what PyTorch's C++ gets from getStreamFromGlobalPool):
// its id.
extern "C" long long torchport_guard_stream_from_pool(int index, int high_priority) {
  return guard
      .getStreamFromGlobalPool(c10::Device(c10::DeviceType::PrivateUse1, index), high_priority)
      .id();
}
