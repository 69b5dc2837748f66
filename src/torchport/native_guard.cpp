// The device guard of PrivateUse1 without Python, with a real current device.
//
// PyTorch resolves a device name without an index ("sim" in torch.tensor, Tensor.to,
// torch.accelerator) by asking this guard for the current device, and the autograd engine
// and every device/stream guard ask it several times per op. PyTorch's Python-backend guard
// (torch/csrc/acc) enters Python from every method and answers device 0. This one keeps the
// current device per thread in C++ (torchport's set_device writes it through
// torchport_guard_set_device), validated against the visible device count; streams and
// events stay what the Python guard answers (the default stream, always complete): torchport's
// stream layer lives above the dispatcher.
// Built with native_views.cpp by torchport/native.py; enabled by torchport_guard_enable().
#include <atomic>

#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace {

thread_local c10::DeviceIndex current_index = 0;
std::atomic<c10::DeviceIndex> device_count{1};

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < device_count.load(),
                    "invalid device ordinal ", static_cast<int>(index), ": ",
                    static_cast<int>(device_count.load()),
                    " device(s) of this type are visible (TORCHPORT_VISIBLE_DEVICES)");
}

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
  c10::Stream getStream(c10::Device d) const noexcept override { return stream(d); }
  c10::Stream getNewStream(c10::Device d, int) const override { return stream(d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    return stream(s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count.load(); }
  void record(void**, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}

 private:
  c10::Stream stream(c10::Device d) const {
    return c10::Stream(c10::Stream::DEFAULT,
                       c10::Device(type(), d.index() < 0 ? current_index : d.index()));
  }
};

Guard guard;

}  // namespace

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
