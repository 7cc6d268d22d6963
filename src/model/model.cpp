#include "model/model.h"

#include "core/device_memory.h"
#include "core/rng.h"
#include "ops/embedding/embedding.h"
#include "ops/elementwise/elementwise.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace kiln {

Model::Model(const ModelConfig& config, const BuildOptions& options)
    : config_(config),
      options_(options),
      params_("parameters", options.device),
      grads_("gradients", options.device),
      activations_("activations", options.device),
      workspace_(options.device),
      compute_weights_(options.device) {
  const int64_t t = options.max_tokens, d = config.hidden;
  KILN_CHECK(options.dtype != DType::bf16 || options.device == Device::cuda, "model",
             "bf16 (mixed precision) runs on the GPU only; the CPU computes in f32");
  const DType master = options.dtype == DType::bf16 ? DType::f32 : options.dtype;
  BuildContext ctx{params_,          grads_,        activations_,   workspace_, parameters_, compute_weights_,
                   options.dtype,    master,        options.device, t,          options.training,
                   options.deterministic};
  ctx.parameter(embed_w_, embed_g_, "embed.weight", Shape{config.vocab_size, d}, false,
                Init::normal(config.init_std));
  embed_ = parameters_.back().get();
  position_ = position_registry().build("model.position", config.position, ctx, config_);
  KILN_CHECK(options.recompute_blocks >= 0 && options.recompute_blocks <= config.layers, "train.recompute_blocks",
             "{} blocks to recompute, but the model has {} (model.layers)", options.recompute_blocks, config.layers);
  for (int64_t l = 0; l < config.layers; ++l) {
    LayerSpec layer{"layers." + std::to_string(l), l, &config_};
    if (options.training && l < options.recompute_blocks) {
      // The block plans its saved activations in its own arena, bound later to the
      // region every recomputed block shares.
      recompute_arenas_.push_back(std::make_unique<Arena>("recomputed activations", options.device));
      BuildContext block_ctx{params_,       grads_,        *recompute_arenas_.back(), workspace_, parameters_,
                             compute_weights_, options.dtype, master, options.device, t, options.training,
                             options.deterministic};
      blocks_.push_back(std::make_unique<TransformerBlock>(block_ctx, layer, *position_));
    } else {
      blocks_.push_back(std::make_unique<TransformerBlock>(ctx, layer, *position_));
    }
  }
  final_norm_ = norm_registry().build("model.norm", config.norm, ctx, NormSpec{"final_norm", d, t, config.norm_eps});
  if (!config.tie_embeddings)
    ctx.parameter(head_w_, head_g_, "lm_head.weight", Shape{config.vocab_size, d}, true,
                  Init::normal(config.init_std));

  ctx.buffer(inputs_, Shape{input_ints(t)}, DType::i32);  // views bound in allocate()
  if (options.training && options.device == Device::cuda) {
    group_counts_.assign(static_cast<size_t>(config.vocab_size), 0);
    group_order_.reserve(static_cast<size_t>(t));
    group_tokens_.reserve(static_cast<size_t>(t));
    group_starts_.reserve(static_cast<size_t>(t + 1));
  }
  residual_.resize(static_cast<size_t>(config.layers + 1));
  for (Tensor& r : residual_) ctx.saved_wide(r, Shape{t, d});
  ctx.saved(hidden_, Shape{t, d});
  if (options.training) {
    ctx.buffer(dhidden_, Shape{t, d}, options.dtype);
    ctx.buffer(dres_, Shape{t, d}, master);
    // The mixed path's bf16 copy of dres, which the branches read (kept by the norms).
    if (ctx.mixed()) ctx.buffer(dres_compute_, Shape{t, d}, options.dtype);
  }
  const int64_t chunk = std::min(options.loss_chunk_rows, t);
  ctx.buffer(head_scratch_.logits, Shape{chunk, config.vocab_size}, options.dtype);
  ctx.buffer(head_scratch_.row_stats, Shape{chunk, 2}, DType::f64);
}

MemoryPlan Model::memory_plan() const {
  return {params_.planned_bytes() + compute_weights_.arena.planned_bytes(), grads_.planned_bytes(),
          activations_.planned_bytes() + recompute_bytes(), workspace_.planned_bytes()};
}

size_t Model::recompute_bytes() const {
  size_t most = 0;
  for (const auto& arena : recompute_arenas_) most = std::max(most, arena->planned_bytes());
  return most;
}

void Model::allocate() {
  params_.allocate();
  compute_weights_.arena.allocate();
  if (options_.training) grads_.allocate();
  activations_.allocate();
  if (!recompute_arenas_.empty()) {
    recompute_storage_ = Storage(options_.device, recompute_bytes());
    for (const auto& arena : recompute_arenas_) arena->bind_shared(recompute_storage_.data());
  }
  workspace_.allocate();
  bind_input_views();
}

