// Multi-token prediction ([model.mtp], training only): heads that learn to predict the
// tokens after the next one, whose losses join the step's objective (Gloeckle et al. 2024;
// DeepSeek-V3, section 2.2). Two forms, `model.mtp.depth` = D deep:
//
//   sequential (DeepSeek-V3's modules, seed 001): module k = 1..D reads h_{k-1} (h_0 the
//     backbone's last residual stream, before its final norm) and the embedding row of token
//     t+k:  x = W_h norm_h(h_{k-1}) + W_e norm_e(E[t+k])  (DeepSeek-V3's eh_proj of the
//     concatenation, as its two column blocks),  h_k = block_k(x)  (a transformer block of
//     the model's last layer's kinds, its own parameters),  and predicts token t+k+1
//     through the shared LM head after its own final norm.
//   parallel (seed 002's extra heads): head k predicts token t+k+1 from the backbone's final
//     hidden state through an output matrix of its own [V, hidden].
//
// Each depth's targets stay inside their sequence: a row whose token t+k+1 lies in another
// document (or past the batch) has none, so no target crosses a document boundary. Its
// loss is a mean over its own targets in the log; its gradient is scaled as the main loss's
// (1 / the step's main targets) times its weight (config/mtp_weights.h). The parameters are
// saved in checkpoints but marked training-only: validation, decode and the exports use the
// main head alone, and the exporters leave these out.
#pragma once

#include "config/config.h"
#include "data/batch.h"
#include "model/backbone.h"
#include "nn/block.h"
#include "nn/lm_head.h"

#include <memory>
#include <vector>

namespace kiln {

class MultiTokenPrediction {
 public:
  MultiTokenPrediction(BuildContext& ctx, const ModelConfig& config, Backbone& backbone, LmHead& head);
  ~MultiTokenPrediction();  // where Module is complete

  int64_t depth() const { return static_cast<int64_t>(weights_.size()); }

  // The i32 values each depth adds to the model's input buffer for `t` planned rows.
  static int64_t input_ints(int64_t t, int64_t depth) { return 3 * depth * t; }
  // Writes them for a batch of `rows` <= t rows: per depth k, [t] token ids whose embedding
  // module k reads (the token k rows on, or the row's own where that lies in another
  // sequence: such a row has no target and no gradient), [t] targets (the target k rows
  // on, or kIgnoreTarget), [t] the row each row's embedding gradient comes from (k rows
  // back, or t: a zero row).
  static void stage_inputs(const HostBatch& batch, int64_t t, int64_t depth, int32_t* out);
  // Binds the inputs' views in the model's input buffer (i32 [input_ints(t, depth)]), once
  // its memory exists, and zeroes the row the embedding gradient's gather reads for rows
  // without a source (a step, which may be a captured CUDA graph, writes no memset).
  void bind_inputs(const Tensor& inputs);

  // The depths' losses over the backbone's last forward of `rows` rows: sums into their
  // slots (or device_sums). With `backward`, their gradients too: d(hidden) += (parallel),
  // the backbone's extra gradients (sequential: backbone_extra()), every weight's +=.
  void run(int64_t rows, const SeqInfo& seq, LossScale scale, bool backward, LossSlotSums& sums,
           double* device_sums);
  // What the backbone's backward adds after run(backward = true) (nn: Backbone::ExtraGradients).
  Backbone::ExtraGradients backbone_extra() const;

  double extra_forward_flops_per_token(int64_t seq_len) const;
  void after_step(bool applied);
  void report(std::vector<std::pair<std::string, double>>& out) const;

 private:
  struct Module;  // one sequential depth's norms, projections, block and buffers
  void run_sequential(int64_t rows, const SeqInfo& seq, LossScale scale, bool backward, LossSlotSums& sums,
                      double* device_sums);
  void run_parallel(int64_t rows, LossScale scale, bool backward, LossSlotSums& sums, double* device_sums);

  const ExecContext& exec_;
  Workspace& workspace_;
  Backbone& backbone_;
  LmHead& head_;
  DType compute_dtype_;
  bool mixed_;
  bool parallel_;
  int64_t max_tokens_;
  std::vector<double> weights_;   // each depth's loss weight
  std::vector<int> first_slots_;  // each depth's three loss slots (loss, z, targets)
  std::vector<std::unique_ptr<Module>> modules_;  // sequential
  std::vector<Tensor> head_weights_, head_grads_;  // parallel: [V, hidden] each
  // Per depth, views of the model's input buffer (stage_inputs' layout).
  std::vector<Tensor> tokens_, targets_, gradient_rows_;
  // Sequential: d(h_0) for the backbone (master dtype [t, hidden]); d(the embedding rows)
  // gathered back to the rows whose tokens they embed, and its source with a zero row at t.
  Tensor dh0_, dembedding_, dembedding_source_;
  int64_t rows_ = 0;
};

}  // namespace kiln
