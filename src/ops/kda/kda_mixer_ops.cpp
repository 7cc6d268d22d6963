#include "ops/kda/kda_mixer_ops.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/stable_math.h"
#if KILN_WITH_CUDA
#include "ops/kda/kda_mixer_cuda.h"
#endif

#include <cmath>

namespace kiln::ops {

namespace {

// An activation shaped `shape` of like's dtype and device (f32 or bf16 on the GPU).
void expect_like(const char* op, const char* name, const Tensor& t, Shape shape, const Tensor& like) {
  if (like.device() == Device::cuda)
    KILN_CHECK(like.dtype() == DType::f32 || like.dtype() == DType::bf16, op, "{} must be f32 or bf16 on the GPU, got {}",
               name, like.describe());
  expect_shape(op, name, t, shape);
  expect_same(op, name, t, like);
}

// The norm's gain and its gradient: o's dtype on the CPU, the fp32 master on the GPU.
void expect_gain(const char* op, const char* name, const Tensor& t, const Tensor& o) {
  expect_tensor(op, name, t, Shape{o.size(2)}, o.device() == Device::cuda ? DType::f32 : o.dtype(), o.device());
}

// q [N, H, d_k], v [N, H, d_v] against qkv [N, 2 H d_k + H d_v].
void validate_split(const char* op, const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v) {
  expect_rank(op, "q", q, 3);
  expect_rank(op, "v", v, 3);
  const int64_t n = q.size(0), h = q.size(1), dk = q.size(2), dv = v.size(2);
  expect_like(op, "qkv", qkv, Shape{n, h * (2 * dk + dv)}, q);
  expect_like(op, "k", k, q.shape(), q);
  expect_like(op, "v", v, Shape{n, h, dv}, q);
}

}  // namespace

void kda_split_norm_forward(const ExecContext& ctx, const Tensor& qkv, const Tensor& q, const Tensor& k,
                            const Tensor& v) {
  (void)ctx;  // CPU builds: only the CUDA path reads it
  const char* op = "kda_split_norm_forward";
  KILN_OP_SCOPE(op, qkv);
  validate_split(op, qkv, q, k, v);
  KILN_ON_CUDA(q, op,
               cuda::kda_split_norm_forward(ctx, q.dtype(), qkv.raw(), q.size(0), q.size(1), q.size(2), v.size(2),
                                            static_cast<float>(kKdaL2NormEps), q.raw(), k.raw(), v.raw()));
  dispatch_cpu_float(op, q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2), cols = qkv.size(1);
    const T* x = qkv.data<T>();
    T *qp = q.data<T>(), *kp = k.data<T>(), *vp = v.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        for (int part = 0; part < 2; ++part) {
          const T* src = x + t * cols + part * heads * dk + h * dk;
          T* dst = (part == 0 ? qp : kp) + (t * heads + h) * dk;
          T ss = 0;
          for (int64_t i = 0; i < dk; ++i) ss += src[i] * src[i];
          const T r = T(1) / std::sqrt(ss + T(kKdaL2NormEps));
          for (int64_t i = 0; i < dk; ++i) dst[i] = src[i] * r;
        }
        const T* src = x + t * cols + 2 * heads * dk + h * dv;
        for (int64_t i = 0; i < dv; ++i) vp[(t * heads + h) * dv + i] = src[i];
      }
  });
}

// y = x r with r = (|x|^2 + eps)^-1/2: dx = r (dy - y (y . dy)).
void kda_split_norm_backward(const ExecContext& ctx, const Tensor& qkv, const Tensor& dq, const Tensor& dk,
                             const Tensor& dv, const Tensor& dqkv) {
  (void)ctx;  // CPU builds: only the CUDA path reads it
  const char* op = "kda_split_norm_backward";
  KILN_OP_SCOPE(op, qkv);
  validate_split(op, qkv, dq, dk, dv);
  expect_like(op, "dqkv", dqkv, qkv.shape(), dq);
  KILN_ON_CUDA(dq, op,
               cuda::kda_split_norm_backward(ctx, dq.dtype(), qkv.raw(), dq.raw(), dk.raw(), dv.raw(), dq.size(0),
                                             dq.size(1), dq.size(2), dv.size(2), static_cast<float>(kKdaL2NormEps),
                                             dqkv.raw()));
  dispatch_cpu_float(op, dq.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = dq.size(0), heads = dq.size(1), d_k = dq.size(2), d_v = dv.size(2), cols = qkv.size(1);
    const T* x = qkv.data<T>();
    const T *dqp = dq.data<T>(), *dkp = dk.data<T>(), *dvp = dv.data<T>();
    T* dx = dqkv.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        for (int part = 0; part < 2; ++part) {
          const int64_t at = t * cols + part * heads * d_k + h * d_k;
          const T* dy = (part == 0 ? dqp : dkp) + (t * heads + h) * d_k;
          T ss = 0;
          for (int64_t i = 0; i < d_k; ++i) ss += x[at + i] * x[at + i];
          const T r = T(1) / std::sqrt(ss + T(kKdaL2NormEps));
          T dot = 0;
          for (int64_t i = 0; i < d_k; ++i) dot += x[at + i] * r * dy[i];
          for (int64_t i = 0; i < d_k; ++i) dx[at + i] = r * (dy[i] - x[at + i] * r * dot);
        }
        for (int64_t i = 0; i < d_v; ++i) dx[t * cols + 2 * heads * d_k + h * d_v + i] = dvp[(t * heads + h) * d_v + i];
      }
  });
}

