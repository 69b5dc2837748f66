// The device guard of PrivateUse1 without Python. PyTorch's Python-backend guard
// (torch/csrc/acc) calls the Python method type_() from every one of its methods, and the
// autograd engine and every device/stream guard ask it several times per op: a Python
// entry each. This guard answers the same thing from C++ (one device, the default stream,
// events and streams that are always complete), so it changes no behaviour.
// Built with native_views.cpp by torchport/native.py; enabled by torchport_guard_enable().
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {

struct Guard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device) const override { return getDevice(); }
  c10::Device getDevice() const override { return c10::Device(type(), 0); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override { return stream(); }
  c10::Stream getNewStream(c10::Device, int) const override { return stream(); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override { return stream(); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}

 private:
  c10::Stream stream() const { return c10::Stream(c10::Stream::DEFAULT, getDevice()); }
};

Guard guard;

}  // namespace

// Puts this guard in the registry's PrivateUse1 slot, over the Python one registered
// before; returns 1.
extern "C" int torchport_guard_enable() {
  c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::PrivateUse1)]
      .store(&guard);
  return 1;
}
