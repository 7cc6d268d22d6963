#include "nn/block.h"

#include "ops/dropout/dropout.h"
#include "ops/elementwise/elementwise.h"

namespace kiln {

TransformerBlock::TransformerBlock(BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position)
    : exec_(ctx.exec), workspace_(ctx.workspace), compute_dtype_(ctx.dtype), mixed_(ctx.mixed()) {
  const ModelConfig& m = *layer.model;
  dropout_ = m.dropout;
  attention_site_ = static_cast<uint32_t>(1 + 2 * layer.index);  // site 0 is the embedding's
  mlp_site_ = attention_site_ + 1;
  const int64_t t = ctx.max_tokens;
  attn_norm_ = norm_registry().build("model.norm", m.norm, ctx,
                                     NormSpec{layer.names.child("attn_norm.", "input_layernorm.", "attn_norm."),
                                              m.hidden, t, m.norm_eps, m.dyt_alpha});
  attention_ = attention_registry().build("model.attention", m.attention, ctx, layer, position);
  mlp_norm_ = norm_registry().build("model.norm", m.norm, ctx,
                                    NormSpec{layer.names.child("mlp_norm.", "post_attention_layernorm.", "ffn_norm."),
                                             m.hidden, t, m.norm_eps, m.dyt_alpha});
  const char* mlp_key = layer.choices.mlp == m.mlp ? "model.mlp" : "model.alt_mlp";
  mlp_ = mlp_registry().build(mlp_key, layer.choices.mlp, ctx, layer);
  ctx.saved_wide(mid_, Shape{t, m.hidden});  // residual stream between the branches
  // Scratch, one [t, hidden] each: the norm output a branch reads (recomputed in backward
  // rather than saved: one cheap pass) and the branch output (forward) or the branch input
  // gradient (backward); with dropout a third, the branch output's dropped gradient.
  const size_t row_block = Workspace::footprint(ctx.dtype, Shape{t, m.hidden});
  ctx.workspace.reserve_peak((dropout_ > 0 ? 3 : 2) * row_block, Workspace::Level::outer);
}

void TransformerBlock::forward(const Tensor& x, const SeqInfo& seq, const Tensor& y) {
  const int64_t t = x.size(0);
  Tensor mid = mid_.rows(0, t);
  Workspace::Scope scope(workspace_);
  Tensor normed = scope.take(compute_dtype_, x.shape());
  Tensor branch = scope.take(compute_dtype_, x.shape());
  attn_norm_->forward(x, normed);
  attention_->forward(normed, seq, branch);
  if (drops(seq)) ops::dropout_apply(exec_, branch, {dropout_, attention_site_, seq.dropout_key}, branch);
  mlp_norm_->forward_add(x, branch, mid, normed);  // mid = x + branch, normed = norm2(mid)
  mlp_->forward(normed, branch);
  if (drops(seq)) ops::dropout_apply(exec_, branch, {dropout_, mlp_site_, seq.dropout_key}, branch);
  ops::add(exec_, mid, branch, y);
}

void TransformerBlock::backward(const Tensor& dres, const Tensor& dres_compute, const SeqInfo& seq) {
  Workspace::Scope scope(workspace_);
  Tensor normed = scope.take(compute_dtype_, dres.shape());
  Tensor dbranch_in = scope.take(compute_dtype_, dres.shape());
  // On the mixed path every accumulation into the fp32 dres also rewrites its bf16 copy.
  const Tensor copy = mixed_ ? dres_compute : Tensor();
  // A dropped branch's output gradient: dres through the forward's mask (found again).
  const Tensor dropped = drops(seq) ? scope.take(compute_dtype_, dres.shape()) : Tensor();
  auto branch_grad = [&](uint32_t site) {
    if (!dropped.defined()) return dres_compute;
    ops::dropout_apply(exec_, dres_compute, {dropout_, site, seq.dropout_key}, dropped);
    return dropped;
  };
  // y = h + mlp(norm2(h)): dL/dh = dres + norm2'(mlp'(dres)), accumulated into dres.
  mlp_norm_->recompute(normed);
  mlp_->backward(normed, branch_grad(mlp_site_), dbranch_in);
  mlp_norm_->backward(dbranch_in, dres, true, copy);
  // h = x + attn(norm1(x)): same again.
  attn_norm_->recompute(normed);
  attention_->backward(normed, branch_grad(attention_site_), seq, dbranch_in);
  attn_norm_->backward(dbranch_in, dres, true, copy);
}

std::unique_ptr<BlockDecoder> TransformerBlock::make_decoder(DecodeContext& ctx) const {
  return std::make_unique<BlockDecoder>(ctx.exec, attn_norm_->make_decoder(ctx),
                                        attention_->make_decoder(ctx, *attn_norm_),
                                        mlp_norm_->make_decoder(ctx), mlp_->make_decoder(ctx, *mlp_norm_),
                                        ctx.mixed());
}

void TransformerBlock::export_config(ExportConfig& out) const {
  attn_norm_->export_config(out);
  attention_->export_config(out);
  mlp_norm_->export_config(out);
  mlp_->export_config(out);
}

double TransformerBlock::extra_forward_flops_per_token(int64_t seq_len) const {
  return attention_->extra_forward_flops_per_token(seq_len);
}

BlockDecoder::BlockDecoder(const ExecContext& exec, std::unique_ptr<NormDecoder> attn_norm,
                           std::unique_ptr<BranchDecoder> attention, std::unique_ptr<NormDecoder> mlp_norm,
                           std::unique_ptr<BranchDecoder> mlp, bool mixed)
    : exec_(exec),
      attn_norm_(std::move(attn_norm)),
      mlp_norm_(std::move(mlp_norm)),
      attention_(std::move(attention)),
      mlp_(std::move(mlp)),
      mixed_(mixed) {}

void BlockDecoder::forward(DecodeStepBuffers& s, const DecodeRows& rows) {
  branch(*attn_norm_, *attention_, s, rows);
  branch(*mlp_norm_, *mlp_, s, rows);
}

// One pre-norm branch: x += branch(norm(x)). On the fused projections the branch reads x
// through its norm and adds into x itself; otherwise the norm adds the pending output of the
// branch before (one pass) and this branch's output is left pending for the next norm.
void BlockDecoder::branch(NormDecoder& norm, BranchDecoder& branch, DecodeStepBuffers& s, const DecodeRows& rows) {
  if (rows.fused_branches && branch.fused_branch()) {
    if (s.pending) residual_add(exec_, s.x, s.branch, mixed_);
    s.pending = false;
    branch.forward_fused(s.x, rows);
    return;
  }
  norm.add_norm(s.x, s.pending ? s.branch : Tensor(), s.h);
  branch.forward(s.h, rows, s.branch);
  s.pending = true;
}

void residual_add(const ExecContext& exec, const Tensor& x, const Tensor& branch, bool mixed) {
  mixed ? ops::add(exec, x, branch, x) : ops::add_inplace(exec, x, branch);
}

}  // namespace kiln
