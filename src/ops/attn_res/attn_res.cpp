#include "ops/attn_res/attn_res.h"

#include "core/op_profiler.h"
#include "ops/common.h"

#if KILN_WITH_CUDA
#include "ops/attn_res/attn_res_cuda.h"
#endif

#include <algorithm>
#include <cmath>
#include <vector>

namespace kiln::ops {

namespace {

void validate(const char* op, std::span<const Tensor> sources, const Tensor& query, const Tensor& like) {
  KILN_CHECK(!sources.empty(), op, "needs at least one source");
  expect_rank(op, "out", like, 2);
  // The GPU mixes the fp32 stream (the mixed path's too: attn_res_cuda.h).
  if (like.device() == Device::cuda) expect_dtype(op, "out", like, DType::f32);
  for (const Tensor& v : sources) {
    expect_shape(op, "source", v, like.shape());
    expect_same(op, "source", v, like);
  }
  expect_shape(op, "query", query, Shape{like.size(1)});
  expect_same(op, "query", query, like);
}

// Row t's scores z_s = w . k_s and the sources' rms, then z becomes the softmax a in place.
template <typename T>
void weights_of_row(const std::vector<const T*>& v, const T* w, int64_t t, int64_t c, double eps, T* a, T* rms) {
  const size_t n = v.size();
  T top = -INFINITY;
  for (size_t s = 0; s < n; ++s) {
    const T* row = v[s] + t * c;
    T squares = 0, dot = 0;
    for (int64_t j = 0; j < c; ++j) {
      squares += row[j] * row[j];
      dot += w[j] * row[j];
    }
    rms[s] = std::sqrt(squares / static_cast<T>(c) + static_cast<T>(eps));
    a[s] = dot / rms[s];
    top = std::max(top, a[s]);
  }
  T total = 0;
  for (size_t s = 0; s < n; ++s) total += (a[s] = std::exp(a[s] - top));
  for (size_t s = 0; s < n; ++s) a[s] /= total;
}

template <typename T>
std::vector<const T*> pointers(std::span<const Tensor> tensors) {
  std::vector<const T*> p;
  for (const Tensor& x : tensors) p.push_back(x.data<T>());
  return p;
}

#if KILN_WITH_CUDA
std::vector<float*> mutable_pointers(std::span<const Tensor> tensors) {
  std::vector<float*> p;
  for (const Tensor& x : tensors) p.push_back(x.data<float>());
  return p;
}
#endif

}  // namespace

void attn_res_mix_forward(const ExecContext& ctx, std::span<const Tensor> sources, const Tensor& query, double eps,
                          const Tensor& out) {
  (void)ctx;  // the CUDA path's stream (unused on the CPU)
  const char* op = "attn_res_mix_forward";
  KILN_OP_SCOPE(op, out);
  validate(op, sources, query, out);
  KILN_ON_CUDA(out, op,
               cuda::attn_res_mix_forward(ctx, pointers<float>(sources).data(), static_cast<int>(sources.size()),
                                          query.data<float>(), static_cast<float>(eps), out.size(0), out.size(1),
                                          out.data<float>()));
  dispatch_cpu_float(op, out.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const std::vector<const T*> v = pointers<T>(sources);
    const int64_t rows = out.size(0), c = out.size(1);
    const size_t n = v.size();
    const T* w = query.data<T>();
    T* o = out.data<T>();
#pragma omp parallel
    {
      std::vector<T> a(n), rms(n);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < rows; ++t) {
        weights_of_row(v, w, t, c, eps, a.data(), rms.data());
        T* dst = o + t * c;
        for (int64_t j = 0; j < c; ++j) {
          T sum = 0;
          for (size_t s = 0; s < n; ++s) sum += a[s] * v[s][t * c + j];
          dst[j] = sum;
        }
      }
    }
  });
}

// With g_s = dout . V_s and z_s = w . k_s: dz_s = a_s (g_s - sum_r a_r g_r), and through the
// gainless RMSNorm dV_s += (dz_s / rms_s) (w - k_s z_s / C), besides a_s dout from the sum.
// dw = sum_t sum_s dz_s k_s, summed over rows in a fixed order (bitwise reproducible).
void attn_res_mix_backward(const ExecContext& ctx, std::span<const Tensor> sources, const Tensor& query, double eps,
                           const Tensor& dout, std::span<const Tensor> dsources, const Tensor& dquery) {
  (void)ctx;
  const char* op = "attn_res_mix_backward";
  KILN_OP_SCOPE(op, dout);
  validate(op, sources, query, dout);
  validate(op, dsources, dquery, dout);
  KILN_CHECK(dsources.size() == sources.size(), op, "{} sources but {} source gradients", sources.size(),
             dsources.size());
  KILN_ON_CUDA(dout, op,
               cuda::attn_res_mix_backward(ctx, pointers<float>(sources).data(), static_cast<int>(sources.size()),
                                           query.data<float>(), static_cast<float>(eps), dout.data<float>(), dout.size(0),
                                           dout.size(1), mutable_pointers(dsources).data(), dquery.data<float>()));
  dispatch_cpu_float(op, dout.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const std::vector<const T*> v = pointers<T>(sources);
    std::vector<T*> dv;
    for (const Tensor& x : dsources) dv.push_back(x.data<T>());
    const int64_t rows = dout.size(0), c = dout.size(1);
    const size_t n = v.size();
    const T* w = query.data<T>();
    const T* g = dout.data<T>();
    // Per row and source: dz_s / rms_s, what dw's sum over rows takes from each row.
    std::vector<T> dz_over_rms(static_cast<size_t>(rows) * n);
#pragma omp parallel
    {
      std::vector<T> a(n), rms(n), dot(n);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < rows; ++t) {
        weights_of_row(v, w, t, c, eps, a.data(), rms.data());
        const T* gt = g + t * c;
        T mean = 0;
        for (size_t s = 0; s < n; ++s) {
          T sum = 0;
          for (int64_t j = 0; j < c; ++j) sum += gt[j] * v[s][t * c + j];
          dot[s] = sum;
          mean += a[s] * sum;
        }
        for (size_t s = 0; s < n; ++s) {
          const T* vs = v[s] + t * c;
          const T k_scale = 1 / rms[s];
          T z = 0;  // w . k_s, recomputed rather than kept from the softmax
          for (int64_t j = 0; j < c; ++j) z += w[j] * vs[j] * k_scale;
          const T dz = a[s] * (dot[s] - mean);
          const T f = dz * k_scale;
          dz_over_rms[static_cast<size_t>(t) * n + s] = f;
          T* d = dv[s] + t * c;
          for (int64_t j = 0; j < c; ++j) d[j] += a[s] * gt[j] + f * (w[j] - vs[j] * k_scale * z / static_cast<T>(c));
        }
      }
    }
    T* dw = dquery.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < c; ++j) {
      T sum = 0;
      for (int64_t t = 0; t < rows; ++t)
        for (size_t s = 0; s < n; ++s) sum += dz_over_rms[static_cast<size_t>(t) * n + s] * v[s][t * c + j];
      dw[j] += sum;
    }
  });
}

}  // namespace kiln::ops
