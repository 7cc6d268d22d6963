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
  const NormSpec base{layer.names, m.hidden, t, m.norm_eps, m.dyt_alpha};
  auto norm = [&](const char* kiln, const char* hf, const char* gguf) {
    NormSpec spec = base;
    spec.names = layer.names.child(kiln, hf, gguf);
    return norm_registry().build("model.norm", m.norm, ctx, spec);
  };
  const bool sandwich = m.sandwich_norms;
  attn_norm_ = norm("attn_norm.", "input_layernorm.", "attn_norm.");
  mixer_ = mixer_registry().build(mixer_key(layer), layer.choices.mixer, ctx, layer, position);
  // Gemma 2/3 name the MLP's pre-norm pre_feedforward_layernorm and give post_attention_
  // layernorm to the attention's post-norm; Llama/Qwen call the MLP's pre-norm that.
  mlp_norm_ = sandwich ? norm("mlp_norm.", "pre_feedforward_layernorm.", "ffn_norm.")
                       : norm("mlp_norm.", "post_attention_layernorm.", "ffn_norm.");
  if (sandwich) {
    post_attn_norm_ = norm("post_attn_norm.", "post_attention_layernorm.", "post_attention_norm.");
    post_mlp_norm_ = norm("post_mlp_norm.", "post_feedforward_layernorm.", "post_ffw_norm.");
  }
  const char* mlp_key = layer.choices.mlp == m.mlp ? "model.mlp" : "model.alt_mlp";
  mlp_ = mlp_registry().build(mlp_key, layer.choices.mlp, ctx, layer);
  ctx.saved_wide(mid_, Shape{t, m.hidden});  // residual stream between the branches
  if (sandwich) {
    ctx.saved(attn_out_, Shape{t, m.hidden});
    ctx.saved(mlp_out_, Shape{t, m.hidden});
  }
  // Scratch, one [t, hidden] each: the norm output a branch reads (recomputed in backward
  // rather than saved: one cheap pass) and the branch output (forward) or the branch input
  // gradient (backward); with dropout a third, the branch output's dropped gradient; with
  // sandwich norms one more, the gradient through the post-norm.
  const size_t row_block = Workspace::footprint(ctx.dtype, Shape{t, m.hidden});
  const size_t blocks = 2 + (dropout_ > 0 ? 1 : 0) + (sandwich ? 1 : 0);
  ctx.workspace.reserve_peak(blocks * row_block, Workspace::Level::outer);
}

void TransformerBlock::forward(const Tensor& x, const SeqInfo& seq, const Tensor& y) {
  const int64_t t = x.size(0);
  Tensor mid = mid_.rows(0, t);
  Workspace::Scope scope(workspace_);
  Tensor normed = scope.take(compute_dtype_, x.shape());
  Tensor branch = scope.take(compute_dtype_, x.shape());
  // With sandwich norms a branch writes its saved output, which its post-norm reads into branch.
  const Tensor attn_out = post_attn_norm_ ? attn_out_.rows(0, t) : branch;
  const Tensor mlp_out = post_mlp_norm_ ? mlp_out_.rows(0, t) : branch;
  attn_norm_->forward(x, normed);
  mixer_->forward(normed, seq, attn_out);
  if (post_attn_norm_) post_attn_norm_->forward(attn_out, branch);
  if (drops(seq)) ops::dropout_apply(exec_, branch, {dropout_, attention_site_, seq.dropout_key}, branch);
  mlp_norm_->forward_add(x, branch, mid, normed);  // mid = x + branch, normed = norm2(mid)
  mlp_->forward(normed, mlp_out);
  if (post_mlp_norm_) post_mlp_norm_->forward(mlp_out, branch);
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
  // The gradient at a branch's own output: through its post-norm when it has one.
  const Tensor dpost = post_attn_norm_ ? scope.take(compute_dtype_, dres.shape()) : Tensor();
  auto branch_grad = [&](uint32_t site, Norm* post) {
    Tensor g = dres_compute;
    if (dropped.defined()) {
      ops::dropout_apply(exec_, dres_compute, {dropout_, site, seq.dropout_key}, dropped);
      g = dropped;
    }
    if (post == nullptr) return g;
    post->backward(g, dpost, false);
    return dpost;
  };
  // y = h + mlp(norm2(h)): dL/dh = dres + norm2'(mlp'(dres)), accumulated into dres.
  const Tensor dmlp = branch_grad(mlp_site_, post_mlp_norm_.get());
  mlp_norm_->recompute(normed);
  mlp_->backward(normed, dmlp, dbranch_in);
  mlp_norm_->backward(dbranch_in, dres, true, copy);
  // h = x + attn(norm1(x)): same again.
  const Tensor dattn = branch_grad(attention_site_, post_attn_norm_.get());
  attn_norm_->recompute(normed);
  mixer_->backward(normed, dattn, seq, dbranch_in);
  attn_norm_->backward(dbranch_in, dres, true, copy);
}

