#include "train/pipeline_model_stage.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace kiln::pipeline {
namespace {

void add_sums(LossSums& into, const LossSums& more) {
  for (size_t i = 0; i < into.slot.size(); ++i) into.slot[i] += more.slot[i];
  into.loss = into.slot[0];
  into.z = into.slot[1];
  into.count = static_cast<int64_t>(into.slot[2]);
}

}  // namespace

ModelStage::ModelStage(Model& model, std::vector<int64_t> bounds, std::vector<HostBatch> microbatches,
                       double loss_scale)
    : model_(model), bounds_(std::move(bounds)), microbatches_(std::move(microbatches)), loss_scale_(loss_scale) {
  const ModelConfig& c = model.config();
  KILN_CHECK(model.options().training, "pipeline", "pipeline stages need a model built for training");
  KILN_CHECK(bounds_.size() >= 2 && bounds_.front() == 0 && bounds_.back() == c.layers, "pipeline",
             "stage boundaries must run from 0 to model.layers = {}", c.layers);
  for (size_t s = 0; s + 1 < bounds_.size(); ++s)
    KILN_CHECK(bounds_[s] < bounds_[s + 1], "pipeline", "stage {} has no layers ([{}, {}))", s, bounds_[s],
               bounds_[s + 1]);
  check_pipelinable(c);
  KILN_CHECK(!microbatches_.empty(), "pipeline", "a pipeline step needs at least one micro-batch");
  if (model.has_activation_frames()) frame_busy_.assign(static_cast<size_t>(model.activation_frames()), false);
}

void ModelStage::check_pipelinable(const ModelConfig& c) {
  // Not refused: a tied head (the header says who sums the table's two gradients).
  KILN_CHECK(c.mtp.depth == 0, "model.mtp.depth", "multi-token prediction is not pipelined yet (depth {})",
             c.mtp.depth);
  KILN_CHECK(c.attn_res_block == 0, "model.attn_res_block",
             "Block Attention Residuals are not pipelined: their sublayers read more than the residual stream");
}

std::pair<int64_t, int64_t> ModelStage::layers(int stage) const {
  KILN_CHECK(stage >= 0 && stage < stages(), "pipeline", "stage {} of {}", stage, stages());
  return {bounds_[static_cast<size_t>(stage)], bounds_[static_cast<size_t>(stage) + 1]};
}

int64_t ModelStage::row_bytes() const {
  // The residual stream's dtype (a stage's model may not hold block 0's input).
  return model_.config().hidden * static_cast<int64_t>(dtype_size(model_.options().recipe().master));
}

int64_t ModelStage::input_bytes(int) const { return model_.options().max_tokens * row_bytes(); }

const HostBatch& ModelStage::batch(int microbatch) const {
  KILN_CHECK(microbatch >= 0 && microbatch < static_cast<int>(microbatches_.size()), "pipeline",
             "micro-batch {} of a step of {}", microbatch, microbatches_.size());
  return microbatches_[static_cast<size_t>(microbatch)];
}

LossSums ModelStage::run_forward(int microbatch, int stage, const void* input, bool recomputing) {
  const auto [first, last] = layers(stage);
  model_.load_batch(batch(microbatch));
  if (stage > 0) {
    const Tensor into = model_.stage_activation(first);
    copy_tensor(Tensor(const_cast<void*>(input), into.dtype(), Device::cpu, into.shape()), into);
  }
  return model_.forward_layers(first, last, loss_scale_, recomputing);
}

