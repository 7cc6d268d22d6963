#include "model/backbone.h"

#include "config/layer_pattern.h"
#include "model/skipped_module.h"
#include "ops/dropout/dropout.h"
#include "ops/elementwise/elementwise.h"
#include "ops/embedding/embedding.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace kiln {

Backbone::Backbone(BuildContext& ctx, const ModelConfig& config, const BuildOptions& options,
                   std::vector<std::unique_ptr<Arena>>& recompute_arenas)
    : exec_(ctx.exec), config_(config), losses_(ctx.losses), recompute_blocks_(options.recompute_blocks) {
  const int64_t t = options.max_tokens, d = config.hidden;
  check_stage_layers(config, options);
  const bool last_built = options.builds_layer(config.layers - 1);
  if (options.builds_layer(0) || (config.tie_embeddings && last_built)) {
    ctx.parameter(embed_w_, embed_g_, ParamName{"embed.weight", "model.embed_tokens.weight", "token_embd.weight"},
                  Shape{config.vocab_size, d}, ParamRole::embedding, Init::normal(config.init_std));
    embed_ = ctx.parameters.back().get();
  } else {
    skipped_parameters_.push_back({ctx.parameters.size(), 1});
  }
  position_ = position_registry().build("model.position", config.position, ctx, config);
  if (config.rope.local_theta > 0) {
    // The windowed layers' RoPE (Gemma 3's local layers): its own base, unscaled, the
    // fraction kept. The encoding copies what it reads, so the edited config may go.
    ModelConfig local = config;
    local.rope_theta = config.rope.local_theta;
    local.rope = RopeConfig{};
    local.rope.fraction = config.rope.fraction;
    local_position_ = position_registry().build("model.position", config.position, ctx, local);
  }
  KILN_CHECK(options.recompute_blocks >= 0 && options.recompute_blocks <= config.layers, "train.recompute_blocks",
             "{} blocks to recompute, but the model has {} (model.layers)", options.recompute_blocks, config.layers);
  residual_.resize(static_cast<size_t>(config.layers + 1));
  for (int64_t l = 0; l < config.layers; ++l) {
    // Block l's segment of the activation arena: its input row of the residual stream, then
    // whatever the block saves there.
    FrameSegment segment{ctx.activations.entry_count(), 0, ctx.kept_views ? ctx.kept_views->size() : 0, 0};
    // Its runs of the other arenas (none of a buffer arena the context lacks: those land in
    // the activation segment).
    const auto entries = [](const Arena* arena) { return arena != nullptr ? arena->entry_count() : size_t{0}; };
    const auto mark = [&] {
      return BlockRuns{{ctx.parameters.size(), 0},
                       {ctx.params.entry_count(), 0},
                       {ctx.compute_weights.arena.entry_count(), 0},
                       {ctx.grads.entry_count(), 0},
                       {entries(ctx.buffers), 0},
                       {entries(ctx.step_buffers), 0}};
    };
    BlockRuns runs = mark();
    // Block l's input: where it runs, and where the block before it leaves its output.
    const bool built = options.builds_layer(l);
    if (built || (l > 0 && options.builds_layer(l - 1)))
      ctx.saved_wide(residual_[static_cast<size_t>(l)], Shape{options.max_tokens, config.hidden});
    const std::string index = std::to_string(l);
    const LayerSpec layer{NameScope{"layers." + index + ".", "model.layers." + index + ".", "blk." + index + "."}, l,
                          &config, layer_choices(config, l)};
    PositionEncoding& position = local_position_ && layer.choices.window > 0 ? *local_position_ : *position_;
    // The block's recipe (train.fp8_layers may leave it out of FP8), restored after it.
    const PrecisionRecipe model_recipe = ctx.precision;
    ctx.precision = model_recipe.for_block(l, config.layers);
    if (!built) {  // another stage's: only counted (model/skipped_module.h)
      const size_t at = ctx.parameters.size();
      const size_t count = count_skipped_parameters(
          ctx, [&](BuildContext& skipped) { TransformerBlock block(skipped, layer, position); });
      skipped_parameters_.push_back({at, count});
      blocks_.push_back(nullptr);
    } else if (options.training && l < options.recompute_blocks) {
      // The block plans its saved activations in its own arena, bound later to the
      // region every recomputed block shares.
      recompute_arenas.push_back(std::make_unique<Arena>("recomputed activations", options.device));
      // Its other buffers and step buffers stay where the model's go (the model's own
      // activation arena where the model has none for them).
      BuildContext block_ctx{.exec = ctx.exec,
                             .params = ctx.params,
                             .grads = ctx.grads,
                             .activations = *recompute_arenas.back(),
                             .workspace = ctx.workspace,
                             .parameters = ctx.parameters,
                             .compute_weights = ctx.compute_weights,
                             .precision = ctx.precision,
                             .device = ctx.device,
                             .max_tokens = ctx.max_tokens,
                             .training = ctx.training,
                             .deterministic = ctx.deterministic,
                             .losses = ctx.losses,
                             .buffers = ctx.buffers != nullptr ? ctx.buffers : &ctx.activations,
                             .step_buffers = ctx.step_buffers != nullptr ? ctx.step_buffers : &ctx.activations,
                             .kept_views = ctx.kept_views,
                             .qk_clip_tau = ctx.qk_clip_tau,
                             .step_statistics = ctx.step_statistics,
                             .bf16_masters = ctx.bf16_masters};
      blocks_.push_back(std::make_unique<TransformerBlock>(block_ctx, layer, position));
    } else {
      blocks_.push_back(std::make_unique<TransformerBlock>(ctx, layer, position));
    }
    ctx.precision = model_recipe;
    segment.last_entry = ctx.activations.entry_count();
    segment.last_view = ctx.kept_views ? ctx.kept_views->size() : 0;
    block_segments_.push_back(segment);
    const BlockRuns end = mark();
    runs.parameters.second = end.parameters.first;
    runs.params.second = end.params.first;
    runs.compute_weights.second = end.compute_weights.first;
    runs.grads.second = end.grads.first;
    runs.buffers.second = end.buffers.first;
    runs.step_buffers.second = end.step_buffers.first;
    block_runs_.push_back(runs);
  }
  // QK-Clip applies to the mixers with query-key logits (TokenMixer::clips_qk); asked for
  // with none, it would silently do nothing.
  // (A stage's model may hold none of those layers: the whole model's check covers it.)
  const bool any_clips =
      std::any_of(blocks_.begin(), blocks_.end(), [](const auto& b) { return b && b->mixer().clips_qk(); });
  KILN_CHECK(ctx.qk_clip_tau == 0 || any_clips || !options.whole(), "config",
             "optim.qk_clip.enabled = true: no layer's token mixer has query-key logits to clip (model.attention = "
             "'{}', model.alt_attention = '{}')",
             config.attention, config.alt_attention);
  const bool own_final_norm = !config.final_norm.empty();
  const auto build_final_norm = [&](BuildContext& c) {
    return norm_registry().build(
        own_final_norm ? "model.final_norm" : "model.norm", own_final_norm ? config.final_norm : config.norm, c,
        NormSpec{NameScope{"final_norm.", "model.norm.", "output_norm."}, d, t, config.norm_eps, config.dyt_alpha});
  };
  if (last_built) {
    final_norm_ = build_final_norm(ctx);
  } else {
    const size_t at = ctx.parameters.size();
    skipped_parameters_.push_back({at, count_skipped_parameters(ctx, [&](BuildContext& c) { build_final_norm(c); })});
  }
  if (config.attn_res_block > 0) {
    // Recompute reruns a block's forward from the residual stream, which these blocks do not
    // read; multi-token prediction's gradient into the final norm's input is not wired here.
    KILN_CHECK(options.recompute_blocks == 0, "model.attn_res_block",
               "Block Attention Residuals do not take train.recompute_blocks yet ({} asked)", options.recompute_blocks);
    KILN_CHECK(config.mtp.depth == 0, "model.attn_res_block",
               "Block Attention Residuals do not take model.mtp yet (model.mtp.depth = {})", config.mtp.depth);
    attn_res_ = std::make_unique<BlockAttnRes>(ctx, config);
  }
  if (last_built) {
    ctx.saved_wide(residual_.back(), Shape{t, d});
    ctx.saved(hidden_, Shape{t, d});
  }
  if (options.training) {
    if (last_built) ctx.buffer(dhidden_, Shape{t, d}, ctx.dtype);
    ctx.buffer(dres_, Shape{t, d}, ctx.master_dtype);
    // The mixed path's bf16 copy of dres, which the branches read (kept by the norms).
    if (ctx.mixed()) ctx.buffer(dres_compute_, Shape{t, d}, ctx.dtype);
  }
}