void TransformerBlock::sublayer_forward(Sublayer which, const Tensor& input, const SeqInfo& seq, const Tensor& out) {
  const bool attention = which == Sublayer::attention;
  Norm& pre = attention ? *attn_norm_ : *mlp_norm_;
  Norm* post = attention ? post_attn_norm_.get() : post_mlp_norm_.get();
  const int64_t t = input.size(0);
  Workspace::Scope scope(workspace_);
  Tensor normed = scope.take(compute_dtype_, input.shape());
  // With a post-norm the branch writes its saved output, which the post-norm reads into out.
  const Tensor branch_out = post ? (attention ? attn_out_ : mlp_out_).rows(0, t) : out;
  pre.forward(input, normed);
  if (attention) {
    mixer_->forward(normed, seq, branch_out);
  } else {
    mlp_->forward(normed, branch_out);
  }
  if (post) post->forward(branch_out, out);
  const uint32_t site = attention ? attention_site_ : mlp_site_;
  if (drops(seq)) ops::dropout_apply(exec_, out, {dropout_, site, seq.dropout_key}, out);
}

void TransformerBlock::sublayer_backward(Sublayer which, const Tensor& dout, const SeqInfo& seq, const Tensor& dinput,
                                         bool accumulate) {
  const bool attention = which == Sublayer::attention;
  Norm& pre = attention ? *attn_norm_ : *mlp_norm_;
  Norm* post = attention ? post_attn_norm_.get() : post_mlp_norm_.get();
  Workspace::Scope scope(workspace_);
  Tensor normed = scope.take(compute_dtype_, dout.shape());
  Tensor dbranch_in = scope.take(compute_dtype_, dout.shape());
  Tensor g = dout;
  if (drops(seq)) {  // dout through the forward's mask (found again)
    const Tensor dropped = scope.take(compute_dtype_, dout.shape());
    ops::dropout_apply(exec_, dout, {dropout_, attention ? attention_site_ : mlp_site_, seq.dropout_key}, dropped);
    g = dropped;
  }
  if (post) {
    const Tensor dpost = scope.take(compute_dtype_, dout.shape());
    post->backward(g, dpost, false);
    g = dpost;
  }
  pre.recompute(normed);
  if (attention) {
    mixer_->backward(normed, g, seq, dbranch_in);
  } else {
    mlp_->backward(normed, g, dbranch_in);
  }
  pre.backward(dbranch_in, dinput, accumulate);
}

std::unique_ptr<BlockDecoder> TransformerBlock::make_decoder(DecodeContext& ctx) const {
  auto post = [&](const std::unique_ptr<Norm>& n) { return n ? n->make_decoder(ctx) : nullptr; };
  BranchDecoders mixer{attn_norm_->make_decoder(ctx), mixer_->make_decoder(ctx, *attn_norm_), post(post_attn_norm_)};
  BranchDecoders mlp{mlp_norm_->make_decoder(ctx), mlp_->make_decoder(ctx, *mlp_norm_), post(post_mlp_norm_)};
  if (post_attn_norm_)  // the post-norm's wide input on the mixed path (BlockDecoder::widened)
    ctx.workspace.reserve_peak(Workspace::footprint(ctx.wide, Shape{ctx.max_rows, mid_.size(1)}),
                               Workspace::Level::outer);
  return std::make_unique<BlockDecoder>(ctx, std::move(mixer), std::move(mlp));
}

