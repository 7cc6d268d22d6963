// Cross-entropy rows of the mixed-precision path (declared in ops/cross_entropy/cross_entropy_cuda.h):
// fp32 or bf16 logits in, bf16 logit gradient out (for bf16 logits, in place). Formulas
// (softcap, z-loss, ignored targets, row_stats) are those of cross_entropy_cuda.cu.
//
// One 512-thread block per row. The logits are read twice, no more: a first pass keeps a
// running (max, sum of exp) per thread (online softmax: when the max grows the sum is
// rescaled), the pairs are combined in a fixed tree order into logsumexp; a second pass
// recomputes the softcapped logit and writes the gradient. Rows whose stride is a
// multiple of 8 with 16-byte aligned pointers move 8 logits per thread per access (two
// float4 in, one 16-byte bf16 store out), whatever the vocabulary: the last vector's
// columns past it (the row's padding) count as -inf in the sums and get a zero gradient.
// Others take the scalar path. Offsets are int64, so a chunk may hold more than 2^31
// logits.
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/cross_entropy/cross_entropy_cuda.h"

#include "ops/bf16_vector.cuh"
#include "ops/block_reduce.cuh"

#include <cuda_bf16.h>

#include <climits>
#include <cstdint>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr const char* kOp = "lm_head_loss";
constexpr int kThreads = 512;
constexpr int kVec = vec::kWidth;

using vec::aligned16;

using vec::load;
using vec::store;
using vec::to_f32;

// In is float or bf16; with bf16, grad_out may be the logits themselves (each element is
// read by the thread that later overwrites it, and the target logit is read before the
// block's first barrier), so no __restrict__ on those two.
template <typename In, int W>
__global__ void __launch_bounds__(kThreads)
    rows_kernel(const In* logits, int64_t stride, const int32_t* __restrict__ targets, int64_t vocab, float z_loss,
                LossScale scale, float cap, bool grad, double* __restrict__ stats, bf16* grad_out) {
  const int64_t row = blockIdx.x;
  const In* x = logits + row * stride;
  bf16* g_row = grad ? grad_out + row * stride : nullptr;
  const int64_t vecs = (vocab + W - 1) / W;  // the last may reach into the padding (W = 8)
  const int32_t target = targets[row];
  if (target < 0) {  // the whole block returns together
    if (grad) {
      float zero[W] = {};
      for (int64_t i = threadIdx.x; i < vecs; i += kThreads) store<W>(g_row + i * W, zero);
    }
    if (threadIdx.x == 0) stats[2 * row] = stats[2 * row + 1] = 0;
    return;
  }

  float target_logit = to_f32(x[target]);  // before any thread can overwrite it
  if (cap > 0) target_logit = cap * tanhf(target_logit / cap);
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t i = threadIdx.x; i < vecs; i += kThreads) {
    float v[W];
    load<W>(x + i * W, v);
    float m = acc.max;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      if (cap > 0) v[k] = cap * tanhf(v[k] / cap);
      if (i * W + k >= vocab) v[k] = -INFINITY;  // padding (any bits, even NaN): no weight
      m = fmaxf(m, v[k]);
    }
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < W; ++k) sum += __expf(v[k] - m);
    acc = {m, acc.sum * __expf(acc.max - m) + sum};  // acc.max = -inf: exp gives 0, sum was 0
  }
  const MaxSum row_total = block_max_sum<kThreads>(acc);
  const float lse = row_total.max + logf(row_total.sum);
  if (threadIdx.x == 0) {
    stats[2 * row] = static_cast<double>(lse) - target_logit;
    stats[2 * row + 1] = static_cast<double>(lse) * lse;
  }
  if (!grad) return;

  const float zfactor = 1.0f + 2.0f * z_loss * lse;
  const float loss_scale = scale.get();
  for (int64_t i = threadIdx.x; i < vecs; i += kThreads) {
    float v[W];
    load<W>(x + i * W, v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float xc = cap > 0 ? cap * tanhf(v[k] / cap) : v[k];
      float g = __expf(xc - lse) * zfactor - (i * W + k == target ? 1.0f : 0.0f);
      if (cap > 0) {
        const float t = xc / cap;
        g *= 1.0f - t * t;
      }
      v[k] = i * W + k < vocab ? g * loss_scale : 0.0f;
    }
    store<W>(g_row + i * W, v);
  }
}

template <typename In>
void launch_rows(cudaStream_t stream, const In* logits, int64_t stride, const int32_t* targets, int64_t rows, int64_t vocab,
                 float z_loss, LossScale loss_scale, float softcap, bool grad, double* row_stats, bf16* g) {
  if (rows == 0) return;
  KILN_CHECK(rows <= INT_MAX, kOp, "{} rows exceed the grid limit", rows);
  KILN_CHECK(stride >= vocab, kOp, "row stride {} is below the vocabulary {}", stride, vocab);
  const bool vec = stride % kVec == 0 && aligned16(logits) && (!grad || aligned16(g));
  if (vec)
    rows_kernel<In, kVec><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        logits, stride, targets, vocab, z_loss, loss_scale, softcap, grad, row_stats, g);
  else
    rows_kernel<In, 1><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        logits, stride, targets, vocab, z_loss, loss_scale, softcap, grad, row_stats, g);
  check_launch(kOp, "rows_kernel");
}

}  // namespace

void cross_entropy_rows_to_bf16(const ExecContext& ctx, const float* logits, int64_t stride, const int32_t* targets,
                                int64_t rows, int64_t vocab, float z_loss, LossScale loss_scale, float softcap, bool grad,
                                double* row_stats, bf16_bits* grad_out) {
  launch_rows(stream(ctx), logits, stride, targets, rows, vocab, z_loss, loss_scale, softcap, grad, row_stats,
              reinterpret_cast<bf16*>(grad_out));
}

void cross_entropy_rows_bf16(const ExecContext& ctx, bf16_bits* logits, int64_t stride, const int32_t* targets, int64_t rows,
                             int64_t vocab, float z_loss, LossScale loss_scale, float softcap, bool grad, double* row_stats) {
  bf16* x = reinterpret_cast<bf16*>(logits);
  launch_rows<bf16>(stream(ctx), x, stride, targets, rows, vocab, z_loss, loss_scale, softcap, grad, row_stats, grad ? x : nullptr);
}

}  // namespace kiln::cuda
