// Trainable parameters and the context modules are built in.
#pragma once

#include "core/arena.h"
#include "core/exec_context.h"
#include "nn/loss_terms.h"
#include "nn/step_statistics.h"
#include "nn/param_role.h"
#include "nn/precision_recipe.h"

#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln {

class WeightGradDeferral;

// How llama.cpp lays out a tensor against Hugging Face's (the GGUF exporter's only
// per-tensor transform): rope_rows marks the q/k tensors of rotating layers whose rows
// (projections; biases and q/k norm gains as rows of one) follow a head's dims, which the
// exporter reorders where llama.cpp pairs them otherwise: "llama" pairs interleaved
// (convert_hf_to_gguf.py's permute), and partial rotary rotates the first dims.
enum class GgufLayout { plain, rope_rows };

// A parameter's names: kiln's whole-model name (checkpoints, model.safetensors) and, given
// by the component that reserves it, its tensor name in a stock Hugging Face checkpoint and
// in llama.cpp's GGUF ("" where there is none: the exporters refuse it by name).
struct ParamName {
  std::string kiln;  // "layers.3.attn.q_proj.weight"
  std::string hf;    // "model.layers.3.self_attn.q_proj.weight"
  std::string gguf;  // "blk.3.attn_q.weight"
  GgufLayout gguf_layout = GgufLayout::plain;
  // >= 0: the index of this tensor in a stack that llama.cpp keeps as one tensor under the
  // gguf name (the experts of an MoE layer: [E, rows, cols]).
  int64_t gguf_stack = -1;
};

// The prefixes a component's parameter names get in each naming (a layer's components
// get "layers.3." / "model.layers.3." / "blk.3."); the component adds its leaves.
struct NameScope {
  std::string kiln, hf, gguf;

  ParamName operator()(std::string_view kiln_leaf, std::string_view hf_leaf, std::string_view gguf_leaf,
                       GgufLayout layout = GgufLayout::plain) const;
  // A nested scope: each prefix extended (an empty extension keeps that prefix).
  NameScope child(std::string_view kiln_part, std::string_view hf_part, std::string_view gguf_part) const;
};

// uniform, log_uniform and inverse_softplus_log_uniform draw from [std, hi] (uniform: [-std,
// std]): the short convolution's kaiming bound, and KDA's A_log = log U(1, 16) and dt_bias =
// softplus^-1(dt) with dt log-uniform in [0.001, 0.1] (Mamba's and FLA's initializers).
enum class InitKind { normal, ones, zeros, constant, uniform, log_uniform, inverse_softplus_log_uniform };

struct Init {
  InitKind kind = InitKind::normal;
  double std = 0.02;   // normal: the standard deviation; constant: the value; the ranges' low end
  double hi = 0;       // the ranges' high end
  static Init normal(double std) { return {InitKind::normal, std}; }
  static Init ones() { return {InitKind::ones, 0}; }
  static Init zeros() { return {InitKind::zeros, 0}; }
  static Init constant(double value) { return {InitKind::constant, value}; }
  static Init uniform(double bound) { return {InitKind::uniform, bound}; }
  static Init log_uniform(double lo, double hi) { return {InitKind::log_uniform, lo, hi}; }
  static Init inverse_softplus_log_uniform(double lo, double hi) {
    return {InitKind::inverse_softplus_log_uniform, lo, hi};
  }
};

// A named weight and its gradient. Several parameters may share one fused storage
// (q/k/v projections in one [rows, d] matrix, so one GEMM computes all three): each is
// then a row range of the fused tensors, and keeps its own whole-model name.
class Parameter {
 public:
  Parameter(ParamName names, const Tensor* value_base, const Tensor* grad_base, int64_t row_begin, int64_t row_end,
            ParamRole role, Init init)
      : names_(std::move(names)), value_base_(value_base), grad_base_(grad_base), row_begin_(row_begin),
        row_end_(row_end), role_(role), init_(init) {}

  const std::string& name() const { return names_.kiln; }
  const ParamName& names() const { return names_; }
  Tensor value() const { return value_base_->rows(row_begin_, row_end_); }
  Tensor grad() const {
    return grad_base_ != nullptr && grad_base_->defined() ? grad_base_->rows(row_begin_, row_end_) : Tensor();
  }
  // False for model state without a gradient (a router's balancing bias): saved, loaded and
  // exported with the weights, never optimized.
  bool trainable() const { return grad_base_ != nullptr; }
  // The share of tokens that use this weight (an expert's: top_k / experts): active
  // parameter counts and FLOPs weigh it so.
  double active_fraction() const { return active_fraction_; }
  void set_active_fraction(double f) { active_fraction_ = f; }
  // Used in training only (a multi-token prediction head's): saved in checkpoints, trained,
  // left out by the exporters and the decoder.
  bool training_only() const { return training_only_; }
  void set_training_only() { training_only_ = true; }
  // What it is for: optimizers group parameters by role (train/optimizer_groups.h).
  ParamRole role() const { return role_; }
  const Init& init() const { return init_; }
  // Shape is known at plan time, before memory exists.
  Shape shape() const;

 private:
  ParamName names_;
  const Tensor* value_base_;
  const Tensor* grad_base_;
  int64_t row_begin_, row_end_;
  ParamRole role_;
  Init init_;
  double active_fraction_ = 1.0;
  bool training_only_ = false;
};

