// The CPU's choice of scaled_dot_product_attention's fused kernel, for a device whose kernels
// are the CPU's (the sim).
//
// PyTorch's scaled_dot_product_attention (a composite kernel) and MultiheadAttention's fast
// path ask `_fused_sdp_choice_stub` for the device type (aten/src/ATen/native/transformers/
// attention.cpp); where the stub has no PrivateUse1 entry they take the math path: a dozen
// ops, other rounding, several times the memory. A Python backend cannot fill a dispatch
// stub, so the sim answered from a Python kernel on the autograd key
// (backends/sim/attention.py), one Python call per attention. Filled here with the CPU's
// answer (its kernel of `_fused_sdp_choice`, which reads shapes, strides, dtypes and flags,
// never data), PyTorch's own code runs the CPU's fused flash kernel on the device
// (`_scaled_dot_product_flash_attention_for_cpu`, the device's host-op kernel), with its
// derivative, without a Python call. Switched by backends/sim/attention.py.
#include <ATen/core/Tensor.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>
#include <c10/core/DispatchKeySet.h>

#include <optional>

namespace {

// The stub's function, whatever arguments the torch built against gives it: the CPU's kernel
// of the op the stub stands for, which takes the same ones.
template <typename Fn>
struct CpuChoice;

template <typename R, typename... Args>
struct CpuChoice<R (*)(Args...)> {
  static R choose(Args... args) {
    return at::_ops::_fused_sdp_choice::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                   args...);
  }
};

}  // namespace

// Answer PrivateUse1's attention choice as the CPU (enable 1) or no more (0: the math path).
// Returns 1 when set, 0 when cleared.
extern "C" int torchport_attention_cpu_choice(int enable) {
  using Choice = CpuChoice<at::native::fused_sdp_choice_fn>;
  at::native::_fused_sdp_choice_stub.set_privateuse1_dispatch_ptr(enable ? &Choice::choose
                                                                          : nullptr);
  return enable ? 1 : 0;
}