void kda_beta_forward(const ExecContext& ctx, const Tensor& raw, const Tensor& beta) {
  (void)ctx;  // CPU builds: only the CUDA path reads it
  const char* op = "kda_beta_forward";
  KILN_OP_SCOPE(op, raw);
  expect_like(op, "beta", beta, raw.shape(), raw);
  KILN_ON_CUDA(raw, op, cuda::kda_beta_forward(ctx, raw.dtype(), raw.raw(), raw.numel(), beta.raw()));
  dispatch_cpu_float(op, raw.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* x = raw.data<T>();
    T* y = beta.data<T>();
    for (int64_t i = 0; i < raw.numel(); ++i) y[i] = cpu::stable_sigmoid(x[i]);
  });
}

void kda_beta_backward(const ExecContext& ctx, const Tensor& raw, const Tensor& dbeta, const Tensor& draw) {
  (void)ctx;  // CPU builds: only the CUDA path reads it
  const char* op = "kda_beta_backward";
  KILN_OP_SCOPE(op, raw);
  expect_like(op, "dbeta", dbeta, raw.shape(), raw);
  expect_like(op, "draw", draw, raw.shape(), raw);
  KILN_ON_CUDA(raw, op, cuda::kda_beta_backward(ctx, raw.dtype(), raw.raw(), dbeta.raw(), raw.numel(), draw.raw()));
  dispatch_cpu_float(op, raw.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T *x = raw.data<T>(), *d = dbeta.data<T>();
    T* dx = draw.data<T>();
    for (int64_t i = 0; i < raw.numel(); ++i) {
      const T s = cpu::stable_sigmoid(x[i]);
      dx[i] = d[i] * s * (T(1) - s);
    }
  });
}

namespace {

void validate_gate(const char* op, const Tensor& o, const Tensor& gain, const Tensor& gate, const Tensor& y) {
  expect_rank(op, "o", o, 3);
  const int64_t n = o.size(0), cols = o.size(1) * o.size(2);
  expect_gain(op, "gain", gain, o);
  expect_like(op, "gate", gate, Shape{n, cols}, o);
  expect_like(op, "y", y, Shape{n, cols}, o);
}

}  // namespace

void kda_output_gate_forward(const ExecContext& ctx, const Tensor& o, const Tensor& gain, const Tensor& gate,
                             double eps, const Tensor& y) {
  (void)ctx;  // CPU builds: only the CUDA path reads it
  const char* op = "kda_output_gate_forward";
  KILN_OP_SCOPE(op, o);
  validate_gate(op, o, gain, gate, y);
  KILN_ON_CUDA(o, op,
               cuda::kda_output_gate_forward(ctx, o.dtype(), o.raw(), gain.data<float>(), gate.raw(),
                                             o.size(0) * o.size(1), o.size(2), static_cast<float>(eps), y.raw()));
  dispatch_cpu_float(op, o.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t rows = o.size(0) * o.size(1), d = o.size(2);
    const T *x = o.data<T>(), *w = gain.data<T>(), *g = gate.data<T>();
    T* out = y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T ss = 0;
      for (int64_t i = 0; i < d; ++i) ss += x[r * d + i] * x[r * d + i];
      const T rstd = T(1) / std::sqrt(ss / T(d) + T(eps));
      for (int64_t i = 0; i < d; ++i) out[r * d + i] = x[r * d + i] * rstd * w[i] * cpu::stable_sigmoid(g[r * d + i]);
    }
  });
}

// With n = o rstd and s = sigmoid(gate): dgate = dy n w s (1 - s), dgain += dy n s, and
// RMSNorm's d_o = rstd (dn - n mean(n dn)) with dn = dy w s.
void kda_output_gate_backward(const ExecContext& ctx, const Tensor& o, const Tensor& gain, const Tensor& gate,
                              double eps, const Tensor& dy, const Tensor& d_o, const Tensor& dgate,
                              const Tensor& dgain) {
  (void)ctx;  // CPU builds: only the CUDA path reads it
  const char* op = "kda_output_gate_backward";
  KILN_OP_SCOPE(op, o);
  validate_gate(op, o, gain, gate, dy);
  expect_like(op, "d_o", d_o, o.shape(), o);
  expect_like(op, "dgate", dgate, gate.shape(), o);
  expect_gain(op, "dgain", dgain, o);
  KILN_ON_CUDA(o, op,
               cuda::kda_output_gate_backward(ctx, o.dtype(), o.raw(), gain.data<float>(), gate.raw(), dy.raw(),
                                              o.size(0) * o.size(1), o.size(2), static_cast<float>(eps), d_o.raw(),
                                              dgate.raw(), dgain.data<float>()));
  dispatch_cpu_float(op, o.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t rows = o.size(0) * o.size(1), d = o.size(2);
    const T *x = o.data<T>(), *w = gain.data<T>(), *g = gate.data<T>(), *dyp = dy.data<T>();
    T *dx = d_o.data<T>(), *dg = dgate.data<T>(), *dw = dgain.data<T>();
    // Rows in order on one thread: dgain sums over every row.
    for (int64_t r = 0; r < rows; ++r) {
      T ss = 0;
      for (int64_t i = 0; i < d; ++i) ss += x[r * d + i] * x[r * d + i];
      const T rstd = T(1) / std::sqrt(ss / T(d) + T(eps));
      T dot = 0;
      for (int64_t i = 0; i < d; ++i) {
        const int64_t at = r * d + i;
        const T n = x[at] * rstd, s = cpu::stable_sigmoid(g[at]);
        dg[at] = dyp[at] * n * w[i] * s * (T(1) - s);
        dw[i] += dyp[at] * n * s;
        dot += n * dyp[at] * w[i] * s;
      }
      for (int64_t i = 0; i < d; ++i) {
        const int64_t at = r * d + i;
        dx[at] = rstd * (dyp[at] * w[i] * cpu::stable_sigmoid(g[at]) - x[at] * rstd * dot / T(d));
      }
    }
  });
}

}  // namespace kiln::ops