// inputs_ = tokens [T] | targets [T] | positions [T] | cu_seqlens [T+1] | token groups
// (GPU training): order [T] | group_tokens [T] | group_starts [T+1].
void Model::bind_input_views() {
  const int64_t t = options_.max_tokens;
  tokens_ = inputs_.rows(0, t);
  targets_ = inputs_.rows(t, 2 * t);
  positions_ = inputs_.rows(2 * t, 3 * t);
  cu_seqlens_ = inputs_.rows(3 * t, 4 * t + 1);
  if (options_.training && options_.device == Device::cuda) {
    token_groups_.order = inputs_.rows(4 * t + 1, 5 * t + 1);
    token_groups_.group_tokens = inputs_.rows(5 * t + 1, 6 * t + 1);
    token_groups_.group_starts = inputs_.rows(6 * t + 1, 7 * t + 2);
  }
}

void Model::init_weights(uint64_t seed) {
  // One stream per parameter (by index), so adding a parameter elsewhere does not shift
  // the others' initial values within a model.
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const Parameter& p = *parameters_[i];
    const Tensor value = p.value();
    OwnedTensor host(DType::f64, Device::cpu, value.shape());
    double* v = host->data<double>();
    Rng rng = Rng::derive(seed, i);
    for (int64_t j = 0; j < value.numel(); ++j) {
      switch (p.init().kind) {
        case InitKind::normal: v[j] = rng.normal() * p.init().std; break;
        case InitKind::ones: v[j] = 1.0; break;
        case InitKind::zeros: v[j] = 0.0; break;
      }
    }
    if (value.dtype() == DType::f64) {
      copy_tensor(*host, value);
    } else {
      OwnedTensor f32(DType::f32, Device::cpu, value.shape());
      for (int64_t j = 0; j < value.numel(); ++j) f32->data<float>()[j] = static_cast<float>(v[j]);
      copy_tensor(*f32, value);
    }
  }
}

const Parameter* Model::find_parameter(const std::string& name) const {
  for (const auto& p : parameters_)
    if (p->name() == name) return p.get();
  return nullptr;
}

int64_t Model::parameter_count() const {
  int64_t n = 0;
  for (const auto& p : parameters_) n += p->shape().numel();
  return n;
}

int64_t Model::embedding_parameter_count() const {
  return config_.vocab_size * config_.hidden * (config_.tie_embeddings ? 1 : 2);
}

double Model::flops_per_token(int64_t seq_len) const {
  // Matmul parameters: everything but the embedding lookup and 1-D gains/biases; the
  // head's [V, d] matmul counts whether tied or not.
  double matmul = 0;
  for (const auto& p : parameters_)
    if (p->shape().rank() == 2 && p->name() != "embed.weight") matmul += static_cast<double>(p->shape().numel());
  if (config_.tie_embeddings) matmul += static_cast<double>(config_.vocab_size * config_.hidden);
  const double attention = 6.0 * static_cast<double>(config_.layers * config_.heads * config_.head_dim * seq_len);
  return 6.0 * matmul + attention;
}

void Model::load_batch(const HostBatch& batch) {
  KILN_CHECK(batch.size() > 0 && batch.size() <= options_.max_tokens, "model",
             "batch of {} tokens does not fit the planned budget of {}", batch.size(), options_.max_tokens);
  KILN_CHECK(batch.max_seqlen <= config_.max_seq_len, "model",
             "a sequence of {} tokens exceeds model.max_seq_len = {}", batch.max_seqlen, config_.max_seq_len);
  const int64_t rows = batch.size(), seqs = batch.num_seqs();
  auto upload = [&](const std::vector<int32_t>& src, const Tensor& dst, int64_t n) {
    Tensor host(const_cast<int32_t*>(src.data()), DType::i32, Device::cpu, Shape{n});
    copy_tensor(host, dst.rows(0, n));
  };
  upload(batch.tokens, tokens_, rows);
  upload(batch.targets, targets_, rows);
  upload(batch.positions, positions_, rows);
  upload(batch.cu_seqlens, cu_seqlens_, seqs + 1);
  int64_t groups = 0;
  if (token_groups_.order.defined()) {
    ops::group_tokens(batch.tokens.data(), rows, group_counts_, group_order_, group_tokens_, group_starts_);
    groups = static_cast<int64_t>(group_tokens_.size());
    upload(group_order_, token_groups_.order, rows);
    upload(group_tokens_, token_groups_.group_tokens, groups);
    upload(group_starts_, token_groups_.group_starts, groups + 1);
  }
  set_loaded_shape(rows, seqs, batch.max_seqlen, groups, batch.uniform());
}

