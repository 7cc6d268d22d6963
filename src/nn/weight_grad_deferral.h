// Deferred weight gradients: ZB-H1's split of a backward into B (input gradients) and W
// (weight gradients), train/pipeline_model_stage.h.
//
// While a deferral records, every LinearLayer's backward computes dx only and leaves here
// what its weight (and bias) gradient needs: the layer (a copy: its weight, gradients and
// FP8 kept-input buffers as bound now) and copies of x and dy. run() then adds those
// gradients in the order they were recorded -- the order the undeferred backward adds them
// -- with the same operands, so the gradients are the same bits. Copies because a backward
// reuses its dy buffers, and some modules rebuild x in scratch (the gated MLP's activation)
// or overwrite it after the weight gradient; an x whose FP8 operand was kept from the
// forward is not read, and not copied: the operand lives in the micro-batch's activation
// frame, which the caller holds until run(). Other parameters' gradients (norms,
// embeddings, routers, experts) are not LinearLayers' and stay in the backward.
#pragma once

#include "core/tensor.h"
#include "nn/linear_layer.h"

#include <memory>
#include <vector>

namespace kiln {

class WeightGradDeferral {
 public:
  struct Pending {
    LinearLayer layer;
    std::unique_ptr<OwnedTensor> x_copy, dy;  // x_copy null: x is not read (FP8 kept input)
    Tensor x;
  };

  bool recording() const { return recording_; }
  // Starts recording one backward's weight gradients; take() ends it.
  void begin();
  std::vector<Pending> take();
  void record(const LinearLayer& layer, const Tensor& x, const Tensor& dy);

  // Adds the recorded gradients, in recorded order.
  static void run(const std::vector<Pending>& pending);

 private:
  bool recording_ = false;
  std::vector<Pending> pending_;
};

}  // namespace kiln
