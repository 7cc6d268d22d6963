#include "ops/mla/mla_absorb.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#if KILN_WITH_CUDA
#include "ops/mla/mla_absorb_cuda.h"
#endif

namespace kiln::ops {

namespace {

// x [N, H, a], w [H b, r] (head h's rows h b .. h b + b - 1).
void validate(const char* op, const Tensor& small, const Tensor& w, const Tensor& latent) {
  expect_rank(op, "per-head input", small, 3);
  expect_rank(op, "latent rows", latent, 3);
  const int64_t n = small.size(0), h = small.size(1), r = latent.size(2);
  expect_shape(op, "latent rows", latent, Shape{n, h, r});
  expect_shape(op, "w", w, Shape{h * small.size(2), r});
  expect_same(op, "latent rows", latent, small);
  expect_same(op, "w", w, small);
  KILN_CHECK(small.device() == Device::cpu || small.dtype() == DType::f32 || small.dtype() == DType::bf16, op,
             "the GPU computes in f32 or bf16, got {}", small.describe());
}

}  // namespace

void mla_absorb_query(const ExecContext& ctx, const Tensor& q, const Tensor& w_kb, const Tensor& q_abs) {
  (void)ctx;
  const char* op = "mla_absorb_query";
  KILN_OP_SCOPE(op, q);
  validate(op, q, w_kb, q_abs);
  KILN_ON_CUDA(q, op,
               cuda::mla_absorb_query(ctx, q.dtype(), q.raw(), q.size(0), q.size(1), q.size(2), w_kb.raw(),
                                      q_abs.size(2), q_abs.raw()));
  dispatch_cpu_float(op, q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), r = q_abs.size(2);
    const T *qp = q.data<T>(), *w = w_kb.data<T>();
    T* out = q_abs.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t nh = 0; nh < n * heads; ++nh) {
      const int64_t h = nh % heads;
      T* o = out + nh * r;
      for (int64_t a = 0; a < r; ++a) o[a] = 0;
      for (int64_t i = 0; i < d; ++i) {
        const T qi = qp[nh * d + i];
        const T* row = w + (h * d + i) * r;
        for (int64_t a = 0; a < r; ++a) o[a] += qi * row[a];
      }
    }
  });
}

void mla_expand_values(const ExecContext& ctx, const Tensor& cbar, const Tensor& w_vb, const Tensor& o) {
  (void)ctx;
  const char* op = "mla_expand_values";
  KILN_OP_SCOPE(op, cbar);
  validate(op, o, w_vb, cbar);
  KILN_ON_CUDA(o, op,
               cuda::mla_expand_values(ctx, o.dtype(), cbar.raw(), o.size(0), o.size(1), cbar.size(2), w_vb.raw(),
                                       o.size(2), o.raw()));
  dispatch_cpu_float(op, o.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = o.size(0), heads = o.size(1), d = o.size(2), r = cbar.size(2);
    const T *c = cbar.data<T>(), *w = w_vb.data<T>();
    T* out = o.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t nh = 0; nh < n * heads; ++nh) {
      const int64_t h = nh % heads;
      for (int64_t j = 0; j < d; ++j) {
        const T* row = w + (h * d + j) * r;
        T s = 0;
        for (int64_t a = 0; a < r; ++a) s += row[a] * c[nh * r + a];
        out[nh * d + j] = s;
      }
    }
  });
}

}  // namespace kiln::ops
