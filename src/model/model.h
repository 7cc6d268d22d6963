// A decoder-only language model: a backbone (tokens -> hidden states, model/backbone.h)
// and heads that read the hidden states (the LM head, nn/lm_head.h), each adding to named
// loss terms (nn/loss_terms.h). Built from a ModelConfig through the module registries;
// every buffer is planned at build time and allocated once.
#pragma once

#include "core/exec_context.h"
#include "data/batch.h"
#include "model/activation_frames.h"
#include "model/backbone.h"
#include "model/build_options.h"
#include "model/multi_token_prediction.h"
#include "nn/lm_head.h"
#include "nn/loss_terms.h"
#include "nn/weight_grad_deferral.h"

#include <memory>
#include <vector>

namespace kiln {

struct MemoryPlan {
  size_t parameters = 0;  // masters, plus their bf16 compute copies on the mixed path
  size_t gradients = 0, activations = 0, workspace = 0;
  size_t total() const { return parameters + gradients + activations + workspace; }
};

class Model {
 public:
  Model(const ModelConfig& config, const BuildOptions& options);
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  const BuildOptions& options() const { return options_; }
  const ExecContext& exec() const { return exec_; }
  MemoryPlan memory_plan() const;
  void allocate();                 // the one allocation of every arena
  void init_weights(uint64_t seed);

  const std::vector<std::unique_ptr<Parameter>>& parameters() const { return parameters_; }
  const Parameter* find_parameter(const std::string& name) const;
  int64_t parameter_count() const;
  int64_t embedding_parameter_count() const;  // the input embedding (and untied head)
  // Training FLOPs per token: 3 x (forward: 2 x the matmul parameters, the head's counted
  // whether tied or not, plus each component's extra work, e.g. attention's scores at an
  // average context of seq/2, or its window).
  double flops_per_token(int64_t seq_len) const;

  const Backbone& backbone() const { return *backbone_; }
  const LmHead& head() const { return *head_; }
  const LossTerms& loss_terms() const { return losses_.terms; }
  // After each optimizer step, applied or skipped: the components' state between steps.
  void after_step(bool applied) {
    backbone_->after_step(applied);
    if (mtp_) mtp_->after_step(applied);
  }
  // The components' diagnostics of the last step, by name ("moe.3.load_max", ...).
  std::vector<std::pair<std::string, double>> component_metrics() const {
    std::vector<std::pair<std::string, double>> out;
    backbone_->report(out);
    if (mtp_) mtp_->report(out);
    return out;
  }
  // Parameters weighted by the share of tokens that use them (experts: top_k / experts), of
  // the model as it is served: training-only ones (multi-token prediction) left out.
  double active_parameter_count() const;
  // Gradient scale of the per-micro-batch loss terms: 1 / micro-batches per step (the
  // trainer sets it from train.grad_accum).
  void set_micro_batches(int64_t micro_batches) { losses_.per_micro_batch_scale = 1.0 / static_cast<double>(micro_batches); }
  // The step's loss scale S (train/loss_scaler.h; StepProgram sets it each step): the
  // gradient scale forward_backward's callers pass is S / targets, and the router losses,
  // which scale by micro-batches rather than targets, multiply theirs by S (LossContext).
  void set_loss_scale(double scale) { losses_.loss_scale = scale; }
  // model.moe.balance_scope = "step": the balance loss's f_i over the whole step, so its
  // counts come before any backward (train/step_program.cpp): cleared, then the counting
  // pass over every micro-batch (the training forward again, dropout included, with only
  // the routed counts kept), then summed over the ranks (step_routes(): f64 buffers on the
  // model's device, added to and read by kernels there; no host read).
  bool counts_step_routes() const { return !losses_.step_routes.empty(); }
  void clear_step_routes();
  void count_step_routes();  // of the loaded batch
  const std::vector<Tensor*>& step_routes() const { return losses_.step_routes; }
  // Masters -> their bf16 compute copies (mixed path; a no-op otherwise). Every forward
  // does it; a decoder, which reads the copies without a forward, calls it once when made.
  void refresh_compute_weights();

  // Copies a packed batch into the model's input buffers (its size must be <= max_tokens).
  void load_batch(const HostBatch& batch);

