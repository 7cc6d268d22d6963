// The MoE dispatch ops' front ends and CPU reference (ops/moe/moe.h). The expert products
// reuse the linear op on each expert's rows, so the reference has one GEMM path. On the GPU
// the kernels of moe_cuda.h and grouped_gemm_cuda.h run with the sizes in device memory.
#include "ops/moe/moe.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/linear/linear.h"
#include "ops/moe/grouped_gemm_cuda.h"
#include "ops/moe/moe_cuda.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace kiln::ops {

namespace {

void check_dispatch(const char* op, const MoeDispatch& d, int64_t tokens) {
  const int64_t pairs = tokens * d.top_k;
  KILN_CHECK(d.experts > 0 && d.top_k > 0, op, "dispatch of {} slots over {} experts", d.top_k, d.experts);
  expect_shape(op, "counts", d.counts, Shape{d.experts});
  expect_shape(op, "offsets", d.offsets, Shape{d.experts + 1});
  expect_rank(op, "pair_of_row", d.pair_of_row, 1);
  KILN_CHECK(d.pair_of_row.numel() <= pairs, op, "{} grouped rows for {} pairs", d.pair_of_row.numel(), pairs);
  expect_shape(op, "row_of_pair", d.row_of_pair, Shape{pairs});
  for (const Tensor* t : {&d.counts, &d.offsets, &d.pair_of_row, &d.row_of_pair}) expect_dtype(op, "dispatch", *t, DType::i32);
}

// The grouped layout's rows R.
int64_t grouped_rows(const MoeDispatch& d) { return d.pair_of_row.numel(); }

// Token rows on the GPU: f32, or bf16 on the mixed path.
void expect_gpu_rows(const char* op, const char* name, const Tensor& t) {
  KILN_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, op, "the GPU computes {} in f32 or bf16, got {}",
             name, t.describe());
}

// Routing weights (and their gradients): the rows' dtype on the CPU, fp32 on the GPU.
void expect_weights(const char* op, const char* name, const Tensor& t, const Tensor& rows, Shape shape) {
  expect_tensor(op, name, t, shape, rows.device() == Device::cuda ? DType::f32 : rows.dtype(), rows.device());
}

void expect_on(const char* op, const MoeDispatch& d, Device device) {
  for (const Tensor* t : {&d.counts, &d.offsets, &d.pair_of_row, &d.row_of_pair})
    KILN_CHECK(t->device() == device, op, "the dispatch must be on {}, got {}", device_name(device), t->describe());
}

// The experts' stacked weight w [E out, in] over grouped rows x [rows, in]: checked, and
// each expert's output width returned.
int64_t expert_width(const char* op, const Tensor& x, const Tensor& w, const MoeDispatch& d) {
  expect_rank(op, "x", x, 2);
  expect_rank(op, "w", w, 2);
  expect_same(op, "w", w, x);
  KILN_CHECK(w.size(0) % d.experts == 0 && w.size(1) == x.size(1), op, "w {} for {} experts over x {}", w.describe(),
             d.experts, x.describe());
  return w.size(0) / d.experts;
}

// Expert e's rows of the grouped layout, read from host offsets.
std::vector<int32_t> host_offsets(const MoeDispatch& d) {
  const int32_t* o = d.offsets.data<int32_t>();
  return std::vector<int32_t>(o, o + d.experts + 1);
}

}  // namespace

