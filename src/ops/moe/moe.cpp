// The MoE dispatch ops' front ends and CPU reference (ops/moe/moe.h). The expert products
// reuse the linear op on each expert's rows, so the reference has one GEMM path.
#include "ops/moe/moe.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/linear/linear.h"

#include <vector>

namespace kiln::ops {

namespace {

void check_dispatch(const char* op, const MoeDispatch& d, int64_t tokens) {
  const int64_t rows = tokens * d.top_k;
  KILN_CHECK(d.experts > 0 && d.top_k > 0 && d.top_k <= d.experts, op, "dispatch of top {} of {} experts", d.top_k,
             d.experts);
  expect_shape(op, "counts", d.counts, Shape{d.experts});
  expect_shape(op, "offsets", d.offsets, Shape{d.experts + 1});
  expect_shape(op, "pair_of_row", d.pair_of_row, Shape{rows});
  expect_shape(op, "row_of_pair", d.row_of_pair, Shape{rows});
  for (const Tensor* t : {&d.counts, &d.offsets, &d.pair_of_row, &d.row_of_pair}) expect_dtype(op, "dispatch", *t, DType::i32);
}

// Expert e's rows of the grouped layout, read from host offsets.
std::vector<int32_t> host_offsets(const MoeDispatch& d) {
  const int32_t* o = d.offsets.data<int32_t>();
  return std::vector<int32_t>(o, o + d.experts + 1);
}

}  // namespace

void moe_dispatch(const Tensor& experts, const MoeDispatch& out) {
  const char* op = "moe_dispatch";
  KILN_OP_SCOPE(op, experts);
  expect_rank(op, "experts", experts, 2);
  expect_dtype(op, "experts", experts, DType::i32);
  KILN_CHECK(experts.size(1) == out.top_k, op, "experts {} for top_k {}", experts.describe(), out.top_k);
  check_dispatch(op, out, experts.size(0));
  if (experts.device() == Device::cuda) no_cuda_kernel(op);  // no CUDA kernels yet
  const int64_t pairs = experts.numel(), e_count = out.experts;
  const int32_t* ids = experts.data<int32_t>();
  int32_t* counts = out.counts.data<int32_t>();
  int32_t* offsets = out.offsets.data<int32_t>();
  std::fill(counts, counts + e_count, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    KILN_CHECK(ids[p] >= 0 && ids[p] < e_count, op, "pair {} is routed to expert {} of {}", p, ids[p], e_count);
    ++counts[ids[p]];
  }
  offsets[0] = 0;
  for (int64_t e = 0; e < e_count; ++e) offsets[e + 1] = offsets[e] + counts[e];
  std::vector<int32_t> next(offsets, offsets + e_count);  // a stable counting sort of the pairs
  for (int64_t p = 0; p < pairs; ++p) {
    const int32_t row = next[static_cast<size_t>(ids[p])]++;
    out.pair_of_row.data<int32_t>()[row] = static_cast<int32_t>(p);
    out.row_of_pair.data<int32_t>()[p] = row;
  }
}

void moe_gather(const Tensor& x, const MoeDispatch& d, const Tensor& grouped) {
  const char* op = "moe_gather";
  KILN_OP_SCOPE(op, x);
  expect_rank(op, "x", x, 2);
  check_dispatch(op, d, x.size(0));
  expect_same(op, "grouped", grouped, x);
  expect_shape(op, "grouped", grouped, Shape{x.size(0) * d.top_k, x.size(1)});
  if (x.device() == Device::cuda) no_cuda_kernel(op);  // no CUDA kernels yet
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = x.size(1), k = d.top_k;
    for (int64_t r = 0; r < grouped.size(0); ++r) {
      const T* src = x.data<T>() + (d.pair_of_row.data<int32_t>()[r] / k) * cols;
      std::copy(src, src + cols, grouped.data<T>() + r * cols);
    }
  });
}

void moe_gather_backward(const Tensor& dgrouped, const MoeDispatch& d, const Tensor& dx, bool accumulate) {
  const char* op = "moe_gather_backward";
  KILN_OP_SCOPE(op, dgrouped);
  expect_rank(op, "dx", dx, 2);
  check_dispatch(op, d, dx.size(0));
  expect_same(op, "dgrouped", dgrouped, dx);
  expect_shape(op, "dgrouped", dgrouped, Shape{dx.size(0) * d.top_k, dx.size(1)});
  if (dx.device() == Device::cuda) no_cuda_kernel(op);  // no CUDA kernels yet
  dispatch_cpu_float(op, dx.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = dx.size(1), k = d.top_k;
    for (int64_t t = 0; t < dx.size(0); ++t) {
      T* out = dx.data<T>() + t * cols;
      if (!accumulate) std::fill(out, out + cols, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const T* src = dgrouped.data<T>() + d.row_of_pair.data<int32_t>()[t * k + j] * cols;
        for (int64_t c = 0; c < cols; ++c) out[c] += src[c];
      }
    }
  });
}

