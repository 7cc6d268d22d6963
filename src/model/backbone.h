// The backbone: tokens -> hidden states, a pure function of (tokens, SeqInfo) that knows
// no loss: embedding -> blocks (each built by the layer's choices) -> final norm. Its
// backward takes d(hidden) from whichever heads read the hidden states and accumulates
// every parameter gradient (+=) down to the embedding's.
#pragma once

#include "config/config.h"
#include "model/activation_frames.h"
#include "model/build_options.h"
#include "model/gradient_ready.h"
#include "nn/attn_res.h"
#include "nn/block.h"
#include "ops/dropout/dropout.h"
#include "ops/embedding/embedding.h"

#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace kiln {

class Backbone {
 public:
  // Plans everything in ctx's arenas; recompute_arenas receives the activation arenas of
  // the recomputed blocks (options.recompute_blocks), which the model binds to one region.
  Backbone(BuildContext& ctx, const ModelConfig& config, const BuildOptions& options,
           std::vector<std::unique_ptr<Arena>>& recompute_arenas);

  // tokens i32 [T] -> hidden [T, hidden] (compute dtype), T <= the planned rows.
  void forward(const Tensor& tokens, const SeqInfo& seq);
  const Tensor& hidden() const { return hidden_; }  // [planned rows, hidden]
  // The residual stream of the last forward, [planned rows, hidden]: the input of block l,
  // or for l = model.layers the final norm's input (diagnostics: the muP coordinate check).
  const Tensor& residual(int64_t l) const { return residual_.at(static_cast<size_t>(l)); }
  // d(hidden) for the rows of the last forward, written by the heads (=), compute dtype.
  const Tensor& dhidden() const { return dhidden_; }
  // What heads that read more than the final hidden state add to the backbone's backward
  // (multi-token prediction's modules), master dtype [rows, hidden], undefined for none:
  // d(the final norm's input), and d(the embedding's rows) for the table's gradient.
  struct ExtraGradients {
    Tensor final_norm_input;
    Tensor embedding_rows;
  };
  // Backward of the last forward from dhidden: parameter gradients accumulate (+=). The
  // embedding's gradient takes the token groups (GPU: a fixed summation order) when given.
  // `progress` (may be null) is told each event as it finishes (model/gradient_ready.h).
  void backward(const Tensor& tokens, const SeqInfo& seq, const ops::TokenGroups* groups,
                const ExtraGradients& extra = {}, const BackwardProgress* progress = nullptr);

  // A pipeline stage's part (train/pipeline_model_stage.h): forward() and backward() over
  // blocks [first, last) only, which forward() and backward() are over all of them. The
  // embedding runs when first == 0, else block first's input is residual(first), written
  // by the caller; the final norm runs when last == model.layers. backward_layers starts
  // from dhidden when last == model.layers, else from residual_grad(), written by the
  // caller with d(block last's input), and leaves d(block first's input) there. Not with
  // Block Attention Residuals (their sublayers read more than the residual stream: refused).
  void forward_layers(const Tensor& tokens, const SeqInfo& seq, int64_t first, int64_t last);
  void backward_layers(const Tensor& tokens, const SeqInfo& seq, const ops::TokenGroups* groups, int64_t first,
                       int64_t last);
  // The residual stream's gradient, [planned rows, hidden], master dtype (see backward_layers).
  const Tensor& residual_grad() const { return dres_; }

