#include "ops/attention/attention.h"

#include "ops/attention/attention_cpu.h"
#include "ops/attention/attention_cudnn.h"
#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/attention/attention_cuda.h"
#include "ops/attention/attention_sinks_cuda.h"
#include "ops/dropout/dropout_mask.h"

#include <cmath>

namespace kiln::ops {

namespace {

void expect_like(const char* op, const char* name, const Tensor& t, const Tensor& q, Shape shape) {
  expect_shape(op, name, t, shape);
  expect_same(op, name, t, q);
}

// Softmax statistics stay fp32 when q is bf16 (the GPU's mixed path).
void expect_lse(const char* op, const Tensor& lse, const Tensor& q) {
  expect_shape(op, "lse", lse, Shape{q.size(0), q.size(1)});
  if (is_mixed(q))
    expect_dtype(op, "lse", lse, DType::f32);
  else
    expect_same(op, "lse", lse, q);
}

[[maybe_unused]] int64_t max_seqlen_of(const char* op, const AttentionOptions& o) {
  KILN_CHECK(o.max_seqlen > 0, op, "the bf16 GPU path needs the batch's longest sequence (max_seqlen)");
  return o.max_seqlen;
}

void validate(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens) {
  expect_rank(op, "q", q, 3);
  expect_rank(op, "k", k, 3);
  expect_same(op, "k", k, q);
  expect_like(op, "v", v, q, k.shape());
  KILN_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2), op, "q {} and k {} disagree", q.describe(),
             k.describe());
  KILN_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, op, "query heads {} must be a multiple of kv heads {}",
             q.size(1), k.size(1));
  KILN_CHECK(q.size(2) <= cpu::kMaxAttentionHeadDim, op, "head_dim {} exceeds {}", q.size(2),
             cpu::kMaxAttentionHeadDim);
  expect_rank(op, "cu_seqlens", cu_seqlens, 1);
  expect_dtype(op, "cu_seqlens", cu_seqlens, DType::i32);
  KILN_CHECK(cu_seqlens.size(0) >= 2, op, "cu_seqlens needs at least 2 entries");
  if (cu_seqlens.device() == Device::cpu) {
    const int32_t* cu = cu_seqlens.data<int32_t>();
    const int64_t s = cu_seqlens.size(0) - 1;
    KILN_CHECK(cu[0] == 0 && cu[s] == q.size(0), op, "cu_seqlens must run from 0 to {} tokens, got {}..{}",
               q.size(0), cu[0], cu[s]);
    for (int64_t i = 0; i < s; ++i)
      KILN_CHECK(cu[i] <= cu[i + 1], op, "cu_seqlens must not decrease (entry {})", i + 1);
  }
}

// Sinks [Hq] in lse's dtype, beside q. On the GPU no attention kernel takes a sink (cuDNN's
// needs 9.26 for ragged batches): attention_sinks_cuda.h corrects the sink-free kernels'
// output and lse instead.
void expect_sinks(const char* op, const Tensor& sinks, const Tensor& q, const Tensor& lse) {
  if (!sinks.defined()) return;
  expect_shape(op, "sinks", sinks, Shape{q.size(1)});
  expect_same(op, "sinks", sinks, lse);
}

// The dropout of the probabilities: its key beside q, p in [0, 1). cuDNN's path corrects
// sinks around kernels whose Philox masks nothing here can check against the CPU, so
// that combination is refused rather than left untested.
void expect_dropout(const char* op, const Tensor& q, const AttentionOptions& o) {
  if (!o.drops()) return;
  KILN_CHECK(o.dropout.p < 1, op, "model.attention_dropout ({}) must be below 1", o.dropout.p);
  expect_tensor(op, "dropout key", o.dropout.key, Shape{2}, DType::i32, q.device());
  KILN_CHECK(!(o.sinks.defined() && is_mixed(q) && q.device() == Device::cuda), op,
             "model.attention_dropout with model.attention_sinks is not supported on the bf16 GPU path (cuDNN)");
}

// The shape and options as the CPU reference (cpu::AttentionShape, double scale and softcap)
// or the CUDA kernels (cuda::AttentionArgs, float) take them: the same fields.
template <typename Shape>
Shape shape_as(const Tensor& q, const Tensor& k, const Tensor& cu, const AttentionOptions& o) {
  using Real = decltype(Shape::scale);
  Shape s;
  s.tokens = q.size(0);
  s.q_heads = q.size(1);
  s.kv_heads = k.size(1);
  s.head_dim = q.size(2);
  s.num_seqs = cu.size(0) - 1;
  s.cu_seqlens = cu.data<int32_t>();
  s.scale = static_cast<Real>(o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(q.size(2))));
  s.window = o.window;
  s.softcap = static_cast<Real>(o.softcap);
  if (o.drops()) {
    s.dropout_site = o.dropout.site;
    s.dropout_threshold = dropout::threshold_of(o.dropout.p);
    s.dropout_scale = static_cast<Real>(1.0 / (1.0 - o.dropout.p));  // in double, then rounded
  }
  return s;
}