void moe_grouped_linear_forward(const Tensor& x, const Tensor& w, const MoeDispatch& d, const Tensor& y) {
  const char* op = "moe_grouped_linear";
  KILN_OP_SCOPE(op, x);
  expect_rank(op, "x", x, 2);
  expect_rank(op, "w", w, 2);
  expect_same(op, "w", w, x);
  expect_same(op, "y", y, x);
  KILN_CHECK(w.size(0) % d.experts == 0 && w.size(1) == x.size(1), op, "w {} for {} experts over x {}", w.describe(),
             d.experts, x.describe());
  const int64_t out = w.size(0) / d.experts;
  expect_shape(op, "y", y, Shape{x.size(0), out});
  if (x.device() == Device::cuda) no_cuda_kernel(op);  // no CUDA kernels yet
  const std::vector<int32_t> o = host_offsets(d);
  for (int64_t e = 0; e < d.experts; ++e) {
    if (o[e + 1] == o[e]) continue;
    linear_forward(x.rows(o[e], o[e + 1]), w.rows(e * out, (e + 1) * out), Tensor(), y.rows(o[e], o[e + 1]));
  }
}

void moe_grouped_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const MoeDispatch& d,
                                 const Tensor& dx, const Tensor& dw) {
  const char* op = "moe_grouped_linear_backward";
  KILN_OP_SCOPE(op, dy);
  expect_rank(op, "w", w, 2);
  const int64_t out = w.size(0) / d.experts;
  expect_shape(op, "dy", dy, Shape{x.size(0), out});
  if (dx.defined()) expect_same(op, "dx", dx, x);
  if (dy.device() == Device::cuda) no_cuda_kernel(op);  // no CUDA kernels yet
  const std::vector<int32_t> o = host_offsets(d);
  for (int64_t e = 0; e < d.experts; ++e) {
    if (o[e + 1] == o[e]) continue;
    const Tensor rows_dx = dx.defined() ? dx.rows(o[e], o[e + 1]) : Tensor();
    const Tensor rows_dw = dw.defined() ? dw.rows(e * out, (e + 1) * out) : Tensor();
    linear_backward(x.rows(o[e], o[e + 1]), w.rows(e * out, (e + 1) * out), dy.rows(o[e], o[e + 1]), rows_dx, rows_dw,
                    Tensor());
  }
}

void moe_combine(const Tensor& y, const Tensor& weights, const MoeDispatch& d, const Tensor& out) {
  const char* op = "moe_combine";
  KILN_OP_SCOPE(op, y);
  expect_rank(op, "out", out, 2);
  check_dispatch(op, d, out.size(0));
  expect_same(op, "y", y, out);
  expect_shape(op, "y", y, Shape{out.size(0) * d.top_k, out.size(1)});
  expect_shape(op, "weights", weights, Shape{out.size(0), d.top_k});
  if (out.device() == Device::cuda) no_cuda_kernel(op);  // no CUDA kernels yet
  dispatch_cpu_float(op, out.dtype(), [&](auto zero) {
    using T = decltype(zero);
    expect_dtype(op, "weights", weights, out.dtype());
    const int64_t cols = out.size(1), k = d.top_k;
    for (int64_t t = 0; t < out.size(0); ++t) {
      T* o = out.data<T>() + t * cols;
      std::fill(o, o + cols, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const T w = weights.data<T>()[t * k + j];
        const T* src = y.data<T>() + d.row_of_pair.data<int32_t>()[t * k + j] * cols;
        for (int64_t c = 0; c < cols; ++c) o[c] += w * src[c];
      }
    }
  });
}

void moe_combine_backward(const Tensor& y, const Tensor& weights, const Tensor& dout, const MoeDispatch& d,
                          const Tensor& dy, const Tensor& dweights) {
  const char* op = "moe_combine_backward";
  KILN_OP_SCOPE(op, dout);
  expect_rank(op, "dout", dout, 2);
  check_dispatch(op, d, dout.size(0));
  expect_same(op, "dy", dy, y);
  expect_shape(op, "dy", dy, y.shape());
  expect_shape(op, "dweights", dweights, weights.shape());
  if (dout.device() == Device::cuda) no_cuda_kernel(op);  // no CUDA kernels yet
  dispatch_cpu_float(op, dout.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = dout.size(1), k = d.top_k;
    for (int64_t t = 0; t < dout.size(0); ++t) {
      const T* g = dout.data<T>() + t * cols;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t row = d.row_of_pair.data<int32_t>()[t * k + j];
        const T w = weights.data<T>()[t * k + j];
        const T* src = y.data<T>() + row * cols;
        T* dst = dy.data<T>() + row * cols;
        double dot = 0;
        for (int64_t c = 0; c < cols; ++c) {
          dst[c] = w * g[c];
          dot += static_cast<double>(g[c]) * static_cast<double>(src[c]);
        }
        dweights.data<T>()[t * k + j] = static_cast<T>(dot);
      }
    }
  });
}

}  // namespace kiln::ops