// Compute copies of the rank-2 weights on the mixed-precision path: modules compute with
// the bf16 copy while the optimizer, checkpoints and exports see the fp32 master behind
// each Parameter; Model converts every master into its copy before a forward.
struct ComputeWeights {
  explicit ComputeWeights(Device device) : arena("compute weights", device) {}
  Arena arena;                                      // the copies
  std::deque<Tensor> masters;                       // stable homes of the masters
  std::vector<std::pair<const Tensor*, const Tensor*>> pairs;  // (master, copy)
};

// Everything a module needs to plan its memory when it is built.
struct BuildContext {
  // Where the modules' ops run (core/exec_context.h): the model's context, which each
  // module keeps.
  const ExecContext& exec;
  Arena& params;
  Arena& grads;
  Arena& activations;
  Workspace& workspace;
  std::vector<std::unique_ptr<Parameter>>& parameters;
  ComputeWeights& compute_weights;
  // The dtypes and each role's GEMM format (nn/precision_recipe.h); LinearLayer reads it.
  PrecisionRecipe precision;
  Device device;
  int64_t max_tokens;        // fixed token budget of one micro-batch
  bool training;             // gradients and saved activations are planned only when training
  bool deterministic;        // bitwise-reproducible kernels only (BuildOptions::deterministic)
  // The model's objectives: components with loss terms of their own (a router) reserve
  // slots there and read their gradient scale from it.
  LossContext* losses = nullptr;
  // Where the buffers that are not one micro-batch's state go (buffer(): tables, scratch
  // reused by every forward) and the step buffers (step_buffer()); null: `activations`.
  // The model gives each its own arena, so that `activations` holds exactly one
  // micro-batch's state, which activation frames keep several of (model/activation_frames.h),
  // and a recomputed block (whose `activations` is the region such blocks share) puts
  // neither in that region.
  Arena* buffers = nullptr;
  Arena* step_buffers = nullptr;
  // Views of a micro-batch's state that a module keeps from forward to backward (a norm's
  // input): activation frames save and restore them with the memory they point into.
  std::vector<Tensor*>* kept_views = nullptr;
  // QK-Clip's threshold when training with it ([optim.qk_clip]); 0 = off.
  double qk_clip_tau = 0;
  // The model's deferral of LinearLayers' weight gradients (nn/weight_grad_deferral.h), or
  // null: a pipeline stage splitting its backward for ZB-H1 records into it.
  WeightGradDeferral* deferral = nullptr;
  // The model's step statistics (nn/step_statistics.h), which step_statistic() adds to.
  StepStatistics* step_statistics = nullptr;
  // optim.master_weights = "bf16": 2-D weights are bf16 masters, with no fp32 copy.
  bool bf16_masters = false;
  // The recipe's dtypes, as fields for the modules that read them. What GEMMs and attention
  // read: activations and the weights modules hold (bf16 on the GPU's mixed path).
  DType dtype = precision.compute;
  // Parameters, gradients, the residual stream and statistics (norm rstd, softmax lse):
  // f32 on the mixed path, otherwise the same as dtype.
  DType master_dtype = precision.master;

  bool mixed() const { return dtype != master_dtype; }

  // Reserves a weight (and its gradient when training) and registers it under `name` in
  // `role` (which decides its optimizer, learning rate and weight decay: [optim.<role>]).
  // On the mixed path a rank-2 `value` is the bf16 compute copy; rank-1 weights (gains,
  // biases) stay fp32 and are the masters themselves. Gradients are master_dtype.
  void parameter(Tensor& value, Tensor& grad, ParamName name, Shape shape, ParamRole role, Init init);
  // Reserves a fused weight [sum(rows), cols] (or a fused 1-D bias when cols is 0) and
  // registers each row block as a parameter. Returns its master (bound at allocation; value
  // itself unless a compute copy is made), for components that change weights themselves.
  const Tensor& fused_parameter(Tensor& value, Tensor& grad, const std::vector<std::pair<ParamName, int64_t>>& parts,
                       int64_t cols, ParamRole role, Init init);
  // Model state that is not trained by gradients (a router's load-balancing bias): kept
  // in master_dtype with the parameters (saved, loaded, exported), with no gradient.
  void state(Tensor& value, ParamName name, Shape shape, Init init);
  // An activation written in forward and read in backward (compute dtype): one
  // micro-batch's state.
  void saved(Tensor& t, Shape shape);
  // The same in master_dtype: the residual stream and per-row statistics.
  void saved_wide(Tensor& t, Shape shape);
  // One micro-batch's state of any dtype that must exist in evaluation too (outputs read by
  // the next module, a router's choices that backward reads again).
  void saved_buffer(Tensor& t, Shape shape, DType dtype);
  // A buffer no micro-batch owns: tables filled once, weights derived before each use,
  // scratch that one call writes and reads.
  void buffer(Tensor& t, Shape shape, DType dtype);
  // A view of one micro-batch's state that the module assigns in forward and reads in
  // backward (e.g. a norm's input).
  void kept_view(Tensor& view);
  // A buffer whose values outlive a forward: what a component collects over a step's
  // micro-batches and keeps between steps (an MoE layer's load, QK-Clip's logits). Never in
  // a recomputed block's shared region, which the other blocks overwrite.
  void step_buffer(Tensor& t, Shape shape, DType dtype);
  // A step buffer that accumulates over the step's micro-batches, combined over the ranks
  // of a data-parallel run by `reduction` before the step's end acts on it.
  void step_statistic(Tensor& t, Shape shape, DType dtype, StepReduction reduction);

 private:
  // Plans the master of a weight; returns it (value itself unless a compute copy is made).
  const Tensor* weight(Tensor& value, Shape shape);
};

}  // namespace kiln
