// The arithmetic of AdamW with bf16 or 8-bit moments (ops/optim/adamw_lowmem.h), one copy
// for the CPU reference (adamw_lowmem.cpp) and the CUDA kernels (adamw_lowmem_cuda.cu):
// every product, sum, quotient and square root rounded to fp32 on its own (explicit
// intrinsics on the device; the CPU file is compiled without contraction), so both give
// the same bits. It is the fp32 kernel's arithmetic (adamw_math.cuh) on moments read from
// and written back to their storage.
#pragma once

#include "core/host_device.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kiln::adamw_lowmem {

// Block-wise 8-bit moments: one fp32 absmax per this many elements (bitsandbytes uses 2048
// in its optimizers; 256 bounds the reach of an outlier to 256 neighbours and costs 1/64
// byte an element), and tensors smaller than kMinQuantizedNumel keep fp32 moments (as
// bitsandbytes does: norm gains and biases, whose moments are a rounding error of the
// memory and whose updates matter most per element).
inline constexpr int64_t kBlock = 256;
inline constexpr int64_t kMinQuantizedNumel = 4096;
inline constexpr int64_t blocks_of(int64_t n) { return (n + kBlock - 1) / kBlock; }

KILN_HOST_DEVICE inline float mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KILN_HOST_DEVICE inline float add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KILN_HOST_DEVICE inline float sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
KILN_HOST_DEVICE inline float div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
KILN_HOST_DEVICE inline float sqrt_rn(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
// 1 / sqrt(x) rounded once to fp32 (the host's double result differs from the correctly
// rounded one only when it lies within 2^-52 of a halfway point between two floats).
KILN_HOST_DEVICE inline float rsqrt_rn(float a) {
#ifdef __CUDA_ARCH__
  return __frsqrt_rn(a);
#else
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(a)));
#endif
}

// Per-tensor factors: decay = 1 - lr wd, step = lr / bc1, 1 / sqrt(bc2) (adamw_math.cuh).
struct Factors {
  float decay, step, inv_sqrt_bc2;
};
KILN_HOST_DEVICE inline Factors factors(float lr, float wd, float bc1, float bc2) {
  return {sub(1.0f, mul(lr, wd)), div(lr, bc1), rsqrt_rn(bc2)};
}

// m, v and p of one element, g already multiplied by the gradient scale.
KILN_HOST_DEVICE inline void update(float& p, float g, float& m, float& v, float b1, float b2, float eps,
                                    const Factors& f) {
  m = add(mul(b1, m), mul(sub(1.0f, b1), g));
  v = add(mul(b2, v), mul(mul(sub(1.0f, b2), g), g));
  const float denom = add(mul(sqrt_rn(v), f.inv_sqrt_bc2), eps);
  p = sub(mul(p, f.decay), div(mul(f.step, m), denom));
}

// bf16 moments: fp32 to bf16 rounded to nearest even (core/dtype.h's float_to_bf16, bit
// for bit). Nearest, not stochastic: a moment is an average the next steps keep blending
// (m_t = b1 m_(t-1) + ...), so its rounding errors are damped by b1 or b2 each step and do
// not accumulate the way a parameter's would when many small updates round away; nearest
// keeps the CPU and the GPU bitwise equal and needs no random numbers in a captured step.
KILN_HOST_DEVICE inline uint16_t to_bf16(float f) {
  uint32_t bits;
#ifdef __CUDA_ARCH__
  bits = __float_as_uint(f);
#else
  std::memcpy(&bits, &f, 4);
#endif
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
KILN_HOST_DEVICE inline float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// 8-bit moments: the value of `code` in a block whose absmax is `absmax`, and the code
// nearest to x / absmax in `map` (256 ascending values, ops/optim/dynamic_map.h; ties go
// to the lower code). absmax 0 (a block of zeros, or fresh state) stores code of 0 for m
// and v alike: x / 0 is never formed.
KILN_HOST_DEVICE inline float dequantize(const float* map, uint8_t code, float absmax) {
  return mul(map[code], absmax);
}
KILN_HOST_DEVICE inline uint8_t nearest_code(const float* map, float x) {
  int lo = 0;  // the largest code whose value is <= x (0 when x is below them all)
  for (int step = 128; step > 0; step >>= 1)
    if (map[lo + step] <= x) lo += step;
  if (lo < 255 && sub(map[lo + 1], x) < sub(x, map[lo])) ++lo;
  return static_cast<uint8_t>(lo);
}
KILN_HOST_DEVICE inline uint8_t quantize(const float* map, float x, float absmax) {
  return nearest_code(map, absmax > 0.0f ? div(x, absmax) : 0.0f);
}

}  // namespace kiln::adamw_lowmem
