#include "ops/mla/mla_heads.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#if KILN_WITH_CUDA
#include "ops/mla/mla_heads_cuda.h"
#endif

#include <algorithm>

namespace kiln::ops {

void mla_copy_heads(const ExecContext& ctx, const Tensor& src, const Tensor& dst) {
  (void)ctx;
  const char* op = "mla_copy_heads";
  KILN_OP_SCOPE(op, src);
  expect_rank(op, "src", src, 3);
  expect_rank(op, "dst", dst, 3);
  expect_shape(op, "dst", dst, Shape{src.size(0), src.size(1), dst.size(2)});
  expect_same(op, "dst", dst, src);
  KILN_ON_CUDA(src, op,
               cuda::mla_copy_heads(ctx, static_cast<int64_t>(dtype_size(src.dtype())), src.raw(),
                                    src.size(0) * src.size(1), src.size(2), dst.size(2), dst.raw()));
  dispatch_cpu_float(op, src.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t rows = src.size(0) * src.size(1), a = src.size(2), b = dst.size(2), keep = std::min(a, b);
    const T* s = src.data<T>();
    T* d = dst.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(s + r * a, keep, d + r * b);
      std::fill(d + r * b + keep, d + (r + 1) * b, T(0));
    }
  });
}

}  // namespace kiln::ops
