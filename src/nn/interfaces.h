// The module interfaces that registries build. Each module writes forward and backward
// explicitly (as llm.c does): forward keeps what backward needs in planned buffers;
// backward writes input gradients with = (or += where the caller asks, for the residual
// stream) and accumulates parameter gradients with +=. Each also has a decode entry
// (nn/decode.h): a decoder object made for one KV-cache decoder, which plans that
// decoder's state and runs the module over a decode step's rows.
#pragma once

#include "core/tensor.h"
#include "nn/decode.h"
#include "nn/export_config.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

// Per-micro-batch inputs every position-aware module may read. Only token mixers and
// position encodings use them; everything else is a per-token op.
struct SeqInfo {
  Tensor positions;    // i32 [T]: position within the token's own sequence
  Tensor cu_seqlens;   // i32 [S+1]: sequence boundaries
  int64_t max_seqlen = 0;
  // Every sequence holds exactly max_seqlen tokens and they fill the rows (rows = sequences x
  // max_seqlen), as an unpacked run's or the benchmark's rows: attention may use a layout
  // without per-sequence offsets.
  bool uniform = false;
  // Dropout's stream key for this micro-batch (i32 [2] on the model's device, ops/dropout):
  // defined only for a training forward and its backward, so evaluation drops nothing.
  Tensor dropout_key;
};

class Norm {
 public:
  virtual ~Norm() = default;
  // x [T', C] -> y [T', C]; T' <= the planned rows (x is kept for backward).
  virtual void forward(const Tensor& x, const Tensor& y) = 0;
  // sum = a + b (the residual step before a pre-norm branch), then forward(sum, y); one
  // pass where the backend fuses them. sum is kept for backward like x.
  virtual void forward_add(const Tensor& a, const Tensor& b, const Tensor& sum, const Tensor& y) = 0;
  // dx = (or +=) d/dx of the last forward; dx_copy (if defined) receives dx's final values
  // in its own dtype (the residual gradient's bf16 copy on the mixed path).
  virtual void backward(const Tensor& dy, const Tensor& dx, bool accumulate_dx, const Tensor& dx_copy = Tensor()) = 0;
  // Writes the last forward's output into y again, bit for bit, from the input it kept:
  // callers recompute a norm's output in backward instead of saving it (a cheap pass).
  virtual void recompute(const Tensor& y) = 0;

  virtual std::unique_ptr<NormDecoder> make_decoder(DecodeContext& ctx) const = 0;
  // An RMSNorm's gain and eps, for fused kernels that fold the norm into what follows it;
  // none for other norms.
  virtual std::optional<RmsNormForm> rms_form() const { return std::nullopt; }
  // Its fields of a stock model's configuration (nn/export_config.h), or a refusal.
  virtual void export_config(ExportConfig& out) const = 0;
};

// Rotary tables [max_positions, head_dim / 2] (cos, sin) that attention applies to q and k
// (fused with their norm, ops/attention/qkv_prepare.h); undefined tensors: no rotation.
struct RotaryTables {
  Tensor cos, sin;
};

class PositionEncoding {
 public:
  virtual ~PositionEncoding() = default;
  virtual RotaryTables rotary() = 0;
  virtual void export_config(ExportConfig& out) const = 0;
};

// A token mixer: the branch that mixes information across a sequence's positions (the
// only one that reads SeqInfo). Attention is one; a mixer with a fixed-size recurrent
// state (linear attention, KDA) is another. Each layer builds the one its per-layer
// pattern names (model.attention, or model.alt_attention on model.alt_attention_layers).
class TokenMixer {
 public:
  virtual ~TokenMixer() = default;
  // x [T, hidden] (normalized) -> out [T, hidden].
  virtual void forward(const Tensor& x, const SeqInfo& seq, const Tensor& out) = 0;
  // dout [T, hidden] -> dx [T, hidden] (=); x is the forward's input again (the caller
  // keeps or recomputes it).
  virtual void backward(const Tensor& x, const Tensor& dout, const SeqInfo& seq, const Tensor& dx) = 0;

  // Plans its decode state (a KV cache, or a fixed-size state per slot: the slot contract
  // of BranchDecoder, nn/decode.h) in ctx; pre_norm is the norm before the branch, which a
  // fused decode branch may fold in.
  virtual std::unique_ptr<BranchDecoder> make_decoder(DecodeContext& ctx, const Norm& pre_norm) const = 0;
  // Forward FLOPs per token beyond its weight matrices' 2 x parameters (attention's scores
  // and their weighted values), at sequences of `seq_len` tokens.
  virtual double extra_forward_flops_per_token(int64_t seq_len) const = 0;
  // Its fields of a stock model's configuration, or a refusal naming the key that chose it
  // (mixer_key(), nn/modules.h): a mixer no stock family computes refuses.
  virtual void export_config(ExportConfig& out) const = 0;
  // Whether QK-Clip ([optim.qk_clip], nn/qk_clip.h) applies: the mixer has query-key
  // logits and clips them itself when the build asks (BuildContext::qk_clip_tau). Mixers
  // without logits ignore it; a model none of whose layers clip is refused.
  virtual bool clips_qk() const { return false; }
  // After each optimizer step (applied or skipped by the fault guard), and the last step's
  // diagnostics, as Mlp's: QK-Clip (nn/qk_clip.h) clips and reports here.
  virtual void after_step(bool applied) { (void)applied; }
  virtual void report(std::vector<std::pair<std::string, double>>& out) const { (void)out; }
};

class Mlp {
 public:
  virtual ~Mlp() = default;
  virtual void forward(const Tensor& x, const Tensor& out) = 0;
  // As TokenMixer::backward: x is the forward's input again.
  virtual void backward(const Tensor& x, const Tensor& dout, const Tensor& dx) = 0;

  virtual std::unique_ptr<BranchDecoder> make_decoder(DecodeContext& ctx, const Norm& pre_norm) const = 0;
  virtual void export_config(ExportConfig& out) const = 0;
  // After each optimizer step (applied or skipped by the fault guard): MLPs with state of
  // their own between steps (a router's load statistics and bias) update it here.
  virtual void after_step(bool applied) { (void)applied; }
  // Diagnostics of the last step as (name, value) pairs for the log and metrics.jsonl
  // (a router's load statistics); most MLPs have none.
  virtual void report(std::vector<std::pair<std::string, double>>& out) const { (void)out; }
};

}  // namespace kiln
