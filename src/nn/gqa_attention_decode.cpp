// The decode side of GqaAttention (nn/gqa_attention.h): a KV cache per layer and the
// attention of a step's rows against it.
//
// Unfused (the reference): the module's own ops over the step's rows: the q|k|v projection,
// qkv_prepare at the rows' positions, the cache write, cached attention, the output
// projection. With the GPU's fused kernels: q/k norm + RoPE + cache write as one kernel;
// and for the captured decode steps the whole branch on the fused projections (the
// pre-norm folded into the q|k|v product, the residual add into the output product) with
// the attention of distinct sequences as one kernel (ops/decode/decode_kernels.h).
#include "core/op_profiler.h"
#include "nn/gqa_attention.h"
#include "nn/slot_state.h"
#include "ops/attention/cached_attention.h"

#if KILN_WITH_CUDA
#include "ops/decode/decode_kernels.h"
#endif

#include <algorithm>
#include <cmath>

namespace kiln {

class GqaDecoder final : public BranchDecoder {
 public:
  GqaDecoder(const GqaAttention& a, DecodeContext& ctx, const Norm& pre_norm)
      : a_(a), exec_(ctx.exec), workspace_(ctx.workspace), dtype_(ctx.dtype), max_len_(ctx.max_len) {
    const int64_t r = ctx.max_rows, hq = a.hq_, hkv = a.hkv_, d = a.d_;
    ctx.state.reserve(k_cache_, ctx.dtype, Shape{ctx.slots, ctx.max_len, hkv, d});
    ctx.state.reserve(v_cache_, ctx.dtype, Shape{ctx.slots, ctx.max_len, hkv, d});
    options_.window = a.options_.window;
    options_.softcap = a.options_.softcap;
    // The parameter itself (f32 on the GPU): decode sees its current values. Every attention
    // kernel below (cached attention, its split merge, the one-kernel decode) adds the sink
    // where it normalizes the softmax.
    options_.sinks = a.options_.sinks;
    if (a.rotary_) rotary_ = a.position_.rotary();  // filled now, not inside a captured step
    // The split partials of cached attention on the GPU: the most any row count needs.
    if (ctx.device == Device::cuda)
      for (int64_t n = 1; n <= r; ++n)
        split_elems_ = std::max(split_elems_, ops::cached_attention_workspace(n, hq, hkv, d, ctx.max_len));
    auto bytes = [&](Shape s) { return Workspace::footprint(ctx.dtype, s); };
    const size_t raw_qk = a.dyt() ? bytes(Shape{r, hq, d}) + bytes(Shape{r, hkv, d}) : 0;
    ctx.workspace.reserve_peak(bytes(Shape{r, a.qkv_cols_}) + bytes(Shape{r, hq, d}) * 2 + bytes(Shape{r, hkv, d}) * 2 +
                               raw_qk + Workspace::footprint(DType::f32, Shape{std::max<int64_t>(split_elems_, 1)}));
    // The fused kernels compute an RMSNorm on q and k (any gain), not DyT.
    fuse_ = ctx.device == Device::cuda && ctx.fuse && !a.dyt();
#if KILN_WITH_CUDA
    const std::optional<RmsNormForm> norm = pre_norm.rms_form();
    const int64_t rows = std::min<int64_t>(ctx.fused_branch_rows, r);
    fused_branch_ = fuse_ && rows > 0 && dtype_ == DType::bf16 && norm && !a.bias_ &&
                    cuda::decode_gemv_fits(rows, a.hidden_) && cuda::decode_gemv_fits(rows, hq * d);
    if (fused_branch_) norm_ = *norm;
    one_kernel_ = fused_branch_ && ctx.one_kernel_attention && cuda::decode_attention_fits(hq, hkv, d);
#else
    (void)pre_norm;
#endif
  }

  void forward(const Tensor& h, const DecodeRows& rows, const Tensor& out) override {
    const int64_t n = rows.count;
    Workspace::Scope scope(workspace_);
    const Tensor qkv = scope.take(dtype_, Shape{n, a_.qkv_cols_});
    const Tensor o = scope.take(dtype_, Shape{n, a_.hq_, a_.d_});
    a_.qkv_proj_.forward(exec_, h, qkv);
    attend(qkv, rows, o, scope);
    a_.o_proj_.forward(exec_, o.view(Shape{n, a_.hq_ * a_.d_}), out);
  }

  // The caches are positional: a new sequence writes each position before it reads it, so
  // a reused slot needs no reset; a shared prefill copies the prompt's positions (the fused
  // kernels read the same [slots, max_len, Hkv, D] layout, so they need nothing more).
  void reset_slot(int32_t slot) override { (void)slot; }
  void copy_slot(int32_t from, int32_t to, int64_t positions) override {
    copy_slot_positions(k_cache_, from, to, positions);
    copy_slot_positions(v_cache_, from, to, positions);
  }

  bool fused_branch() const override { return fused_branch_; }

