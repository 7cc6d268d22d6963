#include "ops/attention/qkv_prepare.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/attention/qkv_prepare_cuda.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kiln::ops {

namespace {

// Everything both directions check: shapes, dtypes, devices, and positions on the host.
void validate(const char* op, const Tensor& qkv, const QkvPrepare& p, const Tensor& q, const Tensor& k,
              const Tensor& v) {
  KILN_CHECK(p.q_heads > 0 && p.kv_heads > 0 && p.head_dim > 0 && p.head_dim % 2 == 0, op,
             "needs positive heads ({} q, {} kv) and an even head_dim ({})", p.q_heads, p.kv_heads, p.head_dim);
  expect_rank(op, "qkv", qkv, 2);
  const int64_t t = qkv.size(0), d = p.head_dim;
  expect_shape(op, "qkv", qkv, Shape{t, (p.q_heads + 2 * p.kv_heads) * d});
  expect_tensor(op, "q", q, Shape{t, p.q_heads, d}, qkv.dtype(), qkv.device());
  expect_tensor(op, "k", k, Shape{t, p.kv_heads, d}, qkv.dtype(), qkv.device());
  expect_tensor(op, "v", v, Shape{t, p.kv_heads, d}, qkv.dtype(), qkv.device());
  const DType wide = is_mixed(qkv) ? DType::f32 : qkv.dtype();
  KILN_CHECK(p.q_gain.defined() == p.k_gain.defined(), op, "q and k gains come together");
  if (p.q_gain.defined()) {
    expect_tensor(op, "q_gain", p.q_gain, Shape{d}, wide, qkv.device());
    expect_tensor(op, "k_gain", p.k_gain, Shape{d}, wide, qkv.device());
    KILN_CHECK(p.eps > 0, op, "eps must be positive, got {}", p.eps);
  }
  KILN_CHECK(p.cos.defined() == p.sin.defined(), op, "cos and sin come together");
  if (p.cos.defined()) {
    expect_rank(op, "cos", p.cos, 2);
    expect_tensor(op, "cos", p.cos, Shape{p.cos.size(0), d / 2}, wide, qkv.device());
    expect_tensor(op, "sin", p.sin, p.cos.shape(), wide, qkv.device());
    expect_tensor(op, "positions", p.positions, Shape{t}, DType::i32, qkv.device());
    if (qkv.device() == Device::cpu) {
      const int32_t* pos = p.positions.data<int32_t>();
      for (int64_t i = 0; i < t; ++i)
        KILN_CHECK(pos[i] >= 0 && pos[i] < p.cos.size(0), op, "position {} at token {} is outside the table [0, {})",
                   pos[i], i, p.cos.size(0));
    }
  }
}

#if KILN_WITH_CUDA
cuda::QkvPrepareArgs cuda_args(const Tensor& qkv, const QkvPrepare& p) {
  cuda::QkvPrepareArgs a{};
  a.tokens = qkv.size(0);
  a.q_heads = p.q_heads;
  a.kv_heads = p.kv_heads;
  a.head_dim = p.head_dim;
  a.q_gain = p.q_gain.defined() ? p.q_gain.data<float>() : nullptr;
  a.k_gain = p.k_gain.defined() ? p.k_gain.data<float>() : nullptr;
  a.eps = static_cast<float>(p.eps);
  a.positions = p.cos.defined() ? p.positions.data<int32_t>() : nullptr;
  a.cos = p.cos.defined() ? p.cos.data<float>() : nullptr;
  a.sin = p.cos.defined() ? p.sin.data<float>() : nullptr;
  a.bf16 = qkv.dtype() == DType::bf16;
  if (!a.bf16) expect_dtype("qkv_prepare", "qkv", qkv, DType::f32);
  return a;
}
#endif

// The CPU reference: the same arithmetic, in the same order, as rms_norm_forward followed
// by rope_apply (and their backward), so the CPU path's results did not move when the
// steps were fused.
template <typename T>
struct Layout {
  int64_t tokens, hq, hkv, d, half;
  const T* q_gain;
  const T* k_gain;
  T eps;
  const int32_t* positions;
  const T* cos;
  const T* sin;

