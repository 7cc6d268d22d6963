#include "ops/cross_entropy/lm_head_loss.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/cross_entropy/cross_entropy_cuda.h"
#include "ops/elementwise/elementwise_cuda.h"
#include "ops/linear/linear_cuda.h"
#include "ops/linear/linear.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kiln::ops {

namespace {

// Loss terms of one row of logits, and (if grad) the row replaced by d(objective)/dlogits.
// e [vocab] is scratch: each exp(l_j - max) is taken once, for the sum and then for p_j.
template <typename T>
void row_loss(T* row, int64_t vocab, int32_t target, const LmHeadLossOptions& o, bool grad, double* loss, double* z,
              double* e) {
  if (o.softcap > 0)
    for (int64_t j = 0; j < vocab; ++j) row[j] = static_cast<T>(o.softcap) * std::tanh(row[j] / static_cast<T>(o.softcap));
  T m = row[0];
  for (int64_t j = 1; j < vocab; ++j) m = std::max(m, row[j]);
  const double md = static_cast<double>(m);
  double sum = 0;
  for (int64_t j = 0; j < vocab; ++j) {
    e[j] = std::exp(static_cast<double>(row[j]) - md);
    sum += e[j];
  }
  const double lse = md + std::log(sum);
  *loss = lse - static_cast<double>(row[target]);
  *z = lse * lse;
  if (!grad) return;
  // d/dlogit_j of (lse - l_t + zc * lse^2) = p_j (1 + 2 zc lse) - [j == t].
  const double zfactor = 1.0 + 2.0 * o.z_loss * lse;
  for (int64_t j = 0; j < vocab; ++j) {
    const double p = e[j] / sum;  // exp(l_j - lse)
    double g = p * zfactor - (j == target ? 1.0 : 0.0);
    if (o.softcap > 0) {
      const double t = static_cast<double>(row[j]) / o.softcap;  // row holds capped logits
      g *= 1.0 - t * t;
    }
    row[j] = static_cast<T>(g * o.loss_scale * o.weight);
  }
}

#if KILN_WITH_CUDA
// The GPU's scale of a weighted head's gradient: fp32 (1 / targets) times the fp32 weight,
// rounded twice as the kernels round the step's scale in device memory times the weight
// (cuda::LossScale::get), so that the op-by-op step and the captured one scale a head
// whose weight is not 1 (multi-token prediction's) to the same bits. One rounding of the
// double product differs from that by an ulp for some target counts (1840 of 2048, with
// weight 0.1), which made the two steps' gradient norms differ.
cuda::LossScale gpu_loss_scale(const LmHeadLossOptions& o) {
  const auto weight = static_cast<float>(o.weight);
  return cuda::LossScale(static_cast<float>(o.loss_scale) * weight, o.loss_scale_on_device, weight);
}

// The same chunk loop on the GPU: cuBLAS products, the row kernel in place, and the sums
// kept on the device until the end (one synchronization per call). The chunk's rows are
// ld = lm_head_logits_cols(vocab) apart; the products and the row kernel cover the first
// vocab columns only, so the padding is neither read nor needs a value.
LossSums lm_head_loss_cuda(const ExecContext& ctx, const Tensor& h, const Tensor& w, const Tensor& targets, const LmHeadLossOptions& o,
                           const LmHeadScratch& scratch, const Tensor& dh, const Tensor& dw) {
  const int64_t n = h.size(0), d = h.size(1), vocab = w.size(0), ld = scratch.logits.size(1);
  const bool grad = dh.defined() || dw.defined();
  float* lc = scratch.logits.data<float>();
  double* const sums_on_device = o.sums_on_device;  // null: the op's own, read at the end
  if (sums_on_device == nullptr) cuda::loss_sums_reset(ctx, nullptr);
  const cuda::LossScale scale = gpu_loss_scale(o);
  for (int64_t begin = 0; begin < n; begin += o.chunk_rows) {
    const int64_t rows = std::min(o.chunk_rows, n - begin);
    const float* hc = h.data<float>() + begin * d;
    cuda::gemm_f32(ctx, false, true, rows, vocab, d, 1.0f, hc, d, w.data<float>(), d, 0.0f, lc, ld);
    cuda::cross_entropy_rows_f32(ctx, lc, ld, targets.data<int32_t>() + begin, rows, vocab, static_cast<float>(o.z_loss),
                                 scale, static_cast<float>(o.softcap), grad,
                                 scratch.row_stats.data<double>());
    cuda::loss_sums_accumulate(ctx, sums_on_device, scratch.row_stats.data<double>(), targets.data<int32_t>() + begin,
                               rows);
    if (dh.defined())
      cuda::gemm_f32(ctx, false, false, rows, d, vocab, 1.0f, lc, ld, w.data<float>(), d, 0.0f, dh.data<float>() + begin * d, d);
    if (dw.defined()) cuda::gemm_f32(ctx, true, false, vocab, d, rows, 1.0f, lc, ld, hc, d, 1.0f, dw.data<float>(), d);
  }
  LossSums sums;
  if (sums_on_device == nullptr) cuda::loss_sums_read(ctx, nullptr, &sums.loss, &sums.z, &sums.count);
  return sums;
}

// The mixed path: bf16 h and w, bf16 logits from the product (as under autocast; the row
// kernel computes in fp32), replaced in place by the bf16 logit gradient the two backward
// products read; dh bf16, dw fp32 (+=).
LossSums lm_head_loss_mixed(const ExecContext& ctx, const Tensor& h, const Tensor& w, const Tensor& targets, const LmHeadLossOptions& o,
                            const LmHeadScratch& scratch, const Tensor& dh, const Tensor& dw) {
  const int64_t n = h.size(0), d = h.size(1), vocab = w.size(0), ld = scratch.logits.size(1);
  const bool grad = dh.defined() || dw.defined();
  uint16_t* lc = bf16_data(scratch.logits);
  const uint16_t* hp = bf16_data(h);
  const uint16_t* wp = bf16_data(w);
  // The forward and dh products' vocabulary extent and weight: the padded copy where planned.
  int64_t cols = vocab;
  const uint16_t* wcols = wp;
  if (scratch.padded_weight.defined()) {
    uint16_t* padded = bf16_data(scratch.padded_weight);
    cuda::copy_bytes(ctx, wp, static_cast<size_t>(vocab * d) * 2, padded);
    cuda::zero_bytes(ctx, padded + vocab * d, static_cast<size_t>((ld - vocab) * d) * 2);
    cols = ld;
    wcols = padded;
  }
  double* const sums_on_device = o.sums_on_device;  // null: the op's own, read at the end
  if (sums_on_device == nullptr) cuda::loss_sums_reset(ctx, nullptr);
  const cuda::LossScale scale = gpu_loss_scale(o);
  for (int64_t begin = 0; begin < n; begin += o.chunk_rows) {
    const int64_t rows = std::min(o.chunk_rows, n - begin);
    const uint16_t* hc = hp + begin * d;
    cuda::gemm(ctx, false, true, rows, cols, d, 1.0f, hc, d, wcols, d, DType::bf16, 0.0f, lc, ld, DType::bf16);
    cuda::cross_entropy_rows_bf16(ctx, lc, ld, targets.data<int32_t>() + begin, rows, vocab, static_cast<float>(o.z_loss),
                                  scale, static_cast<float>(o.softcap), grad,
                                  scratch.row_stats.data<double>());
    cuda::loss_sums_accumulate(ctx, sums_on_device, scratch.row_stats.data<double>(), targets.data<int32_t>() + begin,
                               rows);
    if (dh.defined())
      cuda::gemm(ctx, false, false, rows, d, cols, 1.0f, lc, ld, wcols, d, DType::bf16, 0.0f, bf16_data(dh) + begin * d,
                 d, DType::bf16);
    if (dw.defined())
      cuda::gemm(ctx, true, false, vocab, d, rows, 1.0f, lc, ld, hc, d, DType::bf16, 1.0f, dw.data<float>(), d,
                 DType::f32);
  }
  LossSums sums;
  if (sums_on_device == nullptr) cuda::loss_sums_read(ctx, nullptr, &sums.loss, &sums.z, &sums.count);
  return sums;
}
#endif

}  // namespace