void moe_dispatch(const ExecContext& ctx, const Tensor& experts, const MoeDispatch& out) {
  const char* op = "moe_dispatch";
  KILN_OP_SCOPE(op, experts);
  expect_rank(op, "experts", experts, 2);
  expect_dtype(op, "experts", experts, DType::i32);
  KILN_CHECK(experts.size(1) == out.top_k, op, "experts {} for {} slots", experts.describe(), out.top_k);
  check_dispatch(op, out, experts.size(0));
  expect_on(op, out, experts.device());
  KILN_CHECK(out.capacity >= 0, op, "capacity {}", out.capacity);
  if (out.dropped.defined()) expect_tensor(op, "dropped", out.dropped, Shape{1}, DType::i32, experts.device());
  KILN_ON_CUDA(experts, op,
               cuda::moe_dispatch(ctx, experts.data<int32_t>(), experts.numel(), out.experts, out.capacity,
                                  grouped_rows(out), out.counts.data<int32_t>(), out.offsets.data<int32_t>(),
                                  out.pair_of_row.data<int32_t>(), out.row_of_pair.data<int32_t>(),
                                  out.dropped.defined() ? out.dropped.data<int32_t>() : nullptr));
  const int64_t pairs = experts.numel(), e_count = out.experts;
  const int32_t* ids = experts.data<int32_t>();
  int32_t* counts = out.counts.data<int32_t>();
  int32_t* offsets = out.offsets.data<int32_t>();
  std::fill(counts, counts + e_count, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    KILN_CHECK(ids[p] >= -1 && ids[p] < e_count, op, "pair {} is routed to expert {} of {}", p, ids[p], e_count);
    if (ids[p] >= 0) ++counts[ids[p]];
  }
  const auto kept = [&](int64_t e) {
    return out.capacity > 0 ? std::min<int64_t>(counts[e], out.capacity) : static_cast<int64_t>(counts[e]);
  };
  offsets[0] = 0;
  for (int64_t e = 0; e < e_count; ++e) offsets[e + 1] = offsets[e] + static_cast<int32_t>(kept(e));
  KILN_CHECK(offsets[e_count] <= grouped_rows(out), op, "{} rows kept, the grouped layout has {}", offsets[e_count],
             grouped_rows(out));
  std::vector<int32_t> next(offsets, offsets + e_count);  // a stable counting sort of the pairs
  int32_t dropped = 0;
  for (int64_t p = 0; p < pairs; ++p) {
    int32_t row = -1;
    if (ids[p] >= 0 && next[static_cast<size_t>(ids[p])] < offsets[ids[p] + 1]) {
      row = next[static_cast<size_t>(ids[p])]++;
      out.pair_of_row.data<int32_t>()[row] = static_cast<int32_t>(p);
    } else if (ids[p] >= 0) {
      ++dropped;  // past its expert's capacity
    }
    out.row_of_pair.data<int32_t>()[p] = row;
  }
  if (out.dropped.defined()) out.dropped.data<int32_t>()[0] += dropped;
}

void moe_gather(const ExecContext& ctx, const Tensor& x, const MoeDispatch& d, const Tensor& grouped) {
  const char* op = "moe_gather";
  KILN_OP_SCOPE(op, x);
  expect_rank(op, "x", x, 2);
  check_dispatch(op, d, x.size(0));
  expect_same(op, "grouped", grouped, x);
  expect_shape(op, "grouped", grouped, Shape{grouped_rows(d), x.size(1)});
  expect_on(op, d, x.device());
  KILN_ON_CUDA(x, op, {
    expect_gpu_rows(op, "x", x);
    cuda::moe_gather(ctx, x.raw(), x.dtype(), grouped_rows(d), x.size(1), d.top_k, d.pair_of_row.data<int32_t>(),
                     d.offsets.data<int32_t>() + d.experts, grouped.raw());
  });
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = x.size(1), k = d.top_k, live = d.offsets.data<int32_t>()[d.experts];
    for (int64_t r = 0; r < grouped.size(0); ++r) {
      T* dst = grouped.data<T>() + r * cols;
      if (r >= live) {
        std::fill(dst, dst + cols, T(0));
        continue;
      }
      const T* src = x.data<T>() + (d.pair_of_row.data<int32_t>()[r] / k) * cols;
      std::copy(src, src + cols, dst);
    }
  });
}

void moe_gather_backward(const ExecContext& ctx, const Tensor& dgrouped, const MoeDispatch& d, const Tensor& dx, bool accumulate) {
  const char* op = "moe_gather_backward";
  KILN_OP_SCOPE(op, dgrouped);
  expect_rank(op, "dx", dx, 2);
  check_dispatch(op, d, dx.size(0));
  expect_same(op, "dgrouped", dgrouped, dx);
  expect_shape(op, "dgrouped", dgrouped, Shape{grouped_rows(d), dx.size(1)});
  expect_on(op, d, dx.device());
  KILN_ON_CUDA(dx, op, {
    expect_gpu_rows(op, "dx", dx);
    cuda::moe_gather_backward(ctx, dgrouped.raw(), dx.dtype(), dx.size(0), dx.size(1), d.top_k,
                              d.row_of_pair.data<int32_t>(), dx.raw(), accumulate);
  });
  dispatch_cpu_float(op, dx.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = dx.size(1), k = d.top_k;
    for (int64_t t = 0; t < dx.size(0); ++t) {
      T* out = dx.data<T>() + t * cols;
      if (!accumulate) std::fill(out, out + cols, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const int32_t row = d.row_of_pair.data<int32_t>()[t * k + j];
        if (row < 0) continue;
        const T* src = dgrouped.data<T>() + row * cols;
        for (int64_t c = 0; c < cols; ++c) out[c] += src[c];
      }
    }
  });
}

