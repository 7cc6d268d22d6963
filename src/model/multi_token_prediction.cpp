#include "model/multi_token_prediction.h"

#include "config/layer_pattern.h"
#include "config/mtp_weights.h"
#include "core/device_memory.h"
#include "nn/linear_layer.h"
#include "nn/mup.h"
#include "ops/elementwise/elementwise.h"
#include "ops/embedding/embedding.h"

#include <fmt/format.h>

namespace kiln {

struct MultiTokenPrediction::Module {
  std::unique_ptr<Norm> hidden_norm, embedding_norm, final_norm;
  LinearLayer h_proj, e_proj;  // [hidden, hidden] each: eh_proj's two column blocks
  std::unique_ptr<TransformerBlock> block;
  Tensor embedded;        // master dtype [t, hidden]: the embedding rows of token t+k (the norm keeps them)
  Tensor input, output;   // master dtype [t, hidden]: the block's input x and output h_k
  Tensor dres, dres_compute;  // d(output), then d(input): master dtype, and its compute copy (mixed path)
};

MultiTokenPrediction::MultiTokenPrediction(BuildContext& ctx, const ModelConfig& m, Backbone& backbone, LmHead& head)
    : exec_(ctx.exec), workspace_(ctx.workspace), backbone_(backbone), head_(head), compute_dtype_(ctx.dtype),
      mixed_(ctx.mixed()), parallel_(m.mtp.form == "parallel"), max_tokens_(ctx.max_tokens),
      weights_(mtp_loss_weights(m).depths) {
  const int64_t t = ctx.max_tokens, d = m.hidden, depth = m.mtp.depth;
  const size_t first_parameter = ctx.parameters.size();
  for (int64_t k = 1; k <= depth; ++k) {
    // A depth's loss is reported as the mean over its own targets (its third slot).
    const int first = static_cast<int>(ctx.losses->terms.slots().size());
    LossTerm loss{fmt::format("mtp.{}", k), true, LossTerm::Per::target, first + 2};
    first_slots_.push_back(ctx.losses->terms.reserve(
        {loss, {fmt::format("mtp.{}.z", k), false}, {fmt::format("mtp.{}.targets", k), false}}));
  }
  const size_t row_block = Workspace::footprint(ctx.dtype, Shape{t, d});
  if (parallel_) {
    head_weights_.resize(static_cast<size_t>(depth));
    head_grads_.resize(static_cast<size_t>(depth));
    for (int64_t k = 1; k <= depth; ++k) {
      const std::string leaf = fmt::format("mtp.{}.head.weight", k - 1);
      ctx.parameter(head_weights_[static_cast<size_t>(k - 1)], head_grads_[static_cast<size_t>(k - 1)],
                    ParamName{leaf, leaf, ""}, Shape{m.vocab_size, d}, ParamRole::head,
                    mup_enabled(m) ? Init::zeros() : Init::normal(m.init_std));
    }
    ctx.workspace.reserve_peak(row_block, Workspace::Level::outer);  // a head's d(hidden)
  } else {
    const LayerChoices last_layer = layer_choices(m, m.layers - 1);
    const std::string& final_norm = m.final_norm.empty() ? m.norm : m.final_norm;
    for (int64_t k = 1; k <= depth; ++k) {
      // DeepSeek-V3's names: its MTP module k is layer L + k - 1 of the checkpoint.
      const std::string index = std::to_string(m.layers + k - 1);
      const NameScope names{fmt::format("mtp.{}.", k - 1), "model.layers." + index + ".", "blk." + index + "."};
      auto mod = std::make_unique<Module>();
      auto norm = [&](const char* kind_key, const std::string& kind, NameScope scope) {
        return norm_registry().build(kind_key, kind, ctx, NormSpec{scope, d, t, m.norm_eps, m.dyt_alpha});
      };
      mod->hidden_norm = norm("model.norm", m.norm, names.child("hnorm.", "hnorm.", "hnorm."));
      mod->embedding_norm = norm("model.norm", m.norm, names.child("enorm.", "enorm.", "enorm."));
      mod->h_proj.declare(ctx, names("h_proj.weight", "h_proj.weight", ""), d, d, ParamRole::matrix,
                          Init::normal(hidden_init_std(m)));
      mod->e_proj.declare(ctx, names("e_proj.weight", "e_proj.weight", ""), d, d, ParamRole::matrix,
                          Init::normal(hidden_init_std(m)));
      const LayerSpec layer{names.child("block.", "", ""), m.layers + k - 1, &m, last_layer};
      mod->block = std::make_unique<TransformerBlock>(ctx, layer, backbone.position());
      mod->final_norm = norm(m.final_norm.empty() ? "model.norm" : "model.final_norm", final_norm,
                             names.child("norm.", "shared_head.norm.", "nextn.shared_head_norm."));
      ctx.saved_wide(mod->embedded, Shape{t, d});
      ctx.saved_wide(mod->input, Shape{t, d});
      ctx.saved_wide(mod->output, Shape{t, d});
      if (ctx.training) {
        ctx.buffer(mod->dres, Shape{t, d}, ctx.master_dtype);
        if (mixed_) ctx.buffer(mod->dres_compute, Shape{t, d}, ctx.dtype);
      }
      modules_.push_back(std::move(mod));
    }
    if (ctx.training) {
      ctx.buffer(dh0_, Shape{t, d}, ctx.master_dtype);
      ctx.buffer(dembedding_, Shape{t, d}, ctx.master_dtype);
      ctx.buffer(dembedding_source_, Shape{t + 1, d}, ctx.master_dtype);
    }
    // The most a module holds outside its block: four row blocks of the compute dtype and
    // one of the master's (the gathered embedding gradient).
    ctx.workspace.reserve_peak(4 * row_block + Workspace::footprint(ctx.master_dtype, Shape{t, d}),
                               Workspace::Level::outer);
  }
  for (size_t i = first_parameter; i < ctx.parameters.size(); ++i) ctx.parameters[i]->set_training_only();
}

MultiTokenPrediction::~MultiTokenPrediction() = default;

void MultiTokenPrediction::stage_inputs(const HostBatch& batch, int64_t t, int64_t depth, int32_t* out) {
  const int64_t rows = batch.size();
  for (int64_t k = 1; k <= depth; ++k) {
    int32_t* tokens = out + 3 * (k - 1) * t;
    int32_t* targets = tokens + t;
    int32_t* gradient_rows = targets + t;
    for (int64_t i = 0; i < t; ++i) {
      tokens[i] = i < rows ? batch.tokens[static_cast<size_t>(i)] : 0;
      targets[i] = kIgnoreTarget;
      gradient_rows[i] = static_cast<int32_t>(t);
    }
    for (int64_t s = 0; s + 1 < static_cast<int64_t>(batch.cu_seqlens.size()); ++s) {
      const int64_t begin = batch.cu_seqlens[static_cast<size_t>(s)], end = batch.cu_seqlens[static_cast<size_t>(s + 1)];
      for (int64_t i = begin; i + k < end; ++i) {
        tokens[i] = batch.tokens[static_cast<size_t>(i + k)];
        targets[i] = batch.targets[static_cast<size_t>(i + k)];
        gradient_rows[i + k] = static_cast<int32_t>(i);
      }
    }
  }
}

void MultiTokenPrediction::bind_inputs(const Tensor& inputs) {
  const int64_t t = max_tokens_;
  tokens_.clear(), targets_.clear(), gradient_rows_.clear();
  for (int64_t k = 0; k < depth(); ++k) {
    tokens_.push_back(inputs.rows(3 * k * t, (3 * k + 1) * t));
    targets_.push_back(inputs.rows((3 * k + 1) * t, (3 * k + 2) * t));
    gradient_rows_.push_back(inputs.rows((3 * k + 2) * t, (3 * k + 3) * t));
  }
  if (dembedding_source_.defined()) zero_tensor(dembedding_source_.rows(t, t + 1));  // nothing writes it after
}

void MultiTokenPrediction::run(int64_t rows, const SeqInfo& seq, LossScale scale, bool backward, LossSlotSums& sums,
                               double* device_sums) {
  rows_ = rows;
  if (parallel_) run_parallel(rows, scale, backward, sums, device_sums);
  else run_sequential(rows, seq, scale, backward, sums, device_sums);
}

Backbone::ExtraGradients MultiTokenPrediction::backbone_extra() const {
  if (parallel_) return {};  // the heads added into d(hidden) themselves
  return {dh0_.rows(0, rows_), dembedding_.rows(0, rows_)};
}

void MultiTokenPrediction::run_parallel(int64_t rows, LossScale scale, bool backward, LossSlotSums& sums,
                                        double* device_sums) {
  const Tensor hidden = backbone_.hidden().rows(0, rows);
  for (size_t k = 0; k < weights_.size(); ++k) {
    Workspace::Scope scope(workspace_);
    const Tensor dh = backward ? scope.take(compute_dtype_, hidden.shape()) : Tensor();
    head_.loss_through(head_weights_[k], head_grads_[k], weights_[k], first_slots_[k], hidden, targets_[k].rows(0, rows),
                       scale, dh, sums, device_sums);
    if (backward) ops::add_inplace(exec_, backbone_.dhidden().rows(0, rows), dh);
  }
}

void MultiTokenPrediction::run_sequential(int64_t rows, const SeqInfo& seq, LossScale scale, bool backward,
                                          LossSlotSums& sums, double* device_sums) {
  const Tensor table = backbone_.embedding().value();
  const Shape shape{rows, table.size(1)};
  // Forward, depth by depth: each module reads the one before.
  for (size_t k = 0; k < modules_.size(); ++k) {
    Module& mod = *modules_[k];
    const Tensor previous = k == 0 ? backbone_.residual(backbone_.blocks().size()) : modules_[k - 1]->output;
    ops::embedding_forward(exec_, tokens_[k].rows(0, rows), table, mod.embedded.rows(0, rows));
    {
      Workspace::Scope scope(workspace_);
      const Tensor hn = scope.take(compute_dtype_, shape), en = scope.take(compute_dtype_, shape);
      const Tensor from_hidden = scope.take(compute_dtype_, shape), from_embedding = scope.take(compute_dtype_, shape);
      mod.hidden_norm->forward(previous.rows(0, rows), hn);
      mod.embedding_norm->forward(mod.embedded.rows(0, rows), en);
      mod.h_proj.forward(hn, from_hidden);
      mod.e_proj.forward(en, from_embedding);
      // x = W_h hn + W_e en, summed in the master dtype (the residual stream's).
      ops::convert(exec_, from_hidden, mod.input.rows(0, rows));
      ops::add(exec_, mod.input.rows(0, rows), from_embedding, mod.input.rows(0, rows));
    }
    mod.block->forward(mod.input.rows(0, rows), seq, mod.output.rows(0, rows));
  }
  // Losses, and with backward the gradients from the last depth down to the first: module
  // k's d(h_{k-1}) is module k-1's d(output).
  for (size_t k = modules_.size(); k-- > 0;) {
    Module& mod = *modules_[k];
    const Tensor dres = backward ? mod.dres.rows(0, rows) : Tensor();
    const Tensor dres_compute = mixed_ && backward ? mod.dres_compute.rows(0, rows) : dres;
    {
      Workspace::Scope scope(workspace_);
      const Tensor normed = scope.take(compute_dtype_, shape);
      const Tensor dnormed = backward ? scope.take(compute_dtype_, shape) : Tensor();
      mod.final_norm->forward(mod.output.rows(0, rows), normed);
      head_.loss_through(head_.weight(), head_.weight_grad(), weights_[k], first_slots_[k], normed,
                         targets_[k].rows(0, rows), scale, dnormed, sums, device_sums);
      if (!backward) continue;
      // The deeper module (run first) already wrote d(h_k) here.
      const bool deeper = k + 1 < modules_.size();
      mod.final_norm->backward(dnormed, dres, deeper, mixed_ ? dres_compute : Tensor());
    }
    mod.block->backward(dres, dres_compute, seq);
    Workspace::Scope scope(workspace_);
    const Tensor hn = scope.take(compute_dtype_, shape), en = scope.take(compute_dtype_, shape);
    const Tensor dhn = scope.take(compute_dtype_, shape), den = scope.take(compute_dtype_, shape);
    mod.hidden_norm->recompute(hn);
    mod.embedding_norm->recompute(en);
    mod.h_proj.backward(hn, dres_compute, dhn);
    mod.e_proj.backward(en, dres_compute, den);
    // d(embedding rows of t+k), then gathered back k rows to the rows whose tokens they are.
    mod.embedding_norm->backward(den, dembedding_source_.rows(0, rows), false);
    const bool first_written = k + 1 == modules_.size();
    const Tensor gathered = first_written ? dembedding_.rows(0, rows) : scope.take(dembedding_.dtype(), shape);
    ops::embedding_forward(exec_, gradient_rows_[k].rows(0, rows), dembedding_source_, gathered);
    if (!first_written) ops::add_inplace(exec_, dembedding_.rows(0, rows), gathered);
    if (k == 0) {
      mod.hidden_norm->backward(dhn, dh0_.rows(0, rows), false);
    } else {
      Module& before = *modules_[k - 1];
      mod.hidden_norm->backward(dhn, before.dres.rows(0, rows), false,
                                mixed_ ? before.dres_compute.rows(0, rows) : Tensor());
    }
  }
}

double MultiTokenPrediction::extra_forward_flops_per_token(int64_t seq_len) const {
  double flops = 0;
  for (const auto& mod : modules_) flops += mod->block->extra_forward_flops_per_token(seq_len);
  return flops;
}

void MultiTokenPrediction::after_step(bool applied) {
  for (const auto& mod : modules_) mod->block->after_step(applied);
}

void MultiTokenPrediction::report(std::vector<std::pair<std::string, double>>& out) const {
  for (const auto& mod : modules_) mod->block->report(out);
}

}  // namespace kiln
