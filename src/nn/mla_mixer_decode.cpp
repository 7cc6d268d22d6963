// The decode side of MlaMixer (nn/mla_mixer.h): a cache of the latent c [slots, max_len, r]
// per layer, r numbers per position where k and v would take H (d_qk + d_v). Each step's
// rows write their latents, then attend with W_kb absorbed into the query (q' = W_kb,h^T q_h,
// so q'.c_t = q_h.k_t) and W_vb applied after the weighted sum (o_h = W_vb,h sum_t p_t c_t):
// the cached attention op over one shared "key head" c, which serves as its own value.
#include "nn/mla_mixer.h"
#include "nn/slot_state.h"
#include "ops/attention/cached_attention.h"
#include "ops/linear/linear.h"
#include "ops/mla/mla_absorb.h"
#include "ops/rms_norm/rms_norm.h"

namespace kiln {

class MlaDecoder final : public BranchDecoder {
 public:
  MlaDecoder(const MlaMixer& a, DecodeContext& ctx) : a_(a), exec_(ctx.exec), workspace_(ctx.workspace), dtype_(ctx.dtype) {
    // Decoders are made on the CPU only (make_decoder), where the compute dtype is the wide one.
    KILN_CHECK(ctx.dtype == ctx.wide, a.key_, "'mla' decodes in one dtype (got compute {} and wide {})",
               dtype_name(ctx.dtype), dtype_name(ctx.wide));
    ctx.state.reserve(cache_, ctx.dtype, Shape{ctx.slots, ctx.max_len, 1, a.rank_});
    options_.scale = a.options_.scale;
    const int64_t r = ctx.max_rows;
    auto bytes = [&](Shape s) { return Workspace::footprint(ctx.dtype, s); };
    // q, the latent and its rstd, q', the weighted latents, the head outputs.
    ctx.workspace.reserve_peak(bytes(Shape{r, a.h_ * a.dqk_}) + 2 * bytes(Shape{r, a.rank_}) + bytes(Shape{r}) +
                               2 * bytes(Shape{r, a.h_, a.rank_}) + bytes(Shape{r, a.h_ * a.dv_}));
  }

  void forward(const Tensor& h, const DecodeRows& rows, const Tensor& out) override {
    const MlaMixer& a = a_;
    const int64_t n = rows.count;
    Workspace::Scope scope(workspace_);
    const Tensor q = scope.take(dtype_, Shape{n, a.h_, a.dqk_});
    ops::linear_forward(exec_, h, a.q_w_, Tensor(), q.view(Shape{n, a.h_ * a.dqk_}));
    // The rows' latents into the cache (one tensor as both "keys" and "values").
    const Tensor raw = scope.take(dtype_, Shape{n, a.rank_}), c = scope.take(dtype_, Shape{n, 1, a.rank_});
    ops::linear_forward(exec_, h, a.kva_w_, Tensor(), raw);
    ops::rms_norm_forward(exec_, raw, a.gain_, a.norm_eps_, c.view(Shape{n, a.rank_}), scope.take(dtype_, Shape{n}));
    ops::kv_cache_write(exec_, c, c, rows.slots, rows.positions, cache_, cache_);
    const Tensor q_abs = scope.take(dtype_, Shape{n, a.h_, a.rank_}), cbar = scope.take(dtype_, Shape{n, a.h_, a.rank_});
    ops::mla_absorb_query(exec_, q, a.k_rows(a.kvb_w_), q_abs);
    ops::cached_attention_forward(exec_, q_abs, cache_, cache_, rows.slots, rows.positions, options_, cbar);
    const Tensor o = scope.take(dtype_, Shape{n, a.h_, a.dv_});
    ops::mla_expand_values(exec_, cbar, a.v_rows(a.kvb_w_), o);
    ops::linear_forward(exec_, o.view(Shape{n, a.h_ * a.dv_}), a.o_w_, Tensor(), out);
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
  DType dtype_;
  ops::AttentionOptions options_;  // scale 1/sqrt(d_qk)
  Tensor cache_;                   // [slots, max_len, 1, r]: the normed latents
};

std::unique_ptr<BranchDecoder> MlaMixer::make_decoder(DecodeContext& ctx, const Norm& pre_norm) const {
  (void)pre_norm;  // no fused decode branch: the norm runs on its own
  KILN_CHECK(ctx.device == Device::cpu, key_, "'mla' decodes on the CPU only for now (its absorbed products have no CUDA kernels yet)");
  return std::make_unique<MlaDecoder>(*this, ctx);
}

}  // namespace kiln
