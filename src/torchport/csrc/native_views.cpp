// PyTorch's own C++ kernels of the view ops without a composite kernel, registered for
// PrivateUse1: a view only makes a tensor header over the same storage, which ATen's
// CPU kernels do for any device. (The composite views -- select, permute, expand,
// t, ... -- are CompositeExplicitAutograd and reach these through as_strided/view.)
// Built and switched by torchport/ops/native_views.py; no static registration, so that
// loading the library changes nothing until torchport_native_views_enable().
#include <ATen/ATen.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include <memory>

static std::unique_ptr<torch::Library> registered;

// Registers the kernels (once); returns how many ops they cover.
extern "C" int torchport_native_views_enable() {
  if (!registered) {
    auto lib = std::make_unique<torch::Library>(
        torch::Library::IMPL, "aten", std::make_optional(c10::DispatchKey::PrivateUse1),
        __FILE__, __LINE__);
    lib->impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
    lib->impl("view", TORCH_FN(at::native::view));
    lib->impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
    lib->impl("unfold", TORCH_FN(at::native::unfold));
    lib->impl("view_as_real", TORCH_FN(at::native::view_as_real));
    lib->impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
    registered = std::move(lib);
  }
  return 6;
}

// Removes them again (the dispatcher then finds the Python kernels or the fallback).
extern "C" void torchport_native_views_disable() { registered.reset(); }