void Backbone::forward(const Tensor& tokens, const SeqInfo& seq) { forward_layers(tokens, seq, 0, config_.layers); }

void Backbone::check_stage_layers(const ModelConfig& config, const BuildOptions& options) {
  for (const auto& [first, last] : options.layers)
    KILN_CHECK(0 <= first && first < last && last <= config.layers, "model",
               "a stage's layers [{}, {}) outside the model's {} layers (model.layers)", first, last, config.layers);
  if (options.whole()) return;
  KILN_CHECK(config.attn_res_block == 0, "model.attn_res_block",
             "Block Attention Residuals are not built per pipeline stage: their sublayers read more than the "
             "residual stream");
  KILN_CHECK(config.mtp.depth == 0, "model.mtp.depth",
             "multi-token prediction is not built per pipeline stage (depth {})", config.mtp.depth);
}

bool Backbone::whole() const {
  return embed_ != nullptr && final_norm_ != nullptr &&
         std::all_of(blocks_.begin(), blocks_.end(), [](const auto& b) { return b != nullptr; });
}

void Backbone::check_layer_range(int64_t first, int64_t last) const {
  KILN_CHECK(0 <= first && first <= last && last <= config_.layers, "model",
             "layer range [{}, {}) outside the model's {} layers (model.layers)", first, last, config_.layers);
  for (int64_t l = first; l < last; ++l)
    KILN_CHECK(blocks_[static_cast<size_t>(l)] != nullptr, "model",
               "layer {} is not in this pipeline stage's model (layers [{}, {}) asked)", l, first, last);
  KILN_CHECK(first > 0 || embed_ != nullptr, "model", "the embedding is not in this pipeline stage's model");
  KILN_CHECK(!attn_res_ || (first == 0 && last == config_.layers), "model.attn_res_block",
             "Block Attention Residuals run over all layers at once, not over layers [{}, {})", first, last);
}