  int64_t heads_all() const { return hq + 2 * hkv; }
  // Kind of head j of a token (0 q, 1 k, 2 v), its gain, and its row in q/k/v.
  int kind(int64_t j) const { return j < hq ? 0 : j < hq + hkv ? 1 : 2; }
  const T* gain(int kind_of) const { return kind_of == 0 ? q_gain : kind_of == 1 ? k_gain : nullptr; }
  int64_t part_row(int64_t token, int64_t j) const {
    return j < hq ? token * hq + j : j < hq + hkv ? token * hkv + (j - hq) : token * hkv + (j - hq - hkv);
  }
  T inverse_rms(const T* x) const {
    T sum_sq = 0;
    for (int64_t c = 0; c < d; ++c) sum_sq += x[c] * x[c];
    return T(1) / std::sqrt(sum_sq / static_cast<T>(d) + eps);
  }
  // g = the transposed rotation of dy at token i (dy itself without rotation).
  void unrotate(int64_t i, const T* dy, T* g) const {
    if (!cos) {
      std::copy(dy, dy + d, g);
      return;
    }
    const T* c = cos + positions[i] * half;
    const T* s = sin + positions[i] * half;
    for (int64_t j = 0; j < half; ++j) {
      const T x1 = dy[j], x2 = dy[j + half], sj = -s[j];
      g[j] = x1 * c[j] - x2 * sj;
      g[j + half] = x2 * c[j] + x1 * sj;
    }
  }
};

template <typename T>
Layout<T> layout_of(const Tensor& qkv, const QkvPrepare& p) {
  auto data = [](const Tensor& t) { return t.defined() ? t.data<T>() : nullptr; };
  return Layout<T>{qkv.size(0),
                   p.q_heads,
                   p.kv_heads,
                   p.head_dim,
                   p.head_dim / 2,
                   data(p.q_gain),
                   data(p.k_gain),
                   static_cast<T>(p.eps),
                   p.cos.defined() ? p.positions.data<int32_t>() : nullptr,
                   data(p.cos),
                   data(p.sin)};
}

template <typename T>
void forward_cpu(const Layout<T>& l, const T* qkv, T* q, T* k, T* v) {
  const int64_t heads = l.heads_all(), d = l.d, half = l.half;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < l.tokens; ++i)
    for (int64_t j = 0; j < heads; ++j) {
      const T* x = qkv + (i * heads + j) * d;
      const int kind = l.kind(j);
      T* out = (kind == 0 ? q : kind == 1 ? k : v) + l.part_row(i, j) * d;
      const T* w = l.gain(kind);
      if (w) {
        const T inv = l.inverse_rms(x);
        for (int64_t c = 0; c < d; ++c) out[c] = x[c] * inv * w[c];
      } else {
        std::copy(x, x + d, out);
      }
      if (kind == 2 || !l.cos) continue;
      const T* cs = l.cos + l.positions[i] * half;
      const T* sn = l.sin + l.positions[i] * half;
      for (int64_t c = 0; c < half; ++c) {
        const T x1 = out[c], x2 = out[c + half];
        out[c] = x1 * cs[c] - x2 * sn[c];
        out[c + half] = x2 * cs[c] + x1 * sn[c];
      }
    }
}

template <typename T>
void backward_cpu(const Layout<T>& l, const T* qkv, const T* dq, const T* dk, const T* dv, T* dqkv, T* dq_gain,
                  T* dk_gain) {
  const int64_t heads = l.heads_all(), d = l.d;
#pragma omp parallel
  {
    std::vector<T> g(static_cast<size_t>(d));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < l.tokens; ++i)
      for (int64_t j = 0; j < heads; ++j) {
        const T* x = qkv + (i * heads + j) * d;
        const int kind = l.kind(j);
        const T* dy = (kind == 0 ? dq : kind == 1 ? dk : dv) + l.part_row(i, j) * d;
        T* dx = dqkv + (i * heads + j) * d;
        if (kind == 2) {
          std::copy(dy, dy + d, dx);
          continue;
        }
        l.unrotate(i, dy, g.data());
        const T* w = l.gain(kind);
        if (!w) {
          std::copy(g.begin(), g.end(), dx);
          continue;
        }
        const T inv = l.inverse_rms(x);
        T dot = 0;
        for (int64_t c = 0; c < d; ++c) dot += g[static_cast<size_t>(c)] * w[c] * x[c];
        const T coef = dot * inv * inv / static_cast<T>(d);
        for (int64_t c = 0; c < d; ++c) dx[c] = inv * (g[static_cast<size_t>(c)] * w[c] - x[c] * coef);
      }
  }
  if (!dq_gain || !l.q_gain) return;
  // Gain gradients: per gain, a sum over its rows (token-major, then head) in one fixed
  // order, parallel over blocks of 16 columns; rstd once per row.
  for (int kind = 0; kind < 2; ++kind) {
    const int64_t first = kind == 0 ? 0 : l.hq, count = kind == 0 ? l.hq : l.hkv;
    std::vector<T> inv(static_cast<size_t>(l.tokens * count));
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < l.tokens * count; ++r)
      inv[static_cast<size_t>(r)] = l.inverse_rms(qkv + ((r / count) * heads + first + r % count) * d);
    const T* grads = kind == 0 ? dq : dk;
    T* dw = kind == 0 ? dq_gain : dk_gain;
    constexpr int64_t kBlock = 16;