void Model::set_loaded_shape(int64_t rows, int64_t seqs, int64_t max_seqlen, int64_t groups, bool uniform) {
  rows_ = rows;
  seq_.positions = positions_.rows(0, rows);
  seq_.cu_seqlens = cu_seqlens_.rows(0, seqs + 1);
  seq_.max_seqlen = max_seqlen;
  seq_.uniform = uniform;
  token_groups_.groups = groups;
}

Model::StagedShape Model::stage_batch(const HostBatch& batch, int32_t* staging) {
  const int64_t t = options_.max_tokens;
  KILN_CHECK(options_.training && options_.device == Device::cuda, "model",
             "staged batches are for GPU training models");
  KILN_CHECK(batch.size() == t, "model", "a staged batch must fill the token budget: {} of {} tokens", batch.size(),
             t);
  KILN_CHECK(batch.max_seqlen <= config_.max_seq_len, "model",
             "a sequence of {} tokens exceeds model.max_seq_len = {}", batch.max_seqlen, config_.max_seq_len);
  const int64_t seqs = batch.num_seqs();
  StagedShape shape;
  shape.uniform = batch.uniform();
  if (shape.uniform) {
    shape.seqs = seqs;
    shape.max_seqlen = batch.max_seqlen;
  } else {
    shape.seqs = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(seqs)));
    const auto longest = static_cast<uint64_t>(batch.max_seqlen);
    shape.max_seqlen = std::max<int64_t>(64, static_cast<int64_t>(std::bit_ceil(longest)));
  }
  KILN_CHECK(shape.seqs <= t, "model", "{} sequences in {} tokens", seqs, t);
  auto put = [&](const int32_t* src, int64_t n, int64_t at) { std::copy(src, src + n, staging + at); };
  put(batch.tokens.data(), t, 0);
  put(batch.targets.data(), t, t);
  put(batch.positions.data(), t, 2 * t);
  put(batch.cu_seqlens.data(), seqs + 1, 3 * t);
  // The padding sequences are empty: they start and end at t.
  std::fill(staging + 3 * t + seqs + 1, staging + 3 * t + shape.seqs + 1, static_cast<int32_t>(t));
  ops::group_tokens(batch.tokens.data(), t, group_counts_, group_order_, group_tokens_, group_starts_);
  const int64_t groups = static_cast<int64_t>(group_tokens_.size());
  put(group_order_.data(), t, 4 * t + 1);
  put(group_tokens_.data(), groups, 5 * t + 1);
  std::fill(staging + 5 * t + 1 + groups, staging + 6 * t + 1, 0);  // empty groups: the kernel skips them
  put(group_starts_.data(), groups + 1, 6 * t + 1);
  std::fill(staging + 6 * t + 2 + groups, staging + 7 * t + 2, static_cast<int32_t>(t));
  return shape;
}

void Model::load_staged(const int32_t* staging, const StagedShape& shape) {
  const int64_t t = options_.max_tokens;
  copy_to_device_async(inputs_.raw(), staging, static_cast<size_t>(input_ints(t)) * sizeof(int32_t));
  set_loaded_shape(t, shape.seqs, shape.max_seqlen, t, shape.uniform);
}

const Tensor& Model::head_weight() const { return config_.tie_embeddings ? embed_w_ : head_w_; }
const Tensor& Model::head_grad() const { return config_.tie_embeddings ? embed_g_ : head_g_; }

void Model::refresh_compute_weights() {
  for (const auto& [master, copy] : compute_weights_.pairs) ops::convert(*master, *copy);
}

void Model::forward() {
  KILN_CHECK(rows_ > 0, "model", "forward before load_batch");
  // Masters change under the optimizer, checkpoint loads and imports; converting them
  // before every forward (one pass over the weights, ~1% of a step) keeps the copies
  // from ever going stale.
  refresh_compute_weights();
  ops::embedding_forward(tokens_.rows(0, rows_), embed_->value(), residual_[0].rows(0, rows_));
  for (size_t l = 0; l < blocks_.size(); ++l)
    blocks_[l]->forward(residual_[l].rows(0, rows_), seq_, residual_[l + 1].rows(0, rows_));
  final_norm_->forward(residual_.back().rows(0, rows_), hidden_.rows(0, rows_));
}

ops::LossSums Model::forward_backward(double loss_scale, double z_loss) {
  ops::LmHeadLossOptions o;
  o.z_loss = z_loss;
  o.loss_scale = loss_scale;
  return forward_backward_with(o);
}

void Model::forward_backward_on_device(const float* loss_scale, double* sums, double z_loss) {
  ops::LmHeadLossOptions o;
  o.z_loss = z_loss;
  o.loss_scale_on_device = loss_scale;
  o.sums_on_device = sums;
  forward_backward_with(o);
}