void Backbone::forward_layers(const Tensor& tokens, const SeqInfo& seq, int64_t first, int64_t last) {
  check_layer_range(first, last);
  rows_ = tokens.size(0);
  if (first == 0) {
    ops::embedding_forward(exec_, tokens, embed_->value(), residual_[0].rows(0, rows_));
    if (config_.embed_scale != 1.0) ops::scale_inplace(exec_, residual_[0].rows(0, rows_), config_.embed_scale);
    if (embedding_drops(seq))
      ops::dropout_apply(exec_, residual_[0].rows(0, rows_), embedding_dropout(seq), residual_[0].rows(0, rows_));
  }
  if (attn_res_) {
    forward_attn_res(seq);
  } else {
    for (auto l = static_cast<size_t>(first); l < static_cast<size_t>(last); ++l)
      blocks_[l]->forward(residual_[l].rows(0, rows_), seq, residual_[l + 1].rows(0, rows_));
  }
  if (last == config_.layers) final_norm_->forward(residual_.back().rows(0, rows_), hidden_.rows(0, rows_));
}

void Backbone::backward(const Tensor& tokens, const SeqInfo& seq, const ops::TokenGroups* groups,
                        const ExtraGradients& extra, const BackwardProgress* progress) {
  const auto tell = [progress](int event) {
    if (progress) (*progress)(event);
  };
  const Tensor dres = dres_.rows(0, rows_);
  const Tensor dres_compute = dres_compute_.defined() ? dres_compute_.rows(0, rows_) : dres;
  if (attn_res_) {
    backward_attn_res(seq, extra, tell);
  } else {
    backward_blocks(dres, dres_compute, seq, extra, tell, 0, config_.layers);
  }
  embedding_backward(tokens, dres, seq, groups, extra);
  tell(static_cast<int>(blocks_.size()) + 1);
}

void Backbone::backward_layers(const Tensor& tokens, const SeqInfo& seq, const ops::TokenGroups* groups,
                               int64_t first, int64_t last) {
  check_layer_range(first, last);
  if (attn_res_) {  // the whole model (check_layer_range)
    backward(tokens, seq, groups);
    return;
  }
  // The rows of the micro-batch this backward is for: with activation frames, another
  // micro-batch's forward may have run since its own.
  rows_ = tokens.size(0);
  const Tensor dres = dres_.rows(0, rows_);
  const Tensor dres_compute = dres_compute_.defined() ? dres_compute_.rows(0, rows_) : dres;
  // A later stage's output gradient arrives in dres (wide): the mixed path's blocks read its
  // compute copy too, which the final norm's backward keeps on the last stage.
  if (last < config_.layers && dres_compute_.defined()) ops::convert(exec_, dres, dres_compute);
  backward_blocks(dres, dres_compute, seq, ExtraGradients{}, [](int) {}, first, last);
  if (first == 0) embedding_backward(tokens, dres, seq, groups, ExtraGradients{});
}

