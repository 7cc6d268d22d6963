// Host-side bf16 tensors for the GPU suites that drive ops through their front ends on the
// mixed path: bf16 copies of fp32 host tensors (round to nearest even, as the kernels'
// stores), and their values back as fp32 or f64 for comparisons and references.
#pragma once

#include "core/dtype.h"
#include "core/tensor.h"
#include "gpu/gpu_harness.h"
#include "grad_check.h"

#include <cstdint>

namespace kiln::gpu_test {

// A bf16 host tensor holding f32's values rounded to bf16.
inline OwnedTensor bf16_of(const Tensor& f32) {
  OwnedTensor out(DType::bf16, Device::cpu, f32.shape());
  uint16_t* bits = static_cast<uint16_t*>(out->raw());
  for (int64_t i = 0; i < f32.numel(); ++i) bits[i] = float_to_bf16(f32.data<float>()[i]);
  return out;
}

// The values of a bf16 host tensor, as f32 (exact).
inline OwnedTensor f32_of_bf16(const Tensor& bf16) {
  OwnedTensor out(DType::f32, Device::cpu, bf16.shape());
  const uint16_t* bits = static_cast<const uint16_t*>(bf16.raw());
  for (int64_t i = 0; i < bf16.numel(); ++i) out->data<float>()[i] = bf16_to_float(bits[i]);
  return out;
}

// f32 values rounded to bf16 and back, in place: inputs both sides then read identically.
inline void round_to_bf16(const Tensor& f32) {
  for (int64_t i = 0; i < f32.numel(); ++i) f32.data<float>()[i] = bf16_to_float(float_to_bf16(f32.data<float>()[i]));
}

// f32 values on the bf16 grid (N(0, scale), one outlier of 20 scale first), so the CPU
// reads what the GPU reads: the FP8 suites' inputs.
inline OwnedTensor bf16_values(Shape shape, uint64_t seed, double scale) {
  OwnedTensor t = to_f32(*test::random_f64(shape, seed, scale));
  t->data<float>()[0] = static_cast<float>(20 * scale);
  round_to_bf16(*t);
  return t;
}

// A device tensor of `dtype` holding f32's values (rounded when bf16), and its values back
// as f32 on the host.
inline OwnedTensor upload(const Tensor& f32, DType dtype) {
  return to_device(dtype == DType::bf16 ? *bf16_of(f32) : f32);
}
inline OwnedTensor download_f32(const Tensor& dev) {
  OwnedTensor host = to_host(dev);
  if (dev.dtype() == DType::bf16) return f32_of_bf16(*host);
  return host;
}

// A device tensor filled with NaNs: a kernel that leaves an element unwritten shows.
inline OwnedTensor poisoned(DType dtype, Shape shape) {
  OwnedTensor t(dtype, Device::cuda, shape);
  poison(*t);
  return t;
}

}  // namespace kiln::gpu_test