void moe_grouped_linear_forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const MoeDispatch& d, const Tensor& y) {
  const char* op = "moe_grouped_linear";
  KILN_OP_SCOPE(op, x);
  const int64_t out = expert_width(op, x, w, d);
  expect_same(op, "y", y, x);
  expect_shape(op, "y", y, Shape{x.size(0), out});
  expect_shape(op, "offsets", d.offsets, Shape{d.experts + 1});
  KILN_CHECK(d.offsets.device() == x.device(), op, "offsets must be on {}, got {}", device_name(x.device()),
             d.offsets.describe());
  KILN_ON_CUDA(x, op, {
    expect_gpu_rows(op, "x", x);
    cuda::grouped_linear_forward(ctx, x.raw(), w.raw(), x.dtype(), d.offsets.data<int32_t>(), d.experts, x.size(0),
                                 x.size(1), out, y.raw());
  });
  const std::vector<int32_t> o = host_offsets(d);
  for (int64_t e = 0; e < d.experts; ++e) {
    if (o[e + 1] == o[e]) continue;
    linear_forward(ctx, x.rows(o[e], o[e + 1]), w.rows(e * out, (e + 1) * out), Tensor(), y.rows(o[e], o[e + 1]));
  }
}

void moe_grouped_linear_backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dy, const MoeDispatch& d,
                                 const Tensor& dx, const Tensor& dw) {
  const char* op = "moe_grouped_linear_backward";
  KILN_OP_SCOPE(op, dy);
  const int64_t out = expert_width(op, x, w, d);
  expect_same(op, "dy", dy, x);
  expect_shape(op, "dy", dy, Shape{x.size(0), out});
  if (dx.defined()) expect_same(op, "dx", dx, x), expect_shape(op, "dx", dx, x.shape());
  // The weight gradient: the weight's dtype, fp32 on the GPU's mixed path.
  if (dw.defined()) expect_tensor(op, "dw", dw, w.shape(), is_mixed(x) ? DType::f32 : x.dtype(), x.device());
  expect_shape(op, "offsets", d.offsets, Shape{d.experts + 1});
  KILN_CHECK(d.offsets.device() == x.device(), op, "offsets must be on {}, got {}", device_name(x.device()),
             d.offsets.describe());
  KILN_ON_CUDA(dy, op, {
    expect_gpu_rows(op, "dy", dy);
    const int32_t* offsets = d.offsets.data<int32_t>();
    if (dx.defined())
      cuda::grouped_linear_backward_input(ctx, dy.raw(), w.raw(), dy.dtype(), offsets, d.experts, x.size(0), x.size(1), out,
                                          dx.raw());
    if (dw.defined())
      cuda::grouped_linear_backward_weight(ctx, x.raw(), dy.raw(), dy.dtype(), offsets, d.experts, x.size(0), x.size(1),
                                           out, dw.data<float>());
  });
  const std::vector<int32_t> o = host_offsets(d);
  for (int64_t e = 0; e < d.experts; ++e) {
    if (o[e + 1] == o[e]) continue;
    const Tensor rows_dx = dx.defined() ? dx.rows(o[e], o[e + 1]) : Tensor();
    const Tensor rows_dw = dw.defined() ? dw.rows(e * out, (e + 1) * out) : Tensor();
    linear_backward(ctx, x.rows(o[e], o[e + 1]), w.rows(e * out, (e + 1) * out), dy.rows(o[e], o[e + 1]), rows_dx, rows_dw,
                    Tensor());
  }
}

void moe_combine(const ExecContext& ctx, const Tensor& y, const Tensor& weights, const MoeDispatch& d, const Tensor& out) {
  const char* op = "moe_combine";
  KILN_OP_SCOPE(op, y);
  expect_rank(op, "out", out, 2);
  check_dispatch(op, d, out.size(0));
  expect_same(op, "y", y, out);
  expect_shape(op, "y", y, Shape{grouped_rows(d), out.size(1)});
  expect_weights(op, "weights", weights, out, Shape{out.size(0), d.top_k});
  expect_on(op, d, out.device());
  KILN_ON_CUDA(out, op, {
    expect_gpu_rows(op, "out", out);
    cuda::moe_combine(ctx, y.raw(), y.dtype(), weights.data<float>(), out.size(0), out.size(1), d.top_k,
                      d.row_of_pair.data<int32_t>(), out.raw());
  });
  dispatch_cpu_float(op, out.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = out.size(1), k = d.top_k;
    for (int64_t t = 0; t < out.size(0); ++t) {
      T* o = out.data<T>() + t * cols;
      std::fill(o, o + cols, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const int32_t row = d.row_of_pair.data<int32_t>()[t * k + j];
        if (row < 0) continue;
        const T w = weights.data<T>()[t * k + j];
        const T* src = y.data<T>() + row * cols;
        for (int64_t c = 0; c < cols; ++c) o[c] += w * src[c];
      }
    }
  });
}