LossSums lm_head_loss(const ExecContext& ctx, const Tensor& h, const Tensor& w, const Tensor& targets, const LmHeadLossOptions& o,
                      const LmHeadScratch& scratch, const Tensor& dh, const Tensor& dw) {
  const char* op = "lm_head_loss";
  KILN_OP_SCOPE(op, h);
  expect_rank(op, "h", h, 2);
  expect_rank(op, "w", w, 2);
  expect_same(op, "w", w, h);
  KILN_CHECK(h.size(1) == w.size(1), op, "h {} and w {} disagree on hidden size", h.describe(), w.describe());
  expect_shape(op, "targets", targets, Shape{h.size(0)});
  expect_dtype(op, "targets", targets, DType::i32);
  KILN_CHECK(o.chunk_rows > 0, op, "chunk_rows must be positive");
  KILN_CHECK(h.device() == Device::cuda || (o.loss_scale_on_device == nullptr && o.sums_on_device == nullptr), op,
             "a loss scale or loss sums in device memory need GPU tensors");
  // Mixed path (bf16 h on the GPU): bf16 logits (in place to their gradient), fp32 dw.
  const bool mixed = is_mixed(h);
  const DType wide = mixed ? DType::f32 : h.dtype();
  const Tensor& logits = scratch.logits;
  expect_tensor(op, "logits", logits, Shape{o.chunk_rows, lm_head_logits_cols(w.size(0))}, h.dtype(), h.device());
  expect_shape(op, "row_stats", scratch.row_stats, Shape{o.chunk_rows, 2});
  expect_dtype(op, "row_stats", scratch.row_stats, DType::f64);
  if (scratch.padded_weight.defined())
    expect_tensor(op, "padded_weight", scratch.padded_weight, Shape{logits.size(1), w.size(1)}, w.dtype(), w.device());
  if (dh.defined()) expect_tensor(op, "dh", dh, h.shape(), h.dtype(), h.device());
  if (dw.defined()) expect_tensor(op, "dw", dw, w.shape(), wide, h.device());
  if (h.device() == Device::cuda) {
#if KILN_WITH_CUDA
    if (mixed) return lm_head_loss_mixed(ctx, h, w, targets, o, scratch, dh, dw);
    expect_dtype(op, "h", h, DType::f32);
    return lm_head_loss_cuda(ctx, h, w, targets, o, scratch, dh, dw);
#else
    no_cuda_kernel(op);
#endif
  }

  const int64_t n = h.size(0), d = h.size(1), vocab = w.size(0), ld = logits.size(1);
  const int32_t* tgt = targets.data<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    KILN_CHECK(tgt[i] == -1 || (tgt[i] >= 0 && tgt[i] < vocab), op, "target {} at row {} is outside [0, {})",
               tgt[i], i, vocab);
  const bool grad = dh.defined() || dw.defined();
  LossSums sums;
  dispatch_cpu_float(op, h.dtype(), [&](auto zero) {
    using T = decltype(zero);
    for (int64_t begin = 0; begin < n; begin += o.chunk_rows) {
      const int64_t rows = std::min(o.chunk_rows, n - begin);
      const T* hc = h.data<T>() + begin * d;
      T* lc = logits.data<T>();
      cpu_gemm<T>(false, true, rows, vocab, d, T(1), hc, d, w.data<T>(), d, T(0), lc, ld);
      double* stats = scratch.row_stats.data<double>();
#pragma omp parallel
      {
        std::vector<double> e(static_cast<size_t>(vocab));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
          T* row = lc + r * ld;  // its first vocab columns: the padding is never read
          const int32_t t = tgt[begin + r];
          if (t < 0) {
            if (grad) std::fill(row, row + vocab, T(0));
            continue;
          }
          row_loss(row, vocab, t, o, grad, &stats[2 * r], &stats[2 * r + 1], e.data());
        }
      }
      for (int64_t r = 0; r < rows; ++r) {  // fixed order: reproducible sums
        if (tgt[begin + r] < 0) continue;
        sums.loss += stats[2 * r];
        sums.z += stats[2 * r + 1];
        ++sums.count;
      }
      if (dh.defined())  // dh [rows, d] = dlogits [rows, V] @ w [V, d]
        cpu_gemm<T>(false, false, rows, d, vocab, T(1), lc, ld, w.data<T>(), d, T(0), dh.data<T>() + begin * d, d);
      if (dw.defined())  // dw [V, d] += dlogits^T @ h
        cpu_gemm<T>(true, false, vocab, d, rows, T(1), lc, ld, hc, d, T(1), dw.data<T>(), d);
    }
  });
  return sums;
}

