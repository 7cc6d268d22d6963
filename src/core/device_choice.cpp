#include "core/device_choice.h"

#include "core/device_memory.h"
#include "core/error.h"

namespace kiln {

Device resolve_device(const std::string& setting) {
  const bool gpu = cuda_available();
  if (setting == "cuda") {
    KILN_CHECK(gpu, "train.device", "cuda requested, but {}",
               KILN_WITH_CUDA ? "no CUDA device is visible" : "this kiln was built without the CUDA backend");
    return Device::cuda;
  }
  return setting == "auto" && gpu ? Device::cuda : Device::cpu;
}

DType resolve_precision(const std::string& setting, Device device) {
  if (setting == "fp32") return DType::f32;
  KILN_CHECK(setting != "bf16" || device == Device::cuda, "train.precision",
             "bf16 runs on the GPU only (this run uses the CPU); use fp32 or auto");
  return device == Device::cuda ? DType::bf16 : DType::f32;
}

}  // namespace kiln
