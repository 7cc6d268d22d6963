// kiln's model as pipeline stages (train/pipeline_engine.h): stage s runs the contiguous
// blocks [bounds[s], bounds[s + 1]) of the model; stage 0 also the embedding, the last
// stage also the final norm, the LM head and its loss. What crosses a stage boundary is the
// residual stream entering the next stage's first block, [tokens, hidden] in the model's
// wide (master) dtype, and its gradient.
//
// Issue 46:
// - Activation frames (model/activation_frames.h), when the model has them
//   (Model::enable_activation_frames, for the rank's stages' layers): the forward of
//   (micro-batch m, stage s) takes a free frame and leaves its saved state there; the
//   backward of (m, s) selects that frame again and frees it. A rank needs as many frames
//   as it has pairs in flight at most, which the schedule's simulation gives
//   (pipeline_activation_frames, train/pipeline_trainer_step.h); running out is an error.
//   Several stages on one rank (the interleaved schedule) take frames from the same model.
// - Without frames (dist.pipeline_activations = "recompute"), stage-input recompute: the
//   forward of m keeps only the stage's input, and its backward runs the stage's forward
//   for m again (counting no objective or statistic twice, as train.recompute_blocks does)
//   before the backward: one extra forward per stage and micro-batch, for one micro-batch
//   of saved activations instead of one per pair in flight.
// - A rank's model is the whole model, or one built with only its stages' layers
//   (BuildOptions::layers; the trainer's dist.pipeline_model = "stages"). Either way it
//   runs, and so accumulates gradients of, only its stages' layers: a whole model's other
//   parameters' gradients are left as they were. Activation frames hold its stages' layers'
//   saved state (Model::enable_activation_frames' ranges).
// - split_backward(true) (the trainer's choice for ZB-H1, with frames): backward_input
//   computes the input gradients and the parameter gradients that are not LinearLayers'
//   (norms, embeddings, routers, experts), and leaves every LinearLayer's weight and bias
//   gradient to backward_weight (nn/weight_grad_deferral.h), which adds them in the order
//   the whole backward would: the same bits. The pair's activation frame is then freed by
//   backward_weight, not backward_input, as the schedule's simulation counts it. Off (the
//   other schedules, and recompute), backward_input runs the whole backward and
//   backward_weight does nothing.
// - A tied LM head (model.tie_embeddings): the embedding table is one parameter, whose
//   gradient both the first stage's lookup and the last stage's head add to. With those
//   stages on two ranks, each rank holds its share after the step, and the caller sums the
//   ranks' gradients (the trainer's one all-reduce of the whole gradient does; the other
//   ranks add zeros): both then hold the table's whole gradient, one tensor, counted once
//   by the norm. A rank holding both stages adds the two shares into its tensor as they run.
// - Refused: multi-token prediction (its heads read the embedding on the last stage),
//   Block Attention Residuals (their sublayers read more than the residual stream).
// - On the GPU (op by op: a stage's passes are separate calls, not one captured step), the
//   engine's boundary buffers are still host memory (it runs on Gloo only): a stage's
//   output leaves the device by cudaMemcpy, which waits for the model's stream, and the
//   next stage's input goes back the same way. Activation frames, recompute and the split
//   backward run there as on the CPU (tests/gpu/test_gpu_pipeline_stage.cpp, one rank).
// - Every rank reads the step's micro-batches: stages after the first use their positions
//   and sequence boundaries (attention), the last stage their targets.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "data/batch.h"
#include "model/model.h"
#include "nn/loss_terms.h"
#include "train/pipeline_engine.h"

namespace kiln::pipeline {

class ModelStage final : public PipelineStage {
 public:
  // `model`: built for training, allocated and initialized the same on every rank.
  // `bounds`: the stages' layer boundaries, 0 = bounds[0] < ... < bounds.back() =
  // model.layers (train/pipeline_split.h plans them). `microbatches`: the step's, in order,
  // each within the model's token budget. `loss_scale`: as Model::forward_backward's
  // (1 / the step's target tokens).
  ModelStage(Model& model, std::vector<int64_t> bounds, std::vector<HostBatch> microbatches, double loss_scale);

  // The refusals above (multi-token prediction, Block Attention Residuals) for a model of
  // `c` cut into stages: one line naming the key.
  static void check_pipelinable(const ModelConfig& c);

  int stages() const { return static_cast<int>(bounds_.size()) - 1; }
  // The layers [first, last) of `stage`.
  std::pair<int64_t, int64_t> layers(int stage) const;

  // Every boundary buffer holds the planned rows (model token budget): the engine's buffer
  // sizes are per stage, while a micro-batch may have fewer rows (the rest is zero).
  int64_t input_bytes(int stage) const override;
  int64_t output_bytes(int stage) const override { return input_bytes(stage + 1); }
  void forward(int microbatch, int stage, const void* input, void* output) override;
  void backward_input(int microbatch, int stage, const void* output_grad, void* input_grad) override;
  void backward_weight(int microbatch, int stage) override;
  // Whether backward_input leaves LinearLayers' weight gradients to backward_weight (the
  // header); needs activation frames. Set between steps.
  void split_backward(bool on);
  bool splits_backward() const { return split_; }
  // Pairs whose input pass ran and weight pass has not (0 after a whole step).
  size_t weight_passes_pending() const { return weight_grads_.size(); }

  // By micro-batch: the sums of the objectives this rank's stages computed (the LM head's
  // on the last stage; routers' in any stage's blocks). Summed over the ranks, a micro-
  // batch's slot sums are Model::forward_backward's.
  const std::map<int, LossSums>& losses() const { return losses_; }
  // Stage inputs kept for a backward still to come (0 after a whole step), and the
  // activation frames held for one.
  size_t inputs_kept() const { return inputs_.size(); }
  size_t frames_held() const { return frame_of_.size(); }
  // Whether forward state waits in activation frames (Model::enable_activation_frames was
  // called) rather than being recomputed from the stage's input.
  bool framed() const { return !frame_busy_.empty(); }
  // Forwards run again before a backward (recompute only), this step so far.
  size_t recomputed_forwards() const { return recomputed_forwards_; }

 private:
  // Loads micro-batch m and runs the stage's forward from `input` (nullptr on stage 0).
  LossSums run_forward(int microbatch, int stage, const void* input, bool recomputing);
  const HostBatch& batch(int microbatch) const;
  int64_t row_bytes() const;

  Model& model_;
  const std::vector<int64_t> bounds_;
  const std::vector<HostBatch> microbatches_;
  const double loss_scale_;
  std::map<std::pair<int, int>, std::vector<unsigned char>> inputs_;  // (micro-batch, stage) -> its input
  std::vector<bool> frame_busy_;                    // per activation frame: a pair's state waits there
  std::map<std::pair<int, int>, int> frame_of_;     // (micro-batch, stage) -> its frame
  size_t recomputed_forwards_ = 0;
  bool split_ = false;
  // (micro-batch, stage) -> its LinearLayers' weight gradients, recorded by its input pass.
  std::map<std::pair<int, int>, std::vector<WeightGradDeferral::Pending>> weight_grads_;
  std::map<int, LossSums> losses_;
};

}  // namespace kiln::pipeline