  void forward_fused([[maybe_unused]] const Tensor& x, [[maybe_unused]] const DecodeRows& rows) override {
#if KILN_WITH_CUDA
    const int64_t n = rows.count, hq = a_.hq_, d = a_.d_, hidden = a_.hidden_;
    Workspace::Scope scope(workspace_);
    const Tensor qkv = scope.take(dtype_, Shape{n, a_.qkv_cols_});
    const Tensor o = scope.take(dtype_, Shape{n, hq, d});
    {
      OpScope op("norm + qkv projection (fused)", Device::cuda);
      cuda::norm_gemv(exec_, dtype_, x.data<float>(), norm_.gain.data<float>(), static_cast<float>(norm_.eps), n, hidden,
                      a_.qkv_proj_.weight().raw(), a_.qkv_cols_, qkv.raw());
    }
    if (one_kernel_ && rows.distinct_slots) {
      a_.form_gemma_gains();
      OpScope op("attention with q/k norm, RoPE, cache write (fused)", Device::cuda);
      cuda::decode_attention(exec_, one_kernel_args(qkv, rows, o));
    } else {
      attend(qkv, rows, o, scope);
    }
    OpScope op("o projection + residual (fused)", Device::cuda);
    cuda::gemv_add_residual(exec_, o.raw(), n, hq * d, a_.o_proj_.weight().raw(), hidden, x.data<float>());
#endif
  }

 private:
  // qkv [n, (Hq + 2 Hkv) D] of the step's rows -> the caches at the rows' (slot, position),
  // and o [n, Hq, D] = their attention over the cache.
  void attend(const Tensor& qkv, const DecodeRows& rows, const Tensor& o, Workspace::Scope& scope) {
    const int64_t n = rows.count, hq = a_.hq_, hkv = a_.hkv_, d = a_.d_;
    const Tensor q = scope.take(dtype_, Shape{n, hq, d});
    if (fuse_) {
#if KILN_WITH_CUDA
      a_.form_gemma_gains();
      OpScope op("qkv_to_cache (fused)", Device::cuda);
      cuda::qkv_to_cache(exec_, dtype_, qkv.raw(), n, hq, hkv, d, gain(a_.prepare_.q_gain), gain(a_.prepare_.k_gain),
                         static_cast<float>(a_.prepare_.eps), gain(rotary_.cos), gain(rotary_.sin),
                         rows.slots.data<int32_t>(), rows.positions.data<int32_t>(), max_len_, q.raw(),
                         k_cache_.raw(), v_cache_.raw());
#endif
    } else {
      const Tensor k = scope.take(dtype_, Shape{n, hkv, d}), v = scope.take(dtype_, Shape{n, hkv, d});
      const Tensor q_raw = a_.dyt() ? scope.take(dtype_, q.shape()) : Tensor();
      const Tensor k_raw = a_.dyt() ? scope.take(dtype_, k.shape()) : Tensor();
      a_.prepare_qkv(qkv, rows.positions, q, k, v, q_raw, k_raw);
      ops::kv_cache_write(exec_, k, v, rows.slots, rows.positions, k_cache_, v_cache_);
    }
    const Tensor split = split_elems_ > 0 ? scope.take(DType::f32, Shape{split_elems_}) : Tensor();
    ops::cached_attention_forward(exec_, q, k_cache_, v_cache_, rows.slots, rows.positions, options_, o, split);
  }

#if KILN_WITH_CUDA
  static const float* gain(const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; }

  cuda::DecodeAttentionArgs one_kernel_args(const Tensor& qkv, const DecodeRows& rows, const Tensor& o) const {
    cuda::DecodeAttentionArgs p{};
    p.rows = rows.count, p.q_heads = a_.hq_, p.kv_heads = a_.hkv_, p.head_dim = a_.d_, p.max_len = max_len_;
    p.qkv = qkv.raw();
    p.q_gain = gain(a_.prepare_.q_gain), p.k_gain = gain(a_.prepare_.k_gain);
    p.eps = static_cast<float>(a_.prepare_.eps);
    p.cos = gain(rotary_.cos), p.sin = gain(rotary_.sin);
    p.slots = rows.slots.data<int32_t>(), p.positions = rows.positions.data<int32_t>();
    // As the cached_attention front end: 1/sqrt(D) in double, then rounded.
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(a_.d_)));
    p.window = options_.window, p.softcap = static_cast<float>(options_.softcap);
    p.k_cache = k_cache_.raw(), p.v_cache = v_cache_.raw();
    p.out = o.raw();
    p.sinks = options_.sinks.defined() ? options_.sinks.data<float>() : nullptr;
    return p;
  }
#endif

  const GqaAttention& a_;
  const ExecContext& exec_;
  Workspace& workspace_;
  DType dtype_;
  int64_t max_len_;
  ops::AttentionOptions options_;  // the layer's window, softcap and sinks
  RotaryTables rotary_;            // undefined on NoPE layers
  Tensor k_cache_, v_cache_;       // [slots, max_len, Hkv, D]
  int64_t split_elems_ = 0;        // f32 elements of cached attention's split partials (GPU)
  bool fuse_ = false, fused_branch_ = false, one_kernel_ = false;
  RmsNormForm norm_;               // the pre-norm folded into the fused branch
};

std::unique_ptr<BranchDecoder> GqaAttention::make_decoder(DecodeContext& ctx, const Norm& pre_norm) const {
  return std::make_unique<GqaDecoder>(*this, ctx, pre_norm);
}

}  // namespace kiln