cpu::AttentionShape shape_of(const Tensor& q, const Tensor& k, const Tensor& cu, const AttentionOptions& o) {
  cpu::AttentionShape s = shape_as<cpu::AttentionShape>(q, k, cu, o);
  s.dropout = o.drops();
  if (s.dropout) s.dropout_key = dropout::key_of_words(o.dropout.key.data<int32_t>());
  return s;
}

#if KILN_WITH_CUDA
cuda::AttentionArgs cuda_args(const Tensor& q, const Tensor& k, const Tensor& cu, const AttentionOptions& o) {
  cuda::AttentionArgs a = shape_as<cuda::AttentionArgs>(q, k, cu, o);
  a.deterministic = o.deterministic;
  a.uniform = o.uniform;
  if (o.drops()) {
    a.dropout_key = o.dropout.key.data<int32_t>();
    a.dropout_p = static_cast<float>(o.dropout.p);
  }
  return a;
}

// The sinks' correction's view of a batch: cuDNN's lse of a uniform batch is head-major by
// sequence (attention_cudnn.h; one token per sequence lays out the same either way).
cuda::SinkArgs sink_args(const Tensor& q, const AttentionOptions& o) {
  cuda::SinkArgs s;
  s.tokens = q.size(0);
  s.q_heads = q.size(1);
  s.head_dim = q.size(2);
  s.bf16 = is_mixed(q);
  s.lse_seq = s.bf16 && o.uniform ? o.max_seqlen : 0;
  return s;
}
#endif

template <typename T>
T* sink_data(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

}  // namespace

void attention_forward(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens,
                       const AttentionOptions& options, const Tensor& out, const Tensor& lse) {
  const char* op = "attention";
  KILN_OP_SCOPE(op, q);
  validate(op, q, k, v, cu_seqlens);
  expect_like(op, "out", out, q, q.shape());
  expect_lse(op, lse, q);
  expect_sinks(op, options.sinks, q, lse);
  expect_dropout(op, q, options);
  KILN_ON_CUDA(q, op, {
    const cuda::AttentionArgs args = cuda_args(q, k, cu_seqlens, options);
    if (is_mixed(q))
      cuda::attention_forward_bf16(ctx, args, max_seqlen_of(op, options), bf16_data(q), bf16_data(k), bf16_data(v),
                                   bf16_data(out), lse.data<float>());
    else
      cuda::attention_forward_f32(ctx, args, q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(),
                                  lse.data<float>());
    if (options.sinks.defined())
      cuda::attention_sinks_forward(ctx, sink_args(q, options), out.raw(), lse.data<float>(),
                                    options.sinks.data<float>());
  });
  dispatch_cpu_float(op, q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    cpu::attention_forward<T>(shape_of(q, k, cu_seqlens, options), q.data<T>(), k.data<T>(), v.data<T>(),
                              out.data<T>(), lse.data<T>(), sink_data<T>(options.sinks));
  });
}

void attention_backward(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, const Tensor& cu_seqlens, const AttentionOptions& options,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dsinks) {
  const char* op = "attention_backward";
  KILN_OP_SCOPE(op, q);
  validate(op, q, k, v, cu_seqlens);
  expect_like(op, "out", out, q, q.shape());
  expect_like(op, "dout", dout, q, q.shape());
  expect_lse(op, lse, q);
  expect_like(op, "dq", dq, q, q.shape());
  expect_like(op, "dk", dk, q, k.shape());
  expect_like(op, "dv", dv, q, v.shape());
  expect_sinks(op, options.sinks, q, lse);
  if (dsinks.defined()) {
    KILN_CHECK(options.sinks.defined(), op, "dsinks given without sinks");
    expect_shape(op, "dsinks", dsinks, options.sinks.shape());
    expect_same(op, "dsinks", dsinks, options.sinks);
  }
  expect_dropout(op, q, options);
  KILN_ON_CUDA(q, op, {
    const cuda::AttentionArgs args = cuda_args(q, k, cu_seqlens, options);
    if (is_mixed(q))
      cuda::attention_backward_bf16(ctx, args, max_seqlen_of(op, options), bf16_data(q), bf16_data(k), bf16_data(v),
                                    bf16_data(out), lse.data<float>(), bf16_data(dout), bf16_data(dq), bf16_data(dk),
                                    bf16_data(dv));
    else
      cuda::attention_backward_f32(ctx, args, q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(),
                                   lse.data<float>(), dout.data<float>(), dq.data<float>(), dk.data<float>(),
                                   dv.data<float>());
    // out and lse are the forward's corrected O' and lse', so the kernels above already
    // gave the sink-inclusive dq, dk, dv; the sinks' own gradient is one reduction more.
    if (dsinks.defined())
      cuda::attention_sinks_backward(ctx, sink_args(q, options), out.raw(), lse.data<float>(), dout.raw(),
                                     options.sinks.data<float>(), dsinks.data<float>());
  });
  dispatch_cpu_float(op, q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    cpu::attention_backward<T>(shape_of(q, k, cu_seqlens, options), q.data<T>(), k.data<T>(), v.data<T>(),
                               out.data<T>(), lse.data<T>(), dout.data<T>(), dq.data<T>(), dk.data<T>(),
                               dv.data<T>(), sink_data<T>(options.sinks), sink_data<T>(dsinks));
  });
}

}  // namespace kiln::ops
