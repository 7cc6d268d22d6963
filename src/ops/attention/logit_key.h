// A float logit as an unsigned key whose integer order is the floats' order, so a running
// maximum is one atomicMax on the GPU, and a zero-filled buffer (as arenas allocate) means
// "no logit yet": every non-NaN float's key is at least key(-inf) = 0x007fffff > 0.
#pragma once

#include <bit>
#include <cstdint>
#include <limits>

#ifdef __CUDACC__
#define KILN_LOGIT_KEY_FN __host__ __device__ inline
#else
#define KILN_LOGIT_KEY_FN inline
#endif

namespace kiln::ops {

// Negative floats: every bit flipped (larger magnitude, smaller key); others: the sign bit set.
KILN_LOGIT_KEY_FN uint32_t logit_key_of_bits(uint32_t bits) {
  return (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
}
KILN_LOGIT_KEY_FN uint32_t logit_bits_of_key(uint32_t key) {
  return (key & 0x80000000u) != 0 ? (key & 0x7fffffffu) : ~key;
}

#ifndef __CUDACC__
inline uint32_t logit_key(float logit) { return logit_key_of_bits(std::bit_cast<uint32_t>(logit)); }
// -inf for the empty key 0.
inline float logit_of_key(uint32_t key) {
  return key == 0 ? -std::numeric_limits<float>::infinity() : std::bit_cast<float>(logit_bits_of_key(key));
}
#endif

}  // namespace kiln::ops