  // The embedding: its master (the lookup reads fp32 rows) and compute copy (a tied head's
  // weight) and gradient. A pipeline stage's model without layer 0 or a tied head has none.
  bool has_embedding() const { return embed_ != nullptr; }
  const Parameter& embedding() const { return *embed_; }
  const Tensor& embedding_compute() const { return embed_w_; }
  const Tensor& embedding_grad() const { return embed_g_; }
  const Norm& final_norm() const { return *final_norm_; }
  // Every block, the embedding and the final norm built: not a pipeline stage's part
  // (BuildOptions::layers). A stage's model holds null for the blocks it leaves out.
  bool whole() const;
  // Where a stage's model left parameters out (model/skipped_module.h): at index `first` of
  // the model's parameters, `second` of the whole model's were not built, in order.
  const std::vector<std::pair<size_t, size_t>>& skipped_parameters() const { return skipped_parameters_; }
  PositionEncoding& position() { return *position_; }
  const std::vector<std::unique_ptr<TransformerBlock>>& blocks() const { return blocks_; }
  // Each block's run of the model's activation arena and kept views, its input row of the
  // residual stream included (model/activation_frames.h); for a recomputed block that row
  // alone (the rest of its saved state lives in the region such blocks share).
  const std::vector<FrameSegment>& block_segments() const { return block_segments_; }
  // Each block's runs of the model's other arenas and of its parameter list, recorded as it
  // was built: [first, last) entries of the parameters' (masters), compute copies' (mixed
  // path), gradients', buffers' and step buffers' arenas, and its indices in the model's
  // parameters(). Model::block_memory reads their bytes.
  struct BlockRuns {
    std::pair<size_t, size_t> parameters, params, compute_weights, grads, buffers, step_buffers;
  };
  const std::vector<BlockRuns>& block_runs() const { return block_runs_; }
  // Block Attention Residuals (model.attn_res_block > 0), else null.
  const BlockAttnRes* attn_res() const { return attn_res_.get(); }

  // Forward FLOPs per token beyond 2 x the weight matrices (attention's scores), summed over
  // the blocks, at sequences of seq_len tokens.
  double extra_forward_flops_per_token(int64_t seq_len) const;
  // After each optimizer step (the components with state between steps: routers).
  void after_step(bool applied);
  // The components' diagnostics of the last step (nn/interfaces.h: Mlp::report).
  void report(std::vector<std::pair<std::string, double>>& out) const;
  // Every component's fields of a stock configuration (nn/export_config.h), in order.
  void export_config(ExportConfig& out) const;

 private:
  const ExecContext& exec_;
  const ModelConfig& config_;
  LossContext* losses_;
  int64_t rows_ = 0;
  int64_t recompute_blocks_ = 0;
  Tensor embed_w_, embed_g_;
  const Parameter* embed_ = nullptr;
  std::unique_ptr<PositionEncoding> position_;
  std::unique_ptr<PositionEncoding> local_position_;  // the windowed layers' (model.rope.local_theta); null: position_
  std::vector<std::unique_ptr<TransformerBlock>> blocks_;
  std::unique_ptr<Norm> final_norm_;
  // model.attn_res_block > 0: the sublayers read mixes over depth (nn/attn_res.h). Then
  // residual_[l] holds layer l's attention input (layer 0's: the embedding), each block's
  // mlp_input its MLP's, and residual_[layers] the final read.
  std::unique_ptr<BlockAttnRes> attn_res_;
  std::vector<Tensor> residual_;  // residual_[l] = input of block l [T, hidden]; [layers] = final-norm input
  std::vector<FrameSegment> block_segments_;
  std::vector<BlockRuns> block_runs_;
  std::vector<std::pair<size_t, size_t>> skipped_parameters_;
  Tensor hidden_, dhidden_;       // [T, hidden] compute dtype
  Tensor dres_, dres_compute_;    // [T, hidden]: the residual gradient (wide) and its compute copy (mixed path)

  // Blocks [first, last) backward, the final norm's first when last is model.layers.
  void backward_blocks(const Tensor& dres, const Tensor& dres_compute, const SeqInfo& seq, const ExtraGradients& extra,
                       const std::function<void(int)>& tell, int64_t first, int64_t last);
  void check_layer_range(int64_t first, int64_t last) const;
  // BuildOptions::layers against the config (one line naming the key).
  static void check_stage_layers(const ModelConfig& config, const BuildOptions& options);
  // The embedding's dropout and scale, then its table's gradient, from d(its output) in dres.
  void embedding_backward(const Tensor& tokens, const Tensor& dres, const SeqInfo& seq, const ops::TokenGroups* groups,
                          const ExtraGradients& extra);
  void forward_attn_res(const SeqInfo& seq);
  void backward_attn_res(const SeqInfo& seq, const ExtraGradients& extra, const std::function<void(int)>& tell);

  // model.embed_dropout on the embedding's output: mask site 0 (the blocks take 1, 2, ...).
  bool embedding_drops(const SeqInfo& seq) const { return config_.embed_dropout > 0 && seq.dropout_key.defined(); }
  ops::DropoutSite embedding_dropout(const SeqInfo& seq) const { return {config_.embed_dropout, 0, seq.dropout_key}; }
};

}  // namespace kiln
