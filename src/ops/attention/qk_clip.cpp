// QK-Clip's factors and row scaling (ops/attention/qk_clip.h): the front end and the CPU
// reference; the kernels are qk_clip_cuda.h. Factors are formed in fp32 on both devices
// (tau / max, then sqrtf: both correctly rounded), so they agree to the bit.
#include "ops/attention/qk_clip.h"

#include "core/op_profiler.h"
#include "ops/attention/logit_key.h"
#include "ops/attention/qk_clip_cuda.h"
#include "ops/common.h"
#include "ops/optim/adamw_lowmem_math.h"

#include <algorithm>
#include <cmath>

namespace kiln::ops {

namespace {

// gamma = tau / max where the head's largest logit exceeded tau, else 1 (no logit yet: 1).
float clip_gamma(uint32_t key, float tau) {
  const float max = logit_of_key(key);
  return max > tau ? tau / max : 1.0f;
}

}  // namespace

void qk_clip_factors(const ExecContext& ctx, const Tensor& max_logit_keys, double tau, QkClipSharing sharing, const Tensor& q_factors,
                     const Tensor& k_factors) {
  const char* op = "qk_clip_factors";
  KILN_OP_SCOPE(op, max_logit_keys);
  expect_rank(op, "max_logit_keys", max_logit_keys, 1);
  expect_dtype(op, "max_logit_keys", max_logit_keys, DType::i32);
  KILN_CHECK(tau > 0, op, "tau must be > 0, got {}", tau);
  const int64_t hq = max_logit_keys.size(0);
  const bool shared = sharing == QkClipSharing::shared_gains;
  expect_tensor(op, "q_factors", q_factors, Shape{shared ? 1 : hq}, DType::f32, max_logit_keys.device());
  expect_rank(op, "k_factors", k_factors, 1);
  const int64_t hkv = shared ? 0 : k_factors.size(0);
  expect_tensor(op, "k_factors", k_factors, Shape{shared ? 1 : hkv}, DType::f32, max_logit_keys.device());
  KILN_CHECK(shared || (hkv > 0 && hq % hkv == 0), op, "query heads {} must be a multiple of key heads {}", hq, hkv);
  KILN_CHECK(sharing != QkClipSharing::per_head || hkv == hq, op, "per-head clipping needs as many key heads ({}) as "
             "query heads ({})", hkv, hq);
  const auto* keys = static_cast<const uint32_t*>(max_logit_keys.raw());
  const auto tau_f = static_cast<float>(tau);
  KILN_ON_CUDA(max_logit_keys, op,
               cuda::qk_clip_factors(ctx, keys, hq, hkv, tau_f, static_cast<int>(sharing), q_factors.data<float>(),
                                     k_factors.data<float>()));
  float* qf = q_factors.data<float>();
  float* kf = k_factors.data<float>();
  switch (sharing) {
    case QkClipSharing::per_head:
      for (int64_t h = 0; h < hq; ++h) qf[h] = kf[h] = std::sqrt(clip_gamma(keys[h], tau_f));
      return;
    case QkClipSharing::shared_keys:
      for (int64_t h = 0; h < hq; ++h) qf[h] = clip_gamma(keys[h], tau_f);
      std::fill(kf, kf + hkv, 1.0f);
      return;
    case QkClipSharing::shared_gains: {
      float least = 1.0f;
      for (int64_t h = 0; h < hq; ++h) least = std::min(least, clip_gamma(keys[h], tau_f));
      qf[0] = kf[0] = std::sqrt(least);
      return;
    }
  }
}

void scale_head_rows(const ExecContext& ctx, const Tensor& weight, const Tensor& factors, int64_t head_dim, bool gain_offset) {
  const char* op = "scale_head_rows";
  KILN_OP_SCOPE(op, weight);
  KILN_CHECK(weight.defined() && (weight.rank() == 1 || weight.rank() == 2), op, "weight must be 1-D or 2-D, got {}",
             weight.describe());
  KILN_CHECK(head_dim > 0 && weight.size(0) % head_dim == 0, op, "{} rows are not whole heads of {}",
             weight.size(0), head_dim);
  const int64_t heads = weight.size(0) / head_dim, rows = weight.size(0);
  const int64_t cols = weight.rank() == 2 ? weight.size(1) : 1;
  expect_rank(op, "factors", factors, 1);
  KILN_CHECK(factors.size(0) == heads || factors.size(0) == 1, op, "factors must hold 1 or {} values, got {}", heads,
             factors.describe());
  expect_tensor(op, "factors", factors, factors.shape(), DType::f32, weight.device());
  const bool single = factors.size(0) == 1;
  if (weight.dtype() == DType::bf16) {  // a bf16 master (optim.master_weights): 2-D projections only
    // Rounded to nearest, not stochastically: a rare one-off contraction of a head's rows,
    // not one of many small steps whose rounding errors would add up.
    KILN_CHECK(!gain_offset, op, "a bf16 weight cannot hold an offset gain");
    auto* w = static_cast<uint16_t*>(weight.raw());
    KILN_ON_CUDA(weight, op, cuda::scale_head_rows_bf16(ctx, w, rows, cols, factors.data<float>(), head_dim, single));
    const float* f = factors.data<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        w[r * cols + c] = adamw_lowmem::to_bf16(adamw_lowmem::from_bf16(w[r * cols + c]) * f[single ? 0 : r / head_dim]);
    return;
  }
  KILN_ON_CUDA(weight, op, {
    expect_dtype(op, "weight", weight, DType::f32);  // a master
    cuda::scale_head_rows(ctx, weight.data<float>(), rows, cols, factors.data<float>(), head_dim, single, gain_offset);
  });
  dispatch_cpu_float(op, weight.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T* w = weight.data<T>();
    const float* f = factors.data<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const auto factor = static_cast<T>(f[single ? 0 : r / head_dim]);
      for (int64_t c = 0; c < cols; ++c) {
        T& x = w[r * cols + c];
        x = gain_offset ? (T{1} + x) * factor - T{1} : x * factor;
      }
    }
  });
}

}  // namespace kiln::ops
