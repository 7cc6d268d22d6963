// The operand checks the FP8 linear layers share (fp8_linear.cpp, fp8_blockwise_linear.cpp):
// one-line errors naming the op and the operand.
#pragma once

#include "core/error.h"
#include "core/tensor.h"

#include <cstdint>

namespace kiln::ops::fp8 {

// t is `dtype` [N, cols] on `device`.
inline void expect_rows(const char* op, const char* what, const Tensor& t, int64_t cols, DType dtype, Device device) {
  KILN_CHECK(t.device() == device && t.dtype() == dtype && t.rank() == 2 && t.size(1) == cols, op,
             "{} must be {} [N, {}] on the {}, got {}", what, dtype_name(dtype), cols, device_name(device),
             t.describe());
}

// What an FP8 layer computes in on a device: f32 on the CPU (the emulation), bf16 on the GPU.
inline DType fp8_layer_dtype(Device device) { return device == Device::cpu ? DType::f32 : DType::bf16; }

}  // namespace kiln::ops::fp8