void Backbone::backward_blocks(const Tensor& dres, const Tensor& dres_compute, const SeqInfo& seq,
                               const ExtraGradients& extra, const std::function<void(int)>& tell, int64_t first,
                               int64_t last) {
  if (last == config_.layers) {
    // A head's gradient of the final norm's input goes in first, so the norm's backward adds
    // to it and keeps the mixed path's bf16 copy current.
    const bool extra_top = extra.final_norm_input.defined();
    if (extra_top) ops::convert(exec_, extra.final_norm_input, dres);
    final_norm_->backward(dhidden_.rows(0, rows_), dres, extra_top, dres_compute_.defined() ? dres_compute : Tensor());
    tell(0);
  }
  for (auto l = static_cast<size_t>(last); l-- > static_cast<size_t>(first);) {
    // A recomputed block's saved activations were overwritten by later blocks: run its
    // forward again from its saved input (it rewrites its output with the same values).
    if (static_cast<int64_t>(l) < recompute_blocks_) {
      losses_->recomputing = true;
      blocks_[l]->forward(residual_[l].rows(0, rows_), seq, residual_[l + 1].rows(0, rows_));
      losses_->recomputing = false;
    }
    blocks_[l]->backward(dres, dres_compute, seq);
    tell(static_cast<int>(blocks_.size() - l));
  }
}

void Backbone::embedding_backward(const Tensor& tokens, const Tensor& dres, const SeqInfo& seq,
                                  const ops::TokenGroups* groups, const ExtraGradients& extra) {
  // The embedding's dropout and scale, onto the residual's gradient (read by nothing after
  // the table's).
  if (embedding_drops(seq)) ops::dropout_apply(exec_, dres, embedding_dropout(seq), dres);
  if (config_.embed_scale != 1.0) ops::scale_inplace(exec_, dres, config_.embed_scale);
  // Rows of the table read by heads directly (unscaled, undropped): their gradient joins here.
  if (extra.embedding_rows.defined()) ops::add_inplace(exec_, dres, extra.embedding_rows);
  if (groups != nullptr) {  // GPU: fixed summation order, no atomics
    ops::TokenGroups g = *groups;
    g.order = groups->order.rows(0, rows_);
    ops::embedding_backward(exec_, g, dres, embed_g_);
  } else {
    ops::embedding_backward(exec_, tokens, dres, embed_g_);
  }
}

// Sublayer j = 2l + which reads the mix attn_res_->mix(j) (layer 0's attention: the
// embedding itself) and adds its output to its block's sum; the final read mixes them all.
void Backbone::forward_attn_res(const SeqInfo& seq) {
  const BlockAttnRes& res = *attn_res_;
  const Tensor embedding = residual_[0].rows(0, rows_), out = res.output(rows_);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const auto j = static_cast<int64_t>(2 * l);
    const Tensor attn_in = residual_[l].rows(0, rows_), mlp_in = blocks_[l]->mlp_input(rows_);
    if (j > 0) res.mix(j, embedding, attn_in);
    blocks_[l]->sublayer_forward(Sublayer::attention, attn_in, seq, out);
    res.add_output(j, out);
    res.mix(j + 1, embedding, mlp_in);
    blocks_[l]->sublayer_forward(Sublayer::mlp, mlp_in, seq, out);
    res.add_output(j + 1, out);
  }
  res.mix(res.sublayers(), embedding, residual_.back().rows(0, rows_));
}

// The reverse: each sublayer's output gradient is its block sum's, complete once the
// sublayers after it have given theirs (BlockAttnRes::output_grad); every mix's gradient
// reaches the embedding's output through dres, which starts at zero.
void Backbone::backward_attn_res(const SeqInfo& seq, const ExtraGradients& extra, const std::function<void(int)>& tell) {
  const BlockAttnRes& res = *attn_res_;
  const Tensor embedding = residual_[0].rows(0, rows_), dres = dres_.rows(0, rows_);
  const Tensor dinput = res.input_grad(rows_);
  (void)extra;  // multi-token prediction is refused at build (the constructor)
  ops::zero(exec_, dres);  // on the stream: captured steps
  res.begin_backward(rows_);
  final_norm_->backward(dhidden_.rows(0, rows_), dinput, false);
  res.mix_backward(res.sublayers(), embedding, dinput, dres);
  tell(0);
  for (size_t l = blocks_.size(); l-- > 0;) {
    const auto j = static_cast<int64_t>(2 * l);
    blocks_[l]->sublayer_backward(Sublayer::mlp, res.output_grad(j + 1, rows_), seq, dinput, false);
    res.mix_backward(j + 1, embedding, dinput, dres);
    if (j > 0) {
      blocks_[l]->sublayer_backward(Sublayer::attention, res.output_grad(j, rows_), seq, dinput, false);
      res.mix_backward(j, embedding, dinput, dres);
    } else {  // layer 0's attention read the embedding itself
      blocks_[l]->sublayer_backward(Sublayer::attention, res.output_grad(j, rows_), seq, dres, true);
    }
    tell(static_cast<int>(blocks_.size() - l));
  }
}

