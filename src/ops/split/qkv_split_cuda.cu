// The q|k|v split on the GPU (declared in qkv_split_cuda.h): fused [n, q_cols + 2 kv_cols]
// rows <-> q [n, q_cols], k and v [n, kv_cols], a bit-exact copy of fp32 or bf16 elements.
// One kernel templated on the element type: 16 bytes per thread (4 fp32 or 8 bf16) when
// both part widths are multiples of that and every pointer is 16-byte aligned (so no
// chunk straddles two parts), else one element.
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/bf16_vector.cuh"
#include "ops/grid_stride.cuh"
#include "ops/split/qkv_split_cuda.h"

#include <type_traits>

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T, int W>
__global__ void qkv_shuffle_kernel(T* fused, T* q, T* k, T* v, int64_t n, int64_t q_cols, int64_t kv_cols,
                                   bool to_parts) {
  using Chunk = std::conditional_t<W == 1, T, uint4>;
  static_assert(sizeof(Chunk) == W * sizeof(T));
  const int64_t cols = q_cols + 2 * kv_cols, chunks = cols / W;
  KILN_GRID_STRIDE(idx, n * chunks) {
    const int64_t i = idx / chunks, c = idx % chunks * W;
    T* part = c < q_cols ? q + i * q_cols + c
              : c < q_cols + kv_cols ? k + i * kv_cols + (c - q_cols)
                                     : v + i * kv_cols + (c - q_cols - kv_cols);
    Chunk* fused_chunk = reinterpret_cast<Chunk*>(fused + i * cols + c);
    Chunk* part_chunk = reinterpret_cast<Chunk*>(part);
    if (to_parts)
      *part_chunk = *fused_chunk;
    else
      *fused_chunk = *part_chunk;
  }
}

template <typename T>
void shuffle(cudaStream_t s, T* fused, T* q, T* k, T* v, int64_t n, int64_t q_cols, int64_t kv_cols, bool to_parts) {
  constexpr int W = 16 / sizeof(T);
  const int64_t items = n * (q_cols + 2 * kv_cols);
  if (items == 0) return;
  const bool wide = q_cols % W == 0 && kv_cols % W == 0 && vec::aligned16(fused) && vec::aligned16(q) &&
                    vec::aligned16(k) && vec::aligned16(v);
  if (wide)
    qkv_shuffle_kernel<T, W><<<blocks_for(items / W, kThreads), kThreads, 0, s>>>(fused, q, k, v, n, q_cols,
                                                                                        kv_cols, to_parts);
  else
    qkv_shuffle_kernel<T, 1><<<blocks_for(items, kThreads), kThreads, 0, s>>>(fused, q, k, v, n, q_cols,
                                                                                    kv_cols, to_parts);
  check_launch("qkv_split", "qkv_shuffle_kernel");
}

}  // namespace

void qkv_shuffle_f32(const ExecContext& ctx, float* fused, float* q, float* k, float* v, int64_t n, int64_t q_cols, int64_t kv_cols,
                     bool to_parts) {
  shuffle(stream(ctx), fused, q, k, v, n, q_cols, kv_cols, to_parts);
}

void qkv_shuffle_bf16(const ExecContext& ctx, bf16_bits* fused, bf16_bits* q, bf16_bits* k, bf16_bits* v, int64_t n, int64_t q_cols,
                      int64_t kv_cols, bool to_parts) {
  shuffle(stream(ctx), fused, q, k, v, n, q_cols, kv_cols, to_parts);
}

}  // namespace kiln::cuda
