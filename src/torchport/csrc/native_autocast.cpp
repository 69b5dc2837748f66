// CUDA's autocast policy for the AutocastPrivateUse1 dispatch key, in C++: PyTorch's own
// op lists (AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, ...: the ones its AutocastCUDA
// registration uses, from the headers of the torch this library is built against) and its
// own wrappers (at::autocast::WrapFunction, KERNEL_PRIVATEUSEONE), so that a call casts
// without a Python frame and casts of a weight are cached within an autocast region
// (at::autocast::cached_cast), as on CUDA. PyTorch registers none of this for PrivateUse1,
// not even the fallthrough for the other ops. torchport/device/amp/policy.py registers the
// same policy from Python where this library is missing.
#include <ATen/autocast_mode.h>
#include <c10/core/DispatchKey.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <memory>
#include <optional>

// The lists name ATen's types unqualified, as in at::autocast, where PyTorch expands them.
namespace at::autocast {
namespace {

// CUDA's message for binary_cross_entropy, which autocast refuses.
at::Tensor binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&,
                                       const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
              "autocast.\nMany models use a sigmoid layer right before the binary cross "
              "entropy layer.\nIn this case, combine the two layers using "
              "torch.nn.functional.binary_cross_entropy_with_logits\nor "
              "torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and "
              "BCEWithLogits are\nsafe to autocast.");
}

std::unique_ptr<torch::Library> kernels;
std::unique_ptr<torch::Library> fallthrough;

void register_policy(torch::Library& m) {
#define TORCHPORT_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(TORCHPORT_LOWER)
#undef TORCHPORT_LOWER
#define TORCHPORT_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(TORCHPORT_FP32)
#undef TORCHPORT_FP32
#define TORCHPORT_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(TORCHPORT_FP32_SET_OPT_DTYPE)
#undef TORCHPORT_FP32_SET_OPT_DTYPE
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
#define TORCHPORT_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(TORCHPORT_PROMOTE)
#undef TORCHPORT_PROMOTE
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"),
         TORCH_FN(binary_cross_entropy_banned));
}

}  // namespace
}  // namespace at::autocast

using at::autocast::fallthrough;
using at::autocast::kernels;
using at::autocast::register_policy;

// Registers the policy and, with `with_fallthrough` (none is registered yet), the fallthrough
// for every other op (once): 1; 0 with the reason in `error` (`size` bytes).
extern "C" int torchport_autocast_enable(int with_fallthrough, char* error, int size) {
  if (kernels) return 1;
  try {
    auto m = std::make_unique<torch::Library>(
        torch::Library::IMPL, "aten", std::make_optional(c10::DispatchKey::AutocastPrivateUse1),
        __FILE__, __LINE__);
    register_policy(*m);
    if (with_fallthrough) {
      auto rest = std::make_unique<torch::Library>(
          torch::Library::IMPL, "_", std::make_optional(c10::DispatchKey::AutocastPrivateUse1),
          __FILE__, __LINE__);
      rest->fallback(torch::CppFunction::makeFallthrough());
      fallthrough = std::move(rest);
    }
    kernels = std::move(m);
  } catch (const std::exception& e) {
    std::snprintf(error, static_cast<size_t>(size), "%s", e.what());
    return 0;
  }
  return 1;
}
