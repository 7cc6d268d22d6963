// Small vector helpers shared by the CPU attention kernels (packed and KV-cache), so both
// round the same way: decode logits must equal the full forward's.
#pragma once

#include <algorithm>
#include <cmath>
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

// Folds the scores of one key block (keys j0 .. j0 + count - 1) into the online softmax's
// running max m and sum l and the accumulator acc [d]: rescaled once when the block raises
// the max, then acc += p_j v_j, value_row(j) giving key j's V row.
template <typename T, typename ValueRow>
inline void fold_key_block(const T* scores, int64_t j0, int64_t count, T& m, T& l, T* acc, int64_t d,
                           ValueRow value_row) {
  T block_max = scores[0];
  for (int64_t j = 1; j < count; ++j) block_max = std::max(block_max, scores[j]);
  if (block_max > m) {  // rescale what was accumulated under the old maximum
    const T correction = std::exp(m - block_max);
    l *= correction;
    for (int64_t c = 0; c < d; ++c) acc[c] *= correction;
    m = block_max;
  }
  for (int64_t j = 0; j < count; ++j) {
    const T p = std::exp(scores[j] - m);
    l += p;
    axpy(p, value_row(j0 + j), acc, d);
  }
}

}  // namespace kiln::cpu
