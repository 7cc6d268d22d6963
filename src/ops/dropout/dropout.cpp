#include "ops/dropout/dropout.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/dropout/dropout_cuda.h"
#include "ops/dropout/dropout_mask.h"

namespace kiln::ops {

void dropout_apply(const ExecContext& ctx, const Tensor& x, const DropoutSite& site, const Tensor& y) {
  const char* op = "dropout";
  KILN_OP_SCOPE(op, x);
  expect_rank(op, "x", x, 2);
  expect_same(op, "y", y, x);
  expect_shape(op, "y", y, x.shape());
  KILN_CHECK(site.p >= 0 && site.p < 1, op, "drop probability {} outside [0, 1)", site.p);
  expect_tensor(op, "key", site.key, Shape{2}, DType::i32, x.device());
  const uint32_t threshold = dropout::threshold_of(site.p);
  // 1 / (1 - p) in double, then rounded to the data's arithmetic (fp32 on the GPU).
  const double scale = 1.0 / (1.0 - site.p);
  KILN_ON_CUDA(x, op, {
    if (x.dtype() == DType::bf16)
      cuda::dropout_apply_bf16(ctx, bf16_data(x), x.numel(), site.key.data<int32_t>(), site.site, threshold,
                               static_cast<float>(scale), bf16_data(y));
    else
      cuda::dropout_apply_f32(ctx, x.data<float>(), x.numel(), site.key.data<int32_t>(), site.site, threshold,
                              static_cast<float>(scale), y.data<float>());
  });
  const int32_t* words = site.key.data<int32_t>();
  const uint64_t key = static_cast<uint32_t>(words[0]) | static_cast<uint64_t>(static_cast<uint32_t>(words[1])) << 32;
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* in = x.data<T>();
    T* out = y.data<T>();
    const T s = static_cast<T>(scale);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < x.numel(); ++i)
      out[i] = dropout::keeps(key, site.site, static_cast<uint64_t>(i), threshold) ? in[i] * s : T(0);
  });
}

}  // namespace kiln::ops