void ModelStage::forward(int microbatch, int stage, const void* input, void* output) {
  const auto [first, last] = layers(stage);
  if (framed()) {
    // This pair's forward state stays in a frame of its own until its backward.
    const auto free = std::find(frame_busy_.begin(), frame_busy_.end(), false);
    KILN_CHECK(free != frame_busy_.end(), "pipeline",
               "micro-batch {} on stage {}: more micro-batches in flight than the model's {} activation frames",
               microbatch, stage, frame_busy_.size());
    const int frame = static_cast<int>(free - frame_busy_.begin());
    *free = true;
    frame_of_[{microbatch, stage}] = frame;
    model_.select_frame(frame);
  } else if (stage > 0) {
    const auto* bytes = static_cast<const unsigned char*>(input);
    inputs_[{microbatch, stage}].assign(bytes, bytes + input_bytes(stage));
  }
  // The blocks' objectives count here, once; the last stage's heads in its backward.
  add_sums(losses_[microbatch], run_forward(microbatch, stage, input, false));
  if (stage + 1 < stages()) {
    const Tensor out = model_.stage_activation(last);
    std::memset(output, 0, static_cast<size_t>(output_bytes(stage)));
    copy_tensor(out, Tensor(output, out.dtype(), Device::cpu, out.shape()));
  }
}

void ModelStage::backward_input(int microbatch, int stage, const void* output_grad, void* input_grad) {
  const auto [first, last] = layers(stage);
  if (framed()) {
    // Back to the frame its forward left its state in.
    auto it = frame_of_.find({microbatch, stage});
    KILN_CHECK(it != frame_of_.end(), "pipeline", "backward of micro-batch {} on stage {} before its forward",
               microbatch, stage);
    model_.select_frame(it->second);
    // Split: the weight pass still reads the frame (FP8 kept inputs), which it frees.
    if (!split_) {
      frame_busy_[static_cast<size_t>(it->second)] = false;
      frame_of_.erase(it);
    }
  } else {
    // The model's saved activations are those of whichever pass ran last: run this stage's
    // forward of the micro-batch again from its kept input (one extra forward per stage;
    // see the header).
    const void* input = nullptr;
    std::vector<unsigned char> kept;
    if (stage > 0) {
      auto it = inputs_.find({microbatch, stage});
      KILN_CHECK(it != inputs_.end(), "pipeline", "backward of micro-batch {} on stage {} before its forward",
                 microbatch, stage);
      kept = std::move(it->second);
      inputs_.erase(it);
      input = kept.data();
    }
    run_forward(microbatch, stage, input, true);
    ++recomputed_forwards_;
  }
  if (stage + 1 == stages()) {
    add_sums(losses_[microbatch], model_.stage_heads(loss_scale_));
  } else {
    const Tensor grad = model_.stage_gradient();
    copy_tensor(Tensor(const_cast<void*>(output_grad), grad.dtype(), Device::cpu, grad.shape()), grad);
  }
  if (split_) {
    KILN_CHECK(!weight_grads_.count({microbatch, stage}), "pipeline",
               "input pass of micro-batch {} on stage {} run twice", microbatch, stage);
    model_.weight_grad_deferral().begin();
    model_.backward_layers(first, last);
    weight_grads_[{microbatch, stage}] = model_.weight_grad_deferral().take();
  } else {
    model_.backward_layers(first, last);
  }
  if (stage > 0) {
    const Tensor grad = model_.stage_gradient();
    std::memset(input_grad, 0, static_cast<size_t>(input_bytes(stage)));
    copy_tensor(grad, Tensor(input_grad, grad.dtype(), Device::cpu, grad.shape()));
  }
}

void ModelStage::split_backward(bool on) {
  KILN_CHECK(!on || framed(), "dist.pipeline_activations",
             "a split backward holds each micro-batch's activation frame until its weight pass: it needs frames, "
             "not recompute");
  KILN_CHECK(weight_grads_.empty() && frame_of_.empty(), "pipeline", "the backward's split changed mid-step");
  split_ = on;
}

void ModelStage::backward_weight(int microbatch, int stage) {
  if (!split_) return;  // backward_input did the whole backward
  auto it = weight_grads_.find({microbatch, stage});
  KILN_CHECK(it != weight_grads_.end(), "pipeline", "weight pass of micro-batch {} on stage {} before its input pass",
             microbatch, stage);
  WeightGradDeferral::run(it->second);
  weight_grads_.erase(it);
  auto frame = frame_of_.find({microbatch, stage});
  frame_busy_[static_cast<size_t>(frame->second)] = false;
  frame_of_.erase(frame);
}

}  // namespace kiln::pipeline