void moe_combine_backward(const ExecContext& ctx, const Tensor& y, const Tensor& weights, const Tensor& dout, const MoeDispatch& d,
                          const Tensor& dy, const Tensor& dweights) {
  const char* op = "moe_combine_backward";
  KILN_OP_SCOPE(op, dout);
  expect_rank(op, "dout", dout, 2);
  check_dispatch(op, d, dout.size(0));
  expect_same(op, "y", y, dout);
  expect_shape(op, "y", y, Shape{grouped_rows(d), dout.size(1)});
  expect_same(op, "dy", dy, y);
  expect_shape(op, "dy", dy, y.shape());
  expect_weights(op, "weights", weights, dout, Shape{dout.size(0), d.top_k});
  expect_weights(op, "dweights", dweights, dout, weights.shape());
  expect_on(op, d, dout.device());
  KILN_ON_CUDA(dout, op, {
    expect_gpu_rows(op, "dout", dout);
    cuda::moe_combine_backward(ctx, y.raw(), y.dtype(), weights.data<float>(), dout.raw(), dout.size(0), dout.size(1),
                               d.top_k, d.row_of_pair.data<int32_t>(), dy.raw(), dweights.data<float>());
  });
  dispatch_cpu_float(op, dout.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = dout.size(1), k = d.top_k;
    for (int64_t t = 0; t < dout.size(0); ++t) {
      const T* g = dout.data<T>() + t * cols;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t row = d.row_of_pair.data<int32_t>()[t * k + j];
        if (row < 0) {
          dweights.data<T>()[t * k + j] = T(0);
          continue;
        }
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

void moe_swiglu_backward(const ExecContext& ctx, const Tensor& gate_up, const Tensor& du, const Tensor& weights,
                         const MoeDispatch& d, const Tensor& dgate_up, const Tensor& weighted_act, const Tensor& dweights) {
  const char* op = "moe_swiglu_backward";
  KILN_OP_SCOPE(op, gate_up);
  expect_rank(op, "gate_up", gate_up, 2);
  const int64_t rows = grouped_rows(d), f = gate_up.size(1) / 2, tokens = weights.defined() ? weights.size(0) : 0;
  KILN_CHECK(gate_up.size(1) % 2 == 0, op, "gate_up must have an even number of columns, got {}", gate_up.describe());
  expect_shape(op, "gate_up", gate_up, Shape{rows, 2 * f});
  for (const auto& [name, t] : {std::pair{"du", &du}, std::pair{"weighted_act", &weighted_act}}) {
    expect_same(op, name, *t, gate_up);
    expect_shape(op, name, *t, Shape{rows, f});
  }
  expect_same(op, "dgate_up", dgate_up, gate_up);
  expect_shape(op, "dgate_up", dgate_up, gate_up.shape());
  check_dispatch(op, d, tokens);
  expect_weights(op, "weights", weights, gate_up, Shape{tokens, d.top_k});
  expect_weights(op, "dweights", dweights, gate_up, weights.shape());
  expect_on(op, d, gate_up.device());
  KILN_ON_CUDA(gate_up, op, {
    expect_gpu_rows(op, "gate_up", gate_up);
    cuda::moe_swiglu_backward(ctx, gate_up.raw(), du.raw(), gate_up.dtype(), weights.data<float>(), rows, f,
                              weights.numel(), d.pair_of_row.data<int32_t>(), d.offsets.data<int32_t>() + d.experts,
                              dgate_up.raw(), weighted_act.raw(), dweights.data<float>());
  });
  dispatch_cpu_float(op, gate_up.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t live = d.offsets.data<int32_t>()[d.experts];
    std::fill(dweights.data<T>(), dweights.data<T>() + dweights.numel(), T(0));
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = gate_up.data<T>() + r * 2 * f;
      const T* u = g + f;
      T* dg = dgate_up.data<T>() + r * 2 * f;
      T* act_out = weighted_act.data<T>() + r * f;
      if (r >= live) {
        std::fill(dg, dg + 2 * f, T(0));
        std::fill(act_out, act_out + f, T(0));
        continue;
      }
      const int32_t p = d.pair_of_row.data<int32_t>()[r];
      const T w = weights.data<T>()[p];
      const T* dr = du.data<T>() + r * f;
      double dot = 0;
      for (int64_t j = 0; j < f; ++j) {
        const T e = std::exp(-g[j]), s = T(1) / (T(1) + e), act = g[j] / (T(1) + e) * u[j], dy = w * dr[j];
        dot += static_cast<double>(dr[j]) * static_cast<double>(act);
        dg[j] = dy * u[j] * s * (T(1) + g[j] * (T(1) - s));
        dg[f + j] = dy * g[j] * s;
        act_out[j] = w * act;  // last: act_out may be du's row
      }
      dweights.data<T>()[p] = static_cast<T>(dot);
    }
  });
}

}  // namespace kiln::ops
