// Small vector helpers shared by the CPU attention kernels (packed and KV-cache), so both
// round the same way: decode logits must equal the full forward's.
#pragma once

#include <cstdint>

namespace kiln::cpu {

// Keys are visited in blocks: scores of a block sit in a small stack array, so the
// online softmax rescales once per block instead of once per key.
constexpr int64_t kKeyBlock = 64;

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

template <typename T>
inline void axpy(T alpha, const T* x, T* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace kiln::cpu