  // ---- a training step whose scalars stay on the device (GPU; train/step_program.h) ----
  // A micro-batch staged in host memory exactly as the input buffers take it, padded to
  // static shapes so one captured CUDA graph serves every batch of a bucket: all
  // max_tokens rows (the batch must fill them, as the packer's do), the sequence count
  // rounded up to a power of two with empty sequences, the longest sequence rounded up to
  // a power of two (at least 64: the attention's buckets), one token group per row.
  // A uniform batch (every sequence max_seqlen tokens long) keeps its exact shape; other
  // batches are bucketed (sequences padded with empty ones to a power of two, max_seqlen
  // rounded up to one).
  struct StagedShape {
    int64_t seqs = 0, max_seqlen = 0;
    bool uniform = false;
    int64_t key() const { return int64_t{uniform} << 62 | seqs << 32 | max_seqlen; }  // both below 2^31
  };
  int64_t staged_ints() const { return input_ints(); }  // int32 values per staged batch
  StagedShape stage_batch(const HostBatch& batch, int32_t* staging);
  // Enqueues the copy of a staged batch (pinned host memory, left untouched until the
  // stream has run the copy) into the input buffers; no synchronization.
  void load_staged(const int32_t* staging, const StagedShape& shape);
  // forward_backward of the loaded batch with the loss scale read from device memory and
  // the loss slots' sums added to `slot_sums` [kMaxLossSlots] in device memory: nothing is
  // read back. loss_scale: the LM head's, float(S / targets); scale: S itself, the router
  // losses' (set_loss_scale's value is not read).
  void forward_backward_on_device(const float* loss_scale, const double* scale, double* slot_sums);
  // gradient_norm()'s sum of squares into device memory, without waiting for it.
  void gradient_sum_squares_to_device(double* out) const;
  // Forward, losses and backward of the loaded batch; parameter gradients accumulate (+=).
  // The objective's gradient is scaled by loss_scale (1 / target tokens of the whole step).
  LossSums forward_backward(double loss_scale);
  // Forward and the main head's losses only (validation, evaluation).
  LossSums evaluate();
  // Forward and every training objective's losses (the multi-token prediction depths' too),
  // without a backward: the objective forward_backward differentiates (gradient checks).
  LossSums evaluate_objective();
  // Forward of the loaded batch, then the logits of rows [first, first + count) into
  // `out` (host, f32, row-major [count, V]), computed a chunk of rows at a time.
  void logits(int64_t first, int64_t count, std::vector<float>& out);

  // ---- a pipeline stage's part of forward_backward (train/pipeline_model_stage.h) ----
  // The loaded batch through blocks [first, last) (Backbone::forward_layers): the embedding
  // on the first stage, the final norm on the last; a later stage's input is written into
  // stage_activation(first) before. Returns the sums the blocks' objectives (routers) add
  // for this micro-batch. `recomputing`: this micro-batch's forward run again before its
  // backward, whose objectives and statistics count nothing a second time.
  LossSums forward_layers(int64_t first, int64_t last, double loss_scale, bool recomputing);
  // The last stage, after forward_layers: the heads' losses and their gradient d(hidden).
  LossSums stage_heads(double loss_scale);
  // Validation through a stage's model (a pipeline whose ranks build only their stages):
  // blocks [first, last) as evaluate() runs them -- no dropout, no training objective or
  // statistic -- and where last == model.layers the main head's losses, which it returns
  // (zeros on an earlier stage).
  LossSums evaluate_layers(int64_t first, int64_t last);
  // Backward of the last forward_layers(first, last): from d(hidden) the heads left
  // (last == model.layers), else from stage_gradient(), written with d(block last's input);
  // leaves d(block first's input) there. Gradients accumulate (+=) for this range only.
  void backward_layers(int64_t first, int64_t last);
  // The residual stream entering block l of the loaded rows [rows, hidden], master dtype
  // (l = model.layers: the final norm's input); its gradient, the same shape.
  Tensor stage_activation(int64_t l) const { return backbone_->residual(l).rows(0, rows_); }
  Tensor stage_gradient() const { return backbone_->residual_grad().rows(0, rows_); }

  // What block l takes in the model's arenas, read from the offsets of the entries it
  // reserved there (Backbone::block_segments and block_runs): the bytes allocate() gives it,
  // alignment included, on any device.
  struct BlockMemory {
    size_t parameters = 0;      // its masters and its state without gradients (a router's bias)
    size_t compute_copies = 0;  // its matrices' bf16 copies (mixed path)
    size_t gradients = 0;
    // Its segment of the activation arena: one micro-batch's saved state, its input row of
    // the residual stream included (what an activation frame copies of it). A recomputed
    // block (train.recompute_blocks) keeps that row alone; the rest of its state lives in
    // the region recomputed blocks share, not counted here.
    size_t activations = 0;
    size_t buffers = 0;  // its buffers and step buffers (no micro-batch's: one copy)
    size_t first_parameter = 0, last_parameter = 0;  // its Parameters: parameters()[first, last)
    size_t total() const { return parameters + compute_copies + gradients + activations + buffers; }
  };
  BlockMemory block_memory(int64_t l) const;

  // ---- activation frames (model/activation_frames.h): a pipeline rank's micro-batches in flight ----
  // After allocate(), once: `frames` frames of the blocks in `layers` ([first, last) ranges)
  // and of the model's own state (its loaded batch, the final norm's); frame 0 is the memory
  // allocate() made. Other blocks keep one copy.
  void enable_activation_frames(int frames, const std::vector<std::pair<int64_t, int64_t>>& layers);
  bool has_activation_frames() const { return frames_ != nullptr; }
  int activation_frames() const { return frames_ ? frames_->frames() : 1; }
  // The memory frames 1.. take beyond what memory_plan() counts.
  size_t activation_frame_bytes() const { return frames_ ? frames_->extra_bytes() : 0; }
  // Makes `frame` the micro-batch state the model works on: its loaded batch and what its
  // last forward saved in the framed blocks, as they were when it was last left.
  // load_batch, forwards and backwards of the framed blocks then read and write that frame.
  void select_frame(int frame);
  // Where LinearLayers leave their weight gradients while it records (ZB-H1's split
  // backward, nn/weight_grad_deferral.h); idle otherwise.
  WeightGradDeferral& weight_grad_deferral() { return weight_grad_deferral_; }