void Backbone::export_config(ExportConfig& out) const {
  const ModelConfig& m = config_;
  KILN_CHECK(whole(), "model", "a pipeline stage's model holds part of the layers: export the whole model");
  if (attn_res_)
    out.refuse("model.attn_res_block", fmt::format("{}", m.attn_res_block),
               "no stock family mixes its sublayers' inputs over depth (Block Attention Residuals)");
  if (!m.final_norm.empty() && m.final_norm != m.norm)
    out.refuse("model.final_norm", fmt::format("'{}'", m.final_norm),
               fmt::format("the exported families' final norm is their blocks' ('{}')", m.norm));
  const bool gemma = out.gemma();
  // Gemma multiplies the embedding by sqrt(hidden_size), which it derives: no other scale.
  const double gemma_scale = std::sqrt(static_cast<double>(m.hidden));
  if (gemma && std::abs(m.embed_scale - gemma_scale) > 1e-12 * gemma_scale)
    out.refuse("model.embed_scale", fmt::format("{}", m.embed_scale),
               fmt::format("Gemma scales the embedding by sqrt(hidden) = {}", gemma_scale));
  if (!gemma && m.embed_scale != 1.0)
    out.refuse("model.embed_scale", fmt::format("{}", m.embed_scale), "the exported families do not scale the embedding");
  if (out.format() == ExportConfig::Format::hf) {
    out.set("vocab_size", m.vocab_size, "model.vocab_size");
    out.set("hidden_size", m.hidden, "model.hidden");
    out.set("num_hidden_layers", m.layers, "model.layers");
    out.set("max_position_embeddings", m.max_seq_len, "model.max_seq_len");
    out.set("initializer_range", m.init_std, "model.init_std");
  } else {
    out.set("vocab_size", m.vocab_size, "model.vocab_size");
    out.set("context_length", m.max_seq_len, "model.max_seq_len");
    out.set("embedding_length", m.hidden, "model.hidden");
    out.set("block_count", m.layers, "model.layers");
  }
  position_->export_config(out);
  bool windowed = false;
  for (int64_t l = 0; l < m.layers; ++l) windowed = windowed || layer_choices(m, l).window > 0;
  // llama.cpp's gemma2 always builds its sliding-window cache, which asserts that some layer
  // slides (llama-model.cpp: GGML_ASSERT(hparams.is_swa_any())): a file without one crashes it.
  if (out.is("gemma2") && out.format() == ExportConfig::Format::gguf && !windowed)
    out.refuse("model.sliding_window", std::to_string(m.sliding_window),
               "llama.cpp's gemma2 needs at least one sliding layer (it aborts on a file without one)");
  if (out.is("gemma3_text")) {
    // Gemma 3's sliding layers rotate by rope_local_base_freq, unscaled: kiln's local base
    // (or, without one, its single base where no scaling makes the two differ).
    if (windowed && !local_position_ && m.rope.scaling != "none")
      out.refuse("model.rope.local_theta", "0",
                 "Gemma 3's sliding layers rotate unscaled at rope_local_base_freq: set model.rope.local_theta");
    const double local = local_position_ ? m.rope.local_theta : m.rope_theta;
    // llama.cpp's gemma3 reads rope.freq_base_swa for its sliding layers (when it has a window).
    if (out.format() == ExportConfig::Format::hf) out.set("rope_local_base_freq", local, "model.rope.local_theta");
    else if (windowed) out.set("rope.freq_base_swa", static_cast<float>(local), "model.rope.local_theta");
  } else if (local_position_) {
    out.refuse("model.rope.local_theta", fmt::format("{}", m.rope.local_theta),
               "only Gemma 3 has a RoPE base of its own for the windowed layers");
  }
  for (const auto& block : blocks_) block->export_config(out);
  final_norm_->export_config(out);
}

void Backbone::after_step(bool applied) {
  for (const auto& block : blocks_)
    if (block) block->after_step(applied);
}

void Backbone::report(std::vector<std::pair<std::string, double>>& out) const {
  for (const auto& block : blocks_)
    if (block) block->report(out);
}

double Backbone::extra_forward_flops_per_token(int64_t seq_len) const {
  double flops = 0;
  for (const auto& block : blocks_)
    if (block) flops += block->extra_forward_flops_per_token(seq_len);
  if (attn_res_) flops += attn_res_->forward_flops_per_token();
  return flops;
}

}  // namespace kiln
