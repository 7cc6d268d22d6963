// The decode side of MlaMixer (nn/mla_mixer.h): a cache of the latent c [slots, max_len, r]
// per layer, r numbers per position where k and v would take H (d_qk + d_v). Each step's
// rows write their latents, then attend with W_kb absorbed into the query (q' = W_kb,h^T q_h,
// so q'.c_t = q_h.k_t) and W_vb applied after the weighted sum (o_h = W_vb,h sum_t p_t c_t):
// the cached attention op over one shared "key head" c, which serves as its own value.
//
// The same ops run on the CPU (f32, f64) and the GPU (f32, or bf16 activations, weights and
// cache with the latent norm's gain and rstd fp32): linear, rms_norm, kv_cache_write,
// cached_attention (its GPU kernel takes latents up to 512 wide) and the absorbed products
// (ops/mla/mla_absorb.h). Everything is planned here and only enqueued in a step, so the
// GPU's decode steps can be captured as CUDA graphs. No fused decode branch.
#include "nn/mla_mixer.h"
#include "nn/slot_state.h"
#include "ops/attention/attention_cpu.h"
#include "ops/attention/cached_attention.h"
#include "ops/mla/mla_absorb.h"
#include "ops/rms_norm/rms_norm.h"

#include <algorithm>

namespace kiln {

class MlaDecoder final : public BranchDecoder {
 public:
  MlaDecoder(const MlaMixer& a, DecodeContext& ctx)
      : a_(a), exec_(ctx.exec), workspace_(ctx.workspace), dtype_(ctx.dtype), wide_(ctx.wide) {
    ctx.state.reserve(cache_, ctx.dtype, Shape{ctx.slots, ctx.max_len, 1, a.rank_});
    options_.scale = a.options_.scale;
    const int64_t r = ctx.max_rows;
    // The split partials of cached attention on the GPU: the most any row count needs.
    if (ctx.device == Device::cuda)
      for (int64_t n = 1; n <= r; ++n)
        split_elems_ = std::max(split_elems_, ops::cached_attention_workspace(n, a.h_, 1, a.rank_, ctx.max_len));
    auto bytes = [&](Shape s) { return Workspace::footprint(ctx.dtype, s); };
    // q, the latent, its rstd (wide), q', the weighted latents, the head outputs, the splits.
    ctx.workspace.reserve_peak(bytes(Shape{r, a.h_ * a.dqk_}) + 2 * bytes(Shape{r, a.rank_}) +
                               Workspace::footprint(ctx.wide, Shape{r}) + 2 * bytes(Shape{r, a.h_, a.rank_}) +
                               bytes(Shape{r, a.h_ * a.dv_}) +
                               Workspace::footprint(DType::f32, Shape{std::max<int64_t>(split_elems_, 1)}));
  }

  void forward(const Tensor& h, const DecodeRows& rows, const Tensor& out) override {
    const MlaMixer& a = a_;
    const int64_t n = rows.count;
    Workspace::Scope scope(workspace_);
    const Tensor q = scope.take(dtype_, Shape{n, a.h_, a.dqk_});
    a.q_proj_.forward(exec_, h, q.view(Shape{n, a.h_ * a.dqk_}));
    // The rows' latents into the cache (one tensor as both "keys" and "values").
    const Tensor raw = scope.take(dtype_, Shape{n, a.rank_}), c = scope.take(dtype_, Shape{n, 1, a.rank_});
    a.kv_a_proj_.forward(exec_, h, raw);
    ops::rms_norm_forward(exec_, raw, a.gain_, a.norm_eps_, c.view(Shape{n, a.rank_}), scope.take(wide_, Shape{n}));
    ops::kv_cache_write(exec_, c, c, rows.slots, rows.positions, cache_, cache_);
    const Tensor q_abs = scope.take(dtype_, Shape{n, a.h_, a.rank_}), cbar = scope.take(dtype_, Shape{n, a.h_, a.rank_});
    ops::mla_absorb_query(exec_, q, a.k_up().weight(), q_abs);
    const Tensor split = split_elems_ > 0 ? scope.take(DType::f32, Shape{split_elems_}) : Tensor();
    ops::cached_attention_forward(exec_, q_abs, cache_, cache_, rows.slots, rows.positions, options_, cbar, split);
    const Tensor o = scope.take(dtype_, Shape{n, a.h_, a.dv_});
    ops::mla_expand_values(exec_, cbar, a.v_up().weight(), o);
    a.o_proj_.forward(exec_, o.view(Shape{n, a.h_ * a.dv_}), out);
  }

  // A positional cache: a new sequence writes each position before reading it (no reset);
  // a shared prefill copies the prompt's positions.
  void reset_slot(int32_t slot) override { (void)slot; }
  void copy_slot(int32_t from, int32_t to, int64_t positions) override {
    copy_slot_positions(cache_, from, to, positions);
  }

 private:
  const MlaMixer& a_;
  const ExecContext& exec_;
  Workspace& workspace_;
  DType dtype_, wide_;             // compute (activations, weights, cache); the norm's rstd
  ops::AttentionOptions options_;  // scale 1/sqrt(d_qk)
  Tensor cache_;                   // [slots, max_len, 1, r]: the normed latents
  int64_t split_elems_ = 0;        // f32 elements of cached attention's split partials (GPU)
};

std::unique_ptr<BranchDecoder> MlaMixer::make_decoder(DecodeContext& ctx, const Norm& pre_norm) const {
  (void)pre_norm;  // no fused decode branch: the norm runs on its own
  // The latent is the cached attention's head: its kernels (and the CPU's) take at most 512.
  KILN_CHECK(rank_ <= cpu::kMaxAttentionHeadDim, "model.mla.kv_rank",
             "= {}: 'mla' decodes over latents at most {} wide", rank_, cpu::kMaxAttentionHeadDim);
  return std::make_unique<MlaDecoder>(*this, ctx);
}

}  // namespace kiln
