// Backend metadata of device tensors, kept through torch.save/torch.load.
//
// torch._utils.get_tensor_metadata / set_tensor_metadata and serialization (which saves
// that dict with each tensor and gives it back on load) ask a registered pair of functions
// of the device type for the backend's own entries; without a pair both are silent no-ops.
// This pair keeps every entry other than PyTorch's own ("conj", "neg") in a BackendMeta of
// the tensor, so that a vendor's per-tensor flags (a layout, a format) travel with the
// tensor through a checkpoint as they do on other accelerators. Views and copies made by
// PyTorch do not carry it (a BackendMeta belongs to one TensorImpl).
// Built with the other csrc/*.cpp by torchport/core/native.py; enabled by
// torchport_metadata_enable().
#include <map>
#include <string>
#include <unordered_map>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/jit/serialization/pickler_helper.h>

namespace {

struct Flags final : public c10::BackendMeta {
  std::map<std::string, bool> entries;
  c10::intrusive_ptr<c10::BackendMeta> clone(
      const c10::intrusive_ptr<c10::BackendMeta>&) const override {
    auto copy = c10::make_intrusive<Flags>();
    copy->entries = entries;
    return copy;
  }
};

bool pytorch_own(const std::string& key) { return key == "conj" || key == "neg"; }

void save(const at::Tensor& t, std::unordered_map<std::string, bool>& metadata) {
  auto* flags = dynamic_cast<Flags*>(t.unsafeGetTensorImpl()->get_backend_meta());
  if (flags == nullptr) return;
  for (const auto& [key, value] : flags->entries) metadata[key] = value;
}

void restore(const at::Tensor& t, std::unordered_map<std::string, bool>& metadata) {
  auto flags = c10::make_intrusive<Flags>();
  for (const auto& [key, value] : metadata)
    if (!pytorch_own(key)) flags->entries[key] = value;
  if (flags->entries.empty()) return;
  t.unsafeGetTensorImpl()->set_backend_meta(flags);
}

}  // namespace

// Registers the pair for PrivateUse1: 1, or 0 where a pair is registered already.
extern "C" int torchport_metadata_enable() {
  int type = static_cast<int>(c10::DeviceType::PrivateUse1);
  if (torch::jit::GetBackendMetaSerialization()[type].has_value()) return 0;
  torch::jit::TensorBackendMetaRegistry(c10::DeviceType::PrivateUse1, &save, &restore);
  return 1;
}