  // Every parameter gradient lives in one arena of one dtype (zero between tensors), so
  // these run as single kernels over it rather than one launch (and, for the norm, one
  // host synchronization) per parameter.
  void zero_grads();
  double gradient_norm() const;            // L2 norm of all gradients (one synchronization)
  void scale_gradients(double factor);     // all gradients *= factor
  Arena& gradient_arena() { return grads_; }
  Tensor all_gradients() const;  // the gradient arena as one flat tensor (the ranks' all-reduce)
  // What the components collect over a step and act on in after_step(), for the ranks of a
  // data-parallel run to combine first.
  const StepStatistics& step_statistics() const { return step_statistics_; }
  // Each trainable parameter's range of all_gradients() and the backward event after which
  // it is final (model/gradient_ready.h), in the arena's order.
  std::vector<GradientRange> gradient_ranges() const;
  // Told backward's progress from now on (an empty function: no one); data parallelism
  // reduces finished gradients while backward runs.
  void set_backward_progress(BackwardProgress progress) { backward_progress_ = std::move(progress); }

 private:
  void forward();  // the backbone over the loaded rows
  void backward();  // the backbone's backward from d(hidden) the heads left
  void begin_losses(bool backward, double per_target_scale);
  // training_heads: the heads that only training runs too (multi-token prediction).
  LossSums heads(LossScale scale, bool backward, double* device_sums, bool training_heads);

  ModelConfig config_;
  BuildOptions options_;
  // Where the model's ops run (core/exec_context.h); its modules keep a reference.
  ExecContext exec_;
  // activations_: one micro-batch's state (saved activations, the loaded batch), which
  // frames_ keeps several of when built with activation frames; buffers_: the buffers no
  // micro-batch owns; step_buffers_: what components keep over a step and between steps.
  Arena params_, grads_, activations_, buffers_, step_buffers_;
  std::vector<Tensor*> kept_views_;  // modules' views into activations_ (BuildContext::kept_view)
  std::unique_ptr<ActivationFrames> frames_;  // null: one frame (enable_activation_frames not called)
  // A frame's loaded shape (set_loaded_shape's arguments) and whether its forward drops,
  // kept while another frame is selected.
  struct LoadedShape {
    int64_t rows = 0, seqs = 0, max_seqlen = 0, groups = 0;
    bool uniform = false, drops = false;
  };
  std::vector<LoadedShape> frame_shapes_;
  BackwardProgress backward_progress_;
  Workspace workspace_;
  std::vector<std::unique_ptr<Parameter>> parameters_;
  ComputeWeights compute_weights_;

  // Recomputed blocks' activation arenas, all bound to one shared region.
  std::vector<std::unique_ptr<Arena>> recompute_arenas_;
  Storage recompute_storage_;
  size_t recompute_bytes() const;
  LossContext losses_;  // the objectives' slots and, per micro-batch, their scales
  StepStatistics step_statistics_;
  std::vector<size_t> whole_index_;  // parameters_[i]'s index in the whole model (init_weights)
  WeightGradDeferral weight_grad_deferral_;
  LossSums pending_;    // the current micro-batch's sums (host), the backbone's objectives' first
  std::unique_ptr<Backbone> backbone_;
  std::unique_ptr<LmHead> head_;
  std::unique_ptr<MultiTokenPrediction> mtp_;  // [model.mtp]; null when off

  // Inputs of the current micro-batch (i32), views of one buffer so a staged batch is one
  // copy: tokens, targets, positions [T]; cu_seqlens [T+1]; the token groups below; the
  // dropout key [2]; the multi-token prediction depths' inputs.
  static int64_t base_input_ints(int64_t t) { return 7 * t + 4; }
  int64_t input_ints() const {
    const int64_t t = options_.max_tokens;
    return base_input_ints(t) + MultiTokenPrediction::input_ints(t, mtp_ ? mtp_->depth() : 0);
  }
  std::vector<int32_t> mtp_inputs_;  // load_batch's host staging of them
  void bind_input_views();
  void set_loaded_shape(int64_t rows, int64_t seqs, int64_t max_seqlen, int64_t groups, bool uniform);
  Tensor inputs_;
  Tensor tokens_, targets_, positions_, cu_seqlens_, dropout_key_;
  int64_t rows_ = 0;
  SeqInfo seq_;
  // Token groups for the deterministic embedding backward (GPU): built on the host in
  // load_batch from the batch's tokens, uploaded with it.
  ops::TokenGroups token_groups_;
  std::vector<int32_t> group_counts_, group_order_, group_tokens_, group_starts_;
};

}  // namespace kiln