#pragma omp parallel
    {
      std::vector<T> g(static_cast<size_t>(d));
#pragma omp for schedule(static)
      for (int64_t b = 0; b < (d + kBlock - 1) / kBlock; ++b) {
        const int64_t c0 = b * kBlock, width = std::min(kBlock, d - c0);
        T sum[kBlock] = {};
        for (int64_t r = 0; r < l.tokens * count; ++r) {
          const int64_t i = r / count;
          l.unrotate(i, grads + r * d, g.data());
          const T* x = qkv + (i * heads + first + r % count) * d;
          for (int64_t c = 0; c < width; ++c)
            sum[c] += g[static_cast<size_t>(c0 + c)] * x[c0 + c] * inv[static_cast<size_t>(r)];
        }
        for (int64_t c = 0; c < width; ++c) dw[c0 + c] += sum[c];
      }
    }
  }
}

}  // namespace

void qkv_prepare_forward(const ExecContext& ctx, const Tensor& qkv, const QkvPrepare& p, const Tensor& q, const Tensor& k, const Tensor& v) {
  const char* op = "qkv_prepare";
  KILN_OP_SCOPE(op, qkv);
  validate(op, qkv, p, q, k, v);
  KILN_ON_CUDA(qkv, op, cuda::qkv_prepare_forward(ctx, cuda_args(qkv, p), qkv.raw(), q.raw(), k.raw(), v.raw()));
  dispatch_cpu_float(op, qkv.dtype(), [&](auto zero) {
    using T = decltype(zero);
    forward_cpu<T>(layout_of<T>(qkv, p), qkv.data<T>(), q.data<T>(), k.data<T>(), v.data<T>());
  });
}

void qkv_prepare_backward(const ExecContext& ctx, const Tensor& qkv, const QkvPrepare& p, const Tensor& dq, const Tensor& dk,
                          const Tensor& dv, const Tensor& dqkv, const Tensor& dq_gain, const Tensor& dk_gain) {
  const char* op = "qkv_prepare_backward";
  KILN_OP_SCOPE(op, qkv);
  validate(op, qkv, p, dq, dk, dv);
  expect_tensor(op, "dqkv", dqkv, qkv.shape(), qkv.dtype(), qkv.device());
  KILN_CHECK(dq_gain.defined() == dk_gain.defined(), op, "q and k gain gradients come together");
  const bool gain_grads = dq_gain.defined() && p.q_gain.defined();
  if (gain_grads) {
    expect_tensor(op, "dq_gain", dq_gain, p.q_gain.shape(), p.q_gain.dtype(), qkv.device());
    expect_tensor(op, "dk_gain", dk_gain, p.k_gain.shape(), p.k_gain.dtype(), qkv.device());
  }
  KILN_ON_CUDA(qkv, op,
               cuda::qkv_prepare_backward(ctx, cuda_args(qkv, p), qkv.raw(), dq.raw(), dk.raw(), dv.raw(), dqkv.raw(),
                                          gain_grads ? dq_gain.data<float>() : nullptr,
                                          gain_grads ? dk_gain.data<float>() : nullptr));
  dispatch_cpu_float(op, qkv.dtype(), [&](auto zero) {
    using T = decltype(zero);
    backward_cpu<T>(layout_of<T>(qkv, p), qkv.data<T>(), dq.data<T>(), dk.data<T>(), dv.data<T>(), dqkv.data<T>(),
                    gain_grads ? dq_gain.data<T>() : nullptr, gain_grads ? dk_gain.data<T>() : nullptr);
  });
}

}  // namespace kiln::ops