void TransformerBlock::export_config(ExportConfig& out) const {
  attn_norm_->export_config(out);
  mixer_->export_config(out);
  mlp_norm_->export_config(out);
  mlp_->export_config(out);
  if (post_attn_norm_) {
    if (!out.is("gemma2") && !out.is("gemma3_text"))
      out.refuse("model.sandwich_norms", "true", "only Gemma 2/3 norm the branch outputs");
    post_attn_norm_->export_config(out);
    post_mlp_norm_->export_config(out);
  }
}

double TransformerBlock::extra_forward_flops_per_token(int64_t seq_len) const {
  return mixer_->extra_forward_flops_per_token(seq_len);
}

BlockDecoder::BlockDecoder(DecodeContext& ctx, BranchDecoders mixer, BranchDecoders mlp)
    : exec_(ctx.exec),
      workspace_(ctx.workspace),
      wide_(ctx.wide),
      mixer_(std::move(mixer)),
      mlp_(std::move(mlp)),
      mixed_(ctx.mixed()) {}

void BlockDecoder::forward(DecodeStepBuffers& s, const DecodeRows& rows) {
  branch(mixer_, s, rows);
  branch(mlp_, s, rows);
}

void BlockDecoder::sublayer(Sublayer which, const Tensor& input, const DecodeRows& rows, const Tensor& h,
                            const Tensor& out) {
  BranchDecoders& b = which == Sublayer::attention ? mixer_ : mlp_;
  b.norm->add_norm(input, Tensor(), h);
  b.branch->forward(h, rows, out);
  if (!b.post_norm) return;
  Workspace::Scope scope(workspace_);
  b.post_norm->add_norm(widened(scope, out), Tensor(), h);
  ops::convert(exec_, h, out);  // on the stream: a captured step
}

Tensor BlockDecoder::widened(Workspace::Scope& scope, const Tensor& branch_out) const {
  // The norm decoders read a wide input (the residual stream's dtype); on the mixed path the
  // output is widened first, exactly, as the training forward's norm reads bf16 in fp32.
  if (!mixed_) return branch_out;
  const Tensor wide = scope.take(wide_, branch_out.shape());
  ops::convert(exec_, branch_out, wide);
  return wide;
}

void BlockDecoder::reset_slot(int32_t slot) {
  mixer_.branch->reset_slot(slot);
  mlp_.branch->reset_slot(slot);
}

void BlockDecoder::copy_slot(int32_t from, int32_t to, int64_t positions) {
  mixer_.branch->copy_slot(from, to, positions);
  mlp_.branch->copy_slot(from, to, positions);
}

// One pre-norm branch: x += branch(norm(x)). On the fused projections the branch reads x
// through its norm and adds into x itself; otherwise the norm adds the pending output of the
// branch before (one pass) and this branch's output is left pending for the next norm. A
// post-norm (sandwich norms) runs on the output and adds it at once: the fused projections,
// which add inside, have no place for it.
void BlockDecoder::branch(BranchDecoders& b, DecodeStepBuffers& s, const DecodeRows& rows) {
  if (rows.fused_branches && b.branch->fused_branch() && !b.post_norm) {
    if (s.pending) residual_add(exec_, s.x, s.branch, mixed_);
    s.pending = false;
    b.branch->forward_fused(s.x, rows);
    return;
  }
  b.norm->add_norm(s.x, s.pending ? s.branch : Tensor(), s.h);
  b.branch->forward(s.h, rows, s.branch);
  s.pending = true;
  if (!b.post_norm) return;
  Workspace::Scope scope(workspace_);
  b.post_norm->add_norm(widened(scope, s.branch), Tensor(), s.h);
  residual_add(exec_, s.x, s.h, mixed_);
  s.pending = false;
}

void residual_add(const ExecContext& exec, const Tensor& x, const Tensor& branch, bool mixed) {
  mixed ? ops::add(exec, x, branch, x) : ops::add_inplace(exec, x, branch);
}

}  // namespace kiln