void lm_head_logits(const ExecContext& ctx, const Tensor& h, const Tensor& w, double softcap, const Tensor& logits) {
  const char* op = "lm_head_logits";
  KILN_OP_SCOPE(op, h);
  expect_rank(op, "h", h, 2);
  expect_same(op, "w", w, h);
  expect_shape(op, "logits", logits, Shape{h.size(0), w.size(0)});
  if (is_mixed(h)) {  // bf16 operands, bf16 or fp32 logits (a softcap needs fp32)
    KILN_CHECK(logits.dtype() == DType::f32 || (logits.dtype() == DType::bf16 && softcap == 0), op,
               "logits must be f32, or bf16 without a softcap, got {}", logits.describe());
  } else {
    expect_same(op, "logits", logits, h);
  }
  KILN_ON_CUDA(h, op, {
    cuda::gemm(ctx, false, true, h.size(0), w.size(0), h.size(1), 1.0f, h.raw(), h.size(1), w.raw(), h.size(1), h.dtype(),
               0.0f, logits.raw(), w.size(0), logits.dtype());
    if (softcap > 0) cuda::softcap_f32(ctx, logits.data<float>(), logits.numel(), static_cast<float>(softcap));
  });
  dispatch_cpu_float(op, h.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t m = h.size(0), d = h.size(1), vocab = w.size(0);
    T* out = logits.data<T>();
    cpu_gemm<T>(false, true, m, vocab, d, T(1), h.data<T>(), d, w.data<T>(), d, T(0), out, vocab);
    if (softcap > 0)
      for (int64_t i = 0; i < m * vocab; ++i) out[i] = static_cast<T>(softcap) * std::tanh(out[i] / static_cast<T>(softcap));
  });
}

}  // namespace kiln::ops
