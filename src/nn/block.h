// A pre-norm transformer block on the flat residual stream:
//   h = x + mixer(norm1(x));   y = h + mlp(norm2(h))
// or, with model.sandwich_norms (Gemma 2/3), a norm on each branch's output as well:
//   h = x + post1(mixer(norm1(x)));   y = h + post2(mlp(norm2(h)))
// The token mixer is attention (model.attention) or, on model.alt_attention_layers,
// model.alt_attention.
// Its components come from the registries by the layer's choices (nn/modules.h: the
// model's per-layer patterns applied).
#pragma once

#include "nn/modules.h"

namespace kiln {

// A block's two sublayers, which Block Attention Residuals (nn/attn_res.h) run apart.
enum class Sublayer { attention, mlp };

// The buffers a decode step threads through the blocks (infer/decoder.h owns them).
struct DecodeStepBuffers {
  Tensor x;       // [n, hidden] wide: the residual stream
  Tensor h;       // [n, hidden] compute dtype: the last norm's output
  Tensor branch;  // [n, hidden] compute dtype: the last branch's output
  // branch holds an output not yet added into x (the next norm adds it on its way).
  bool pending = false;
};

// One branch's decoders: its pre-norm, the branch, and its post-norm (sandwich norms; null
// when the model has none).
struct BranchDecoders {
  std::unique_ptr<NormDecoder> norm;
  std::unique_ptr<BranchDecoder> branch;
  std::unique_ptr<NormDecoder> post_norm;
};

class BlockDecoder {
 public:
  BlockDecoder(DecodeContext& ctx, BranchDecoders mixer, BranchDecoders mlp);
  // The block over the step's rows, from and into s.x (with s.pending as it comes).
  void forward(DecodeStepBuffers& s, const DecodeRows& rows);
  // Block Attention Residuals: out = one sublayer's output (no residual add, compute dtype)
  // from its input (wide, left as it is), h its normed input.
  void sublayer(Sublayer which, const Tensor& input, const DecodeRows& rows, const Tensor& h, const Tensor& out);
  // BranchDecoder's slot contract, passed to both branches (nn/decode.h).
  void reset_slot(int32_t slot);
  void copy_slot(int32_t from, int32_t to, int64_t positions);

 private:
  void branch(BranchDecoders& b, DecodeStepBuffers& s, const DecodeRows& rows);
  // A branch's output as the post-norm's input: itself, or a wide copy taken from `scope`.
  Tensor widened(Workspace::Scope& scope, const Tensor& branch_out) const;

  const ExecContext& exec_;
  Workspace& workspace_;
  DType wide_;
  BranchDecoders mixer_, mlp_;
  bool mixed_;
};

class TransformerBlock {
 public:
  TransformerBlock(BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position);

  // x [T, hidden] (kept for backward) -> y [T, hidden].
  void forward(const Tensor& x, const SeqInfo& seq, const Tensor& y);
  // In place on the residual-stream gradient: on entry dres = dL/dy, on exit dL/dx.
  // dres_compute is dres in the compute dtype, current on entry and kept current: a bf16
  // copy on the mixed path (the norm backwards write it), otherwise dres itself.
  void backward(const Tensor& dres, const Tensor& dres_compute, const SeqInfo& seq);

  // Block Attention Residuals (nn/attn_res.h) run the two sublayers apart, each from an
  // input of its own rather than the residual stream.
  // out = the sublayer's output (pre-norm, branch, post-norm, dropout; no residual add) from
  // input [T, hidden] (wide), which is kept for sublayer_backward. The MLP's input may be
  // mlp_input(): the buffer the plain stream keeps h in.
  void sublayer_forward(Sublayer which, const Tensor& input, const SeqInfo& seq, const Tensor& out);
  // dinput = (or += with accumulate) d(input) of the last sublayer_forward(which), from dout.
  void sublayer_backward(Sublayer which, const Tensor& dout, const SeqInfo& seq, const Tensor& dinput,
                         bool accumulate);
  Tensor mlp_input(int64_t rows) const { return mid_.rows(0, rows); }

  std::unique_ptr<BlockDecoder> make_decoder(DecodeContext& ctx) const;
  double extra_forward_flops_per_token(int64_t seq_len) const;
  void export_config(ExportConfig& out) const;
  void after_step(bool applied) {
    mixer_->after_step(applied);
    mlp_->after_step(applied);
  }
  void report(std::vector<std::pair<std::string, double>>& out) const {
    mixer_->report(out);
    mlp_->report(out);
  }
  const TokenMixer& mixer() const { return *mixer_; }

 private:
  const ExecContext& exec_;
  Workspace& workspace_;
  DType compute_dtype_;  // of the branches (norm outputs, branch outputs and gradients)
  bool mixed_;           // residual stream wider than the branches (the GPU's bf16 path)
  std::unique_ptr<Norm> attn_norm_, mlp_norm_;
  std::unique_ptr<TokenMixer> mixer_;
  std::unique_ptr<Mlp> mlp_;
  Tensor mid_;  // saved [T, hidden]: h (the norm outputs are recomputed in backward)
  // Sandwich norms (model.sandwich_norms; null otherwise) and the branch outputs they
  // normalize, saved [T, hidden] compute dtype: their backward reads its input.
  std::unique_ptr<Norm> post_attn_norm_, post_mlp_norm_;
  Tensor attn_out_, mlp_out_;
  // Dropout on the two branch outputs (model.dropout); the sites tell the masks apart.
  double dropout_ = 0;
  uint32_t attention_site_ = 0, mlp_site_ = 0;
  bool drops(const SeqInfo& seq) const { return dropout_ > 0 && seq.dropout_key.defined(); }
};

// x += branch: in place, or wide + compute dtype -> wide on the mixed path.
void residual_add(const ExecContext& exec, const Tensor& x, const Tensor& branch, bool mixed);

}  // namespace kiln
