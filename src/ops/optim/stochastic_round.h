// Stochastic rounding of fp32 to bf16, shared by the CPU reference and the CUDA kernels
// (optim.master_weights = "bf16": the optimizers' bf16 masters). A value between two bf16
// neighbours rounds up (away from zero) with probability equal to the fraction of the way it
// lies to the far one, so the rounding is unbiased and small updates survive on average
// where round-to-nearest would drop them. The trick: add 16 uniform random bits to the fp32
// bit pattern and truncate; the carry into bit 16 happens with probability low16 / 65536.
// Bit patterns are monotone in magnitude within a sign, so this holds for negative values
// and subnormals too; exactly representable values (low 16 bits zero) never carry. A finite
// value above bf16's largest finite one may round to inf (its far neighbour), as in torch's
// and Gopher's form of the trick. NaN stays NaN (quieted), inf stays inf.
//
// The random bits are a counter-based hash of (stream, update, element): no state, the same
// bits on the CPU and the GPU, and a resumed run rounds as the uninterrupted one did.
#pragma once

#include "core/host_device.h"
#include "ops/optim/adamw_lowmem_math.h"

#include <cstdint>
#include <cstring>
#include <string_view>

namespace kiln::ops {

// SplitMix64's finalizer: a bijection of 64 bits whose output bits each depend on all input bits.
KILN_HOST_DEVICE inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// 16 uniform bits for element `index` of update `update` in stream `stream` (one per tensor).
KILN_HOST_DEVICE inline uint32_t rounding_bits(uint64_t stream, uint64_t update, uint64_t index) {
  const uint64_t h = mix64(mix64(stream ^ (update * 0x9e3779b97f4a7c15ull)) + index);
  return static_cast<uint32_t>(h >> 48);
}

KILN_HOST_DEVICE inline uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
#endif
}

// x rounded to bf16 (its bit pattern) with the 16 random bits `r` (< 65536).
KILN_HOST_DEVICE inline uint16_t stochastic_round_bf16(float x, uint32_t r) {
  const uint32_t bits = float_bits(x);
  if ((bits & 0x7f800000u) == 0x7f800000u)  // inf keeps its pattern; NaN stays NaN, quieted
    return static_cast<uint16_t>((bits >> 16) | ((bits & 0x007fffffu) != 0 ? 0x40u : 0u));
  return static_cast<uint16_t>((bits + (r & 0xffffu)) >> 16);
}

// A bf16 bit pattern widened exactly (the low-memory moments' widening).
KILN_HOST_DEVICE inline float bf16_bits_to_float(uint16_t h) { return adamw_lowmem::from_bf16(h); }

// The stream of one parameter: FNV-1a of its whole-model name (stable across runs, model
// edits elsewhere and ZeRO's slicing), mixed.
inline uint64_t rounding_stream(std::string_view parameter_name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : parameter_name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return mix64(h);
}

}  // namespace kiln::ops