ops::LossSums Model::forward_backward_with(ops::LmHeadLossOptions o) {
  KILN_CHECK(options_.training, "model", "forward_backward on a model built without training buffers");
  forward();
  o.chunk_rows = head_scratch_.logits.size(0);
  o.softcap = config_.logit_softcap;
  const ops::LossSums sums = ops::lm_head_loss(hidden_.rows(0, rows_), head_weight(), targets_.rows(0, rows_), o,
                                               head_scratch_, dhidden_.rows(0, rows_), head_grad());
  backward_from_hidden();
  return sums;
}

void Model::backward_from_hidden() {
  const Tensor dres = dres_.rows(0, rows_);
  const Tensor dres_compute = dres_compute_.defined() ? dres_compute_.rows(0, rows_) : dres;
  final_norm_->backward(dhidden_.rows(0, rows_), dres, false, dres_compute_.defined() ? dres_compute : Tensor());
  for (size_t l = blocks_.size(); l-- > 0;) {
    // A recomputed block's saved activations were overwritten by later blocks: run its
    // forward again from its saved input (it rewrites its output with the same values).
    if (static_cast<int64_t>(l) < options_.recompute_blocks)
      blocks_[l]->forward(residual_[l].rows(0, rows_), seq_, residual_[l + 1].rows(0, rows_));
    blocks_[l]->backward(dres, dres_compute, seq_);
  }
  if (token_groups_.order.defined()) {  // GPU: fixed summation order, no atomics
    ops::TokenGroups groups = token_groups_;
    groups.order = token_groups_.order.rows(0, rows_);
    ops::embedding_backward(groups, dres, embed_g_);
  } else {
    ops::embedding_backward(tokens_.rows(0, rows_), dres, embed_g_);
  }
}

ops::LossSums Model::evaluate() {
  forward();
  ops::LmHeadLossOptions o;
  o.chunk_rows = head_scratch_.logits.size(0);
  o.softcap = config_.logit_softcap;
  return ops::lm_head_loss(hidden_.rows(0, rows_), head_weight(), targets_.rows(0, rows_), o, head_scratch_,
                           Tensor(), Tensor());
}

void Model::logits(int64_t first, int64_t count, std::vector<float>& out) {
  KILN_CHECK(first >= 0 && count > 0 && first + count <= rows_, "model", "rows [{}, {}) outside the loaded batch of {}",
             first, first + count, rows_);
  forward();
  const int64_t vocab = config_.vocab_size, chunk = head_scratch_.logits.size(0);
  out.resize(static_cast<size_t>(count * vocab));
  OwnedTensor host(head_scratch_.logits.dtype(), Device::cpu, head_scratch_.logits.shape());
  for (int64_t begin = 0; begin < count; begin += chunk) {
    const int64_t rows = std::min(chunk, count - begin);
    const Tensor logits = head_scratch_.logits.rows(0, rows);
    // bf16 logits (the GPU's mixed path) take the softcap here, in fp32, after the copy.
    const bool cap_on_host = logits.dtype() == DType::bf16 && config_.logit_softcap > 0;
    ops::lm_head_logits(hidden_.rows(first + begin, first + begin + rows), head_weight(),
                        cap_on_host ? 0.0 : config_.logit_softcap, logits);
    copy_tensor(logits, host->rows(0, rows));
    float* dst = out.data() + begin * vocab;
    const DType dtype = host->dtype();
    for (int64_t i = 0; i < rows * vocab; ++i)
      dst[i] = dtype == DType::f32    ? host->data<float>()[i]
               : dtype == DType::bf16 ? bf16_to_float(static_cast<const uint16_t*>(host->raw())[i])
                                      : static_cast<float>(host->data<double>()[i]);
    if (cap_on_host) {
      const float cap = static_cast<float>(config_.logit_softcap);
      for (int64_t i = 0; i < rows * vocab; ++i) dst[i] = cap * std::tanh(dst[i] / cap);
    }
  }
}

Tensor Model::all_gradients() const {
  KILN_CHECK(grads_.allocated(), "model", "gradients are not allocated (a model built for evaluation?)");
  const DType dtype = parameters_.front()->grad().dtype();
  return Tensor(grads_.base(), dtype, options_.device,
                Shape{static_cast<int64_t>(grads_.planned_bytes() / dtype_size(dtype))});
}

void Model::zero_grads() { zero_tensor(all_gradients()); }

double Model::gradient_norm() const { return std::sqrt(ops::sum_squares(all_gradients())); }

void Model::gradient_sum_squares_to_device(double* out) const { ops::sum_squares_to_device(all_gradients(), out); }

void Model::scale_gradients(double factor) { ops::scale_inplace(all_gradients(), factor); }

}  // namespace kiln
