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
  ctx.saved(attn_in_, Shape{t, m.hidden});   // norm outputs: what the branches read
  ctx.saved_wide(mid_, Shape{t, m.hidden});  // residual stream
  ctx.saved(mlp_in_, Shape{t, m.hidden});
  // Branch outputs (forward) and branch input gradients (backward): one [t, hidden] each;
  // on the mixed path also the bf16 copy of the residual gradient the branches read.
  const size_t row_block = Workspace::footprint(ctx.dtype, Shape{t, m.hidden});
  ctx.workspace.reserve_peak(mixed_ ? 2 * row_block : row_block, Workspace::Level::outer);
}

void TransformerBlock::forward(const Tensor& x, const SeqInfo& seq, const Tensor& y) {
  const int64_t t = x.size(0);
  Tensor attn_in = attn_in_.rows(0, t), mid = mid_.rows(0, t), mlp_in = mlp_in_.rows(0, t);
  attn_norm_->forward(x, attn_in);
  {
    Workspace::Scope scope(workspace_);
    Tensor branch = scope.take(compute_dtype_, x.shape());
    attention_->forward(attn_in, seq, branch);
    ops::add(x, branch, mid);
  }
  mlp_norm_->forward(mid, mlp_in);
  Workspace::Scope scope(workspace_);
  Tensor branch = scope.take(compute_dtype_, x.shape());
  mlp_->forward(mlp_in, branch);
  ops::add(mid, branch, y);
}

void TransformerBlock::backward(const Tensor& dres, const SeqInfo& seq) {
  Workspace::Scope scope(workspace_);
  Tensor dbranch_in = scope.take(compute_dtype_, dres.shape());
  // The branches read the residual gradient in the compute dtype (a bf16 copy on the
  // mixed path, refreshed after each accumulation into the fp32 dres).
  const Tensor dres_compute = mixed_ ? scope.take(compute_dtype_, dres.shape()) : dres;
  // y = h + mlp(norm2(h)): dL/dh = dres + norm2'(mlp'(dres)), accumulated into dres.
  if (mixed_) ops::convert(dres, dres_compute);
  mlp_->backward(dres_compute, dbranch_in);
  mlp_norm_->backward(dbranch_in, dres, true);
  // h = x + attn(norm1(x)): same again.
  if (mixed_) ops::convert(dres, dres_compute);
  attention_->backward(dres_compute, seq, dbranch_in);
  attn_norm_->backward(dbranch_in, dres, true);
}

}  // namespace kiln
