#include "nn/block.h"

#include "ops/elementwise/elementwise.h"

namespace kiln {

TransformerBlock::TransformerBlock(BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position)
    : workspace_(ctx.workspace), compute_dtype_(ctx.dtype), mixed_(ctx.mixed()) {
  const ModelConfig& m = *layer.model;
  const int64_t t = ctx.max_tokens;
  attn_norm_ = norm_registry().build("model.norm", m.norm, ctx,
                                     NormSpec{layer.prefix + ".attn_norm", m.hidden, t, m.norm_eps});
  attention_ = attention_registry().build("model.attention", m.attention, ctx, layer, position);
  mlp_norm_ = norm_registry().build("model.norm", m.norm, ctx,
                                    NormSpec{layer.prefix + ".mlp_norm", m.hidden, t, m.norm_eps});
  mlp_ = mlp_registry().build("model.mlp", m.mlp, ctx, layer);
  ctx.saved_wide(mid_, Shape{t, m.hidden});  // residual stream between the branches
  // Scratch, one [t, hidden] each: the norm output a branch reads (recomputed in backward
  // rather than saved: one cheap pass) and the branch output (forward) or the branch input
  // gradient (backward).
  const size_t row_block = Workspace::footprint(ctx.dtype, Shape{t, m.hidden});
  ctx.workspace.reserve_peak(2 * row_block, Workspace::Level::outer);
}

void TransformerBlock::forward(const Tensor& x, const SeqInfo& seq, const Tensor& y) {
  const int64_t t = x.size(0);
  Tensor mid = mid_.rows(0, t);
  Workspace::Scope scope(workspace_);
  Tensor normed = scope.take(compute_dtype_, x.shape());
  Tensor branch = scope.take(compute_dtype_, x.shape());
  attn_norm_->forward(x, normed);
  attention_->forward(normed, seq, branch);
  mlp_norm_->forward_add(x, branch, mid, normed);  // mid = x + branch, normed = norm2(mid)
  mlp_->forward(normed, branch);
  ops::add(mid, branch, y);
}

void TransformerBlock::backward(const Tensor& dres, const Tensor& dres_compute, const SeqInfo& seq) {
  Workspace::Scope scope(workspace_);
  Tensor normed = scope.take(compute_dtype_, dres.shape());
  Tensor dbranch_in = scope.take(compute_dtype_, dres.shape());
  // On the mixed path every accumulation into the fp32 dres also rewrites its bf16 copy.
  const Tensor copy = mixed_ ? dres_compute : Tensor();
  // y = h + mlp(norm2(h)): dL/dh = dres + norm2'(mlp'(dres)), accumulated into dres.
  mlp_norm_->recompute(normed);
  mlp_->backward(normed, dres_compute, dbranch_in);
  mlp_norm_->backward(dbranch_in, dres, true, copy);
  // h = x + attn(norm1(x)): same again.
  attn_norm_->recompute(normed);
  attention_->backward(normed, dres_compute, seq, dbranch_in);
  attn_norm_->backward(dbranch_in, dres, true, copy);
}

}  // namespace kiln
