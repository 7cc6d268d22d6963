// Which device and compute precision a command runs on, from its settings ("auto", "cpu",
// "cuda"; "auto", "fp32", "bf16"). Shared by training and the inference commands (sample,
// serve, eval, bench-decode), which therefore need nothing of the trainer.
#pragma once

#include "core/dtype.h"

#include <string>

namespace kiln {

// train.device: "auto" picks CUDA only where the CUDA path exists and a GPU is visible;
// "cuda" without one is an error naming the key.
Device resolve_device(const std::string& setting);
// train.precision on that device: the compute dtype (bf16 mixed on the GPU under "auto").
DType resolve_precision(const std::string& setting, Device device);

}  // namespace kiln
