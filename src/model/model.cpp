#include "model/model.h"

#include "core/device_memory.h"
#include "core/phase_scope.h"
#include "config/mtp_weights.h"
#include "model/skipped_module.h"
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
      buffers_("buffers", options.device),
      step_buffers_("step buffers", options.device),
      workspace_(options.device),
      compute_weights_(options.device) {
  const int64_t t = options.max_tokens;
  KILN_CHECK(options.dtype != DType::bf16 || options.device == Device::cuda, "model",
             "bf16 (mixed precision) runs on the GPU only; the CPU computes in f32");
  KILN_CHECK(options.recipe().compute == options.dtype, "model", "the precision recipe computes in {}, the model in {}",
             dtype_name(options.recipe().compute), dtype_name(options.dtype));
  BuildContext ctx{exec_,          params_,         grads_,
                   activations_,   workspace_,      parameters_,
                   compute_weights_, options.recipe(),
                   options.device, t,               options.training,
                   options.deterministic, &losses_};
  ctx.buffers = &buffers_;
  ctx.step_buffers = &step_buffers_;
  ctx.kept_views = &kept_views_;
  ctx.qk_clip_tau = options.training ? options.qk_clip_tau : 0;
  ctx.bf16_masters = options.bf16_masters && ctx.mixed();
  ctx.step_statistics = &step_statistics_;
  ctx.deferral = &weight_grad_deferral_;
  // The LM head first: its loss is slot 0 (the main loss).
  LmHeadSpec head;
  head.chunk_rows = options.loss_chunk_rows;
  head.z_loss = options.z_loss;
  head.weight = mtp_loss_weights(config).main;
  const int head_slot = losses_.terms.reserve({{"loss", true}, {"z", head.z_loss > 0}, {"target_count", false}});
  backbone_ = std::make_unique<Backbone>(ctx, config_, options, recompute_arenas_);
  std::vector<std::pair<size_t, size_t>> skipped = backbone_->skipped_parameters();
  if (options.builds_layer(config.layers - 1)) {
    head_ = std::make_unique<LmHead>(ctx, config_, backbone_->embedding_compute(), backbone_->embedding_grad(), head,
                                     head_slot);
  } else if (!config.tie_embeddings) {  // a tied head declares no parameter of its own
    const size_t at = parameters_.size();
    skipped.push_back({at, count_skipped_parameters(ctx, [&](BuildContext& c) {
                         LmHead(c, config_, Tensor(), Tensor(), head, head_slot);
                       })});
  }
  if (config.mtp.depth > 0) mtp_ = std::make_unique<MultiTokenPrediction>(ctx, config_, *backbone_, *head_);
  // Each parameter's index in the whole model: its own, plus what a stage left out before it.
  size_t left_out = 0, next = 0;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    for (; next < skipped.size() && skipped[next].first <= i; ++next) left_out += skipped[next].second;
    whole_index_.push_back(i + left_out);
  }

  ctx.saved_buffer(inputs_, Shape{input_ints()}, DType::i32);  // views bound in allocate()
  if (options.training && options.device == Device::cuda) {
    group_counts_.assign(static_cast<size_t>(config.vocab_size), 0);
    group_order_.reserve(static_cast<size_t>(t));
    group_tokens_.reserve(static_cast<size_t>(t));
    group_starts_.reserve(static_cast<size_t>(t + 1));
  }
}

MemoryPlan Model::memory_plan() const {
  return {params_.planned_bytes() + compute_weights_.arena.planned_bytes(), grads_.planned_bytes(),
          activations_.planned_bytes() + buffers_.planned_bytes() + step_buffers_.planned_bytes() + recompute_bytes(),
          workspace_.planned_bytes()};
}

Model::BlockMemory Model::block_memory(int64_t l) const {
  KILN_CHECK(0 <= l && l < config_.layers, "model", "block {} of the model's {} layers", l, config_.layers);
  const auto bytes = [](const Arena& arena, const std::pair<size_t, size_t>& run) {
    return arena.offset_of(run.second) - arena.offset_of(run.first);
  };
  const Backbone::BlockRuns& runs = backbone_->block_runs()[static_cast<size_t>(l)];
  const FrameSegment& segment = backbone_->block_segments()[static_cast<size_t>(l)];
  BlockMemory m;
  m.parameters = bytes(params_, runs.params);
  m.compute_copies = bytes(compute_weights_.arena, runs.compute_weights);
  m.gradients = bytes(grads_, runs.grads);
  m.activations = bytes(activations_, {segment.first_entry, segment.last_entry});
  m.buffers = bytes(buffers_, runs.buffers) + bytes(step_buffers_, runs.step_buffers);
  m.first_parameter = runs.parameters.first;
  m.last_parameter = runs.parameters.second;
  return m;
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
  buffers_.allocate();
  step_buffers_.allocate();
  if (!recompute_arenas_.empty()) {
    recompute_storage_ = Storage(options_.device, recompute_bytes());
    for (const auto& arena : recompute_arenas_) arena->bind_shared(recompute_storage_.data());
  }
  workspace_.allocate();
  bind_input_views();
}

// inputs_ = tokens [T] | targets [T] | positions [T] | cu_seqlens [T+1] | token groups
// (GPU training): order [T] | group_tokens [T] | group_starts [T+1] | dropout key [2].
void Model::bind_input_views() {
  const int64_t t = options_.max_tokens;
  tokens_ = inputs_.rows(0, t);
  targets_ = inputs_.rows(t, 2 * t);
  positions_ = inputs_.rows(2 * t, 3 * t);
  cu_seqlens_ = inputs_.rows(3 * t, 4 * t + 1);
  dropout_key_ = inputs_.rows(7 * t + 2, 7 * t + 4);
  if (options_.training && options_.device == Device::cuda) {
    token_groups_.order = inputs_.rows(4 * t + 1, 5 * t + 1);
    token_groups_.group_tokens = inputs_.rows(5 * t + 1, 6 * t + 1);
    token_groups_.group_starts = inputs_.rows(6 * t + 1, 7 * t + 2);
  }
  if (mtp_) mtp_->bind_inputs(inputs_.rows(base_input_ints(t), input_ints()));
}

void Model::enable_activation_frames(int frames, const std::vector<std::pair<int64_t, int64_t>>& layers) {
  KILN_CHECK(options_.training, "model", "activation frames are for training models");
  KILN_CHECK(!frames_, "model", "activation frames enabled twice");
  KILN_CHECK(activations_.allocated(), "model", "activation frames before allocate()");
  std::vector<bool> framed(static_cast<size_t>(config_.layers), false);
  for (const auto& [first, last] : layers) {
    KILN_CHECK(0 <= first && first < last && last <= config_.layers, "model",
               "framed layers [{}, {}) outside the model's {} layers", first, last, config_.layers);
    for (int64_t l = first; l < last; ++l) framed[static_cast<size_t>(l)] = true;
  }
  frames_ = std::make_unique<ActivationFrames>(activations_, kept_views_, backbone_->block_segments(), framed, frames);
  frame_shapes_.assign(static_cast<size_t>(frames), LoadedShape{});
}

void Model::select_frame(int frame) {
  if (!frames_) {
    KILN_CHECK(frame == 0, "model", "activation frame {} of a model built with one", frame);
    return;
  }
  if (frame == frames_->current()) return;
  frame_shapes_[static_cast<size_t>(frames_->current())] =
      LoadedShape{rows_, seq_.cu_seqlens.defined() ? seq_.cu_seqlens.size(0) - 1 : 0, seq_.max_seqlen,
                  token_groups_.groups, seq_.uniform, seq_.dropout_key.defined()};
  frames_->select(frame);
  bind_input_views();  // views of inputs_, which moved with the frame
  const LoadedShape& shape = frame_shapes_[static_cast<size_t>(frame)];
  set_loaded_shape(shape.rows, shape.seqs, shape.max_seqlen, shape.groups, shape.uniform);
  seq_.dropout_key = shape.drops ? dropout_key_ : Tensor();
}

void Model::init_weights(uint64_t seed) {
  // One stream per parameter (by its index in the whole model), so adding a parameter
  // elsewhere does not shift the others' initial values within a model, and a pipeline
  // stage's model draws the whole model's values.
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const Parameter& p = *parameters_[i];
    const Tensor value = p.value();
    OwnedTensor host(DType::f64, Device::cpu, value.shape());
    double* v = host->data<double>();
    Rng rng = Rng::derive(seed, whole_index_[i]);
    for (int64_t j = 0; j < value.numel(); ++j) {
      switch (p.init().kind) {
        case InitKind::normal: v[j] = rng.normal() * p.init().std; break;
        case InitKind::ones: v[j] = 1.0; break;
        case InitKind::zeros: v[j] = 0.0; break;
        case InitKind::constant: v[j] = p.init().std; break;
        case InitKind::uniform: v[j] = (2 * rng.uniform() - 1) * p.init().std; break;
        case InitKind::log_uniform:
          v[j] = std::log(p.init().std + (p.init().hi - p.init().std) * rng.uniform());
          break;
        case InitKind::inverse_softplus_log_uniform: {
          // FLA's dt: exp(U(log lo, log hi)) floored at 1e-4, then x with softplus(x) = dt.
          const double lo = std::log(p.init().std), hi = std::log(p.init().hi);
          const double dt = std::max(std::exp(lo + (hi - lo) * rng.uniform()), 1e-4);
          v[j] = dt + std::log(-std::expm1(-dt));
          break;
        }
      }
    }
    if (value.dtype() == DType::f64) {
      copy_tensor(*host, value);
    } else if (value.dtype() == DType::bf16) {  // a bf16 master (optim.master_weights): rounded to nearest
      OwnedTensor bf16(DType::bf16, Device::cpu, value.shape());
      auto* bits = static_cast<uint16_t*>(bf16->raw());
      for (int64_t j = 0; j < value.numel(); ++j) bits[j] = float_to_bf16(static_cast<float>(v[j]));
      copy_tensor(*bf16, value);
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

double Model::active_parameter_count() const {
  double n = 0;
  for (const auto& p : parameters_)
    if (!p->training_only()) n += static_cast<double>(p->shape().numel()) * p->active_fraction();
  return n;
}

int64_t Model::embedding_parameter_count() const {
  return config_.vocab_size * config_.hidden * (config_.tie_embeddings ? 1 : 2);
}

double Model::flops_per_token(int64_t seq_len) const {
  // Matmul parameters: everything but the embedding lookup and 1-D gains/biases; the
  // head's [V, d] matmul counts whether tied or not.
  double matmul = 0;
  const Parameter* embed = backbone_->has_embedding() ? &backbone_->embedding() : nullptr;
  for (const auto& p : parameters_)
    if (p->shape().rank() == 2 && p.get() != embed)
      matmul += static_cast<double>(p->shape().numel()) * p->active_fraction();
  // (A pipeline stage's model counts its own: the head only where it is, on the last stage.)
  if (config_.tie_embeddings && head_) matmul += static_cast<double>(config_.vocab_size * config_.hidden);
  // Sequential multi-token prediction predicts through the main head once per depth.
  if (mtp_ && config_.mtp.form == "sequential")
    matmul += static_cast<double>(mtp_->depth() * config_.vocab_size * config_.hidden);
  const double extra = backbone_->extra_forward_flops_per_token(seq_len) +
                       (mtp_ ? mtp_->extra_forward_flops_per_token(seq_len) : 0.0);
  return 3.0 * (2.0 * matmul + extra);
}

namespace {

// The dropout key as the two i32 words of the input buffer (low, high).
std::vector<int32_t> dropout_key_words(uint64_t key) {
  return {static_cast<int32_t>(static_cast<uint32_t>(key)), static_cast<int32_t>(static_cast<uint32_t>(key >> 32))};
}

}  // namespace

void Model::load_batch(const HostBatch& batch) {
  KILN_PHASE("load batch");
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
  const std::vector<int32_t> key = dropout_key_words(batch.dropout_key);
  upload(key, dropout_key_, 2);
  int64_t groups = 0;
  if (token_groups_.order.defined()) {
    ops::group_tokens(batch.tokens.data(), rows, group_counts_, group_order_, group_tokens_, group_starts_);
    groups = static_cast<int64_t>(group_tokens_.size());
    upload(group_order_, token_groups_.order, rows);
    upload(group_tokens_, token_groups_.group_tokens, groups);
    upload(group_starts_, token_groups_.group_starts, groups + 1);
  }
  if (mtp_) {
    const int64_t t = options_.max_tokens;
    mtp_inputs_.resize(static_cast<size_t>(input_ints() - base_input_ints(t)));
    MultiTokenPrediction::stage_inputs(batch, t, mtp_->depth(), mtp_inputs_.data());
    upload(mtp_inputs_, inputs_.rows(base_input_ints(t), input_ints()), static_cast<int64_t>(mtp_inputs_.size()));
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
  put(dropout_key_words(batch.dropout_key).data(), 2, 7 * t + 2);
  if (mtp_) MultiTokenPrediction::stage_inputs(batch, t, mtp_->depth(), staging + base_input_ints(t));
  return shape;
}

void Model::load_staged(const int32_t* staging, const StagedShape& shape) {
  const int64_t t = options_.max_tokens;
  copy_to_device_async(inputs_.raw(), staging, static_cast<size_t>(input_ints()) * sizeof(int32_t));
  set_loaded_shape(t, shape.seqs, shape.max_seqlen, t, shape.uniform);
}

void Model::refresh_compute_weights() {
  for (const auto& [master, copy] : compute_weights_.pairs) ops::convert(exec_, *master, *copy);
}

void Model::forward() {
  KILN_CHECK(rows_ > 0, "model", "forward before load_batch");
  KILN_PHASE("forward");
  // Masters change under the optimizer, checkpoint loads and imports; converting them
  // before every forward (one pass over the weights, ~1% of a step) keeps the copies
  // from ever going stale.
  refresh_compute_weights();
  backbone_->forward(tokens_.rows(0, rows_), seq_);
}

// The heads over the backbone's hidden states: their loss sums, and with `backward` their
// gradients into d(hidden) (=) and their own weights (+=).
LossSums Model::heads(LossScale scale, bool backward, double* device_sums, bool training_heads) {
  KILN_PHASE("loss");  // the heads' forward, and with `backward` their backward
  KILN_CHECK(head_ != nullptr, "model", "the LM head is not in this pipeline stage's model (it holds the last layer's)");
  LossSums sums = pending_;
  const Tensor dhidden = backward ? backbone_->dhidden().rows(0, rows_) : Tensor();
  head_->loss(backbone_->hidden().rows(0, rows_), targets_.rows(0, rows_), scale, dhidden, sums.slot, device_sums);
  if (mtp_ && training_heads) mtp_->run(rows_, seq_, scale, backward, sums.slot, device_sums);
  sums.loss = sums.slot[0];
  sums.z = sums.slot[1];
  sums.count = static_cast<int64_t>(sums.slot[2]);
  return sums;
}

// Before a forward: where this micro-batch's objectives add their sums and how they scale
// their gradients.
void Model::begin_losses(bool backward, double per_target_scale) {
  // Only a training forward (the one a backward follows) drops.
  seq_.dropout_key = backward ? dropout_key_ : Tensor();
  pending_ = LossSums{};
  losses_.backward = backward;
  losses_.per_target_scale = per_target_scale;
  losses_.host_sums = &pending_.slot;
  losses_.device_sums = nullptr;
  losses_.loss_scale_on_device = nullptr;
}

LossSums Model::forward_backward(double loss_scale) {
  KILN_CHECK(options_.training, "model", "forward_backward on a model built without training buffers");
  begin_losses(true, loss_scale);
  forward();
  const LossSums sums = heads(LossScale{loss_scale, nullptr}, true, nullptr, true);
  backward();
  return sums;
}

void Model::forward_backward_on_device(const float* loss_scale, const double* scale, double* slot_sums) {
  KILN_CHECK(options_.training, "model", "forward_backward on a model built without training buffers");
  begin_losses(true, 1.0);
  losses_.device_sums = slot_sums;  // the objectives inside the backbone (routers) add there too
  losses_.loss_scale_on_device = scale;  // and scale their gradients by S from there
  forward();
  heads(LossScale{1.0, loss_scale}, true, slot_sums, true);
  backward();
}

void Model::backward() {
  KILN_PHASE("backward");
  backbone_->backward(tokens_.rows(0, rows_), seq_, token_groups_.order.defined() ? &token_groups_ : nullptr,
                      mtp_ ? mtp_->backbone_extra() : Backbone::ExtraGradients{},
                      backward_progress_ ? &backward_progress_ : nullptr);
}

LossSums Model::forward_layers(int64_t first, int64_t last, double loss_scale, bool recomputing) {
  KILN_CHECK(options_.training, "model", "forward_layers on a model built without training buffers");
  // The step's balance counts come from StepProgram's counting pass, which stages do not run.
  KILN_CHECK(!counts_step_routes(), "model.moe.balance_scope", "'step' is not supported by pipeline stages yet");
  KILN_CHECK(rows_ > 0, "model", "forward before load_batch");
  KILN_PHASE("forward");
  begin_losses(true, loss_scale);
  losses_.recomputing = recomputing;
  refresh_compute_weights();
  backbone_->forward_layers(tokens_.rows(0, rows_), seq_, first, last);
  losses_.recomputing = false;
  LossSums sums = pending_;
  sums.loss = sums.slot[0];
  sums.z = sums.slot[1];
  sums.count = static_cast<int64_t>(sums.slot[2]);
  return sums;
}

LossSums Model::stage_heads(double loss_scale) {
  // The heads add to pending_, which holds the blocks' sums of this forward: start afresh,
  // so a stage's blocks' and heads' sums are counted once each.
  pending_ = LossSums{};
  return heads(LossScale{loss_scale, nullptr}, true, nullptr, true);
}

LossSums Model::evaluate_layers(int64_t first, int64_t last) {
  KILN_CHECK(rows_ > 0, "model", "forward before load_batch");
  KILN_PHASE("forward");
  begin_losses(false, 1.0);
  refresh_compute_weights();
  backbone_->forward_layers(tokens_.rows(0, rows_), seq_, first, last);
  if (last < config_.layers) return LossSums{};
  return heads(LossScale{}, false, nullptr, false);
}

void Model::backward_layers(int64_t first, int64_t last) {
  KILN_PHASE("backward");
  backbone_->backward_layers(tokens_.rows(0, rows_), seq_, token_groups_.order.defined() ? &token_groups_ : nullptr,
                             first, last);
}

void Model::clear_step_routes() {
  for (Tensor* counts : losses_.step_routes) ops::zero(exec_, *counts);  // on the stream: the GPU's counts too
}

// The training forward again (its dropout key too, so every route is the training pass's),
// with nothing but the sparse layers' routed counts kept: no heads, no loss, no load.
void Model::count_step_routes() {
  KILN_CHECK(options_.training, "model", "the counting pass on a model built without training buffers");
  begin_losses(false, 1.0);
  seq_.dropout_key = dropout_key_;
  losses_.host_sums = nullptr;
  losses_.counting_routes = true;
  try {
    forward();
  } catch (...) {
    losses_.counting_routes = false;
    throw;
  }
  losses_.counting_routes = false;
}

LossSums Model::evaluate() {
  begin_losses(false, 1.0);
  forward();
  return heads(LossScale{}, false, nullptr, false);
}

LossSums Model::evaluate_objective() {
  begin_losses(false, 1.0);
  forward();
  return heads(LossScale{}, false, nullptr, true);
}

void Model::logits(int64_t first, int64_t count, std::vector<float>& out) {
  KILN_CHECK(first >= 0 && count > 0 && first + count <= rows_, "model", "rows [{}, {}) outside the loaded batch of {}",
             first, first + count, rows_);
  begin_losses(false, 1.0);  // no training objective adds to a step's sums or load
  forward();
  const int64_t vocab = config_.vocab_size, chunk = std::min<int64_t>(options_.loss_chunk_rows, options_.max_tokens);
  out.resize(static_cast<size_t>(count * vocab));
  std::vector<float> part;
  for (int64_t begin = 0; begin < count; begin += chunk) {
    const int64_t rows = std::min(chunk, count - begin);
    head_->logits(backbone_->hidden().rows(first + begin, first + begin + rows), part);
    std::copy(part.begin(), part.end(), out.begin() + begin * vocab);
  }
}

Tensor Model::all_gradients() const {
  KILN_CHECK(grads_.allocated(), "model", "gradients are not allocated (a model built for evaluation?)");
  const DType dtype = parameters_.front()->grad().dtype();
  return Tensor(grads_.base(), dtype, options_.device,
                Shape{static_cast<int64_t>(grads_.planned_bytes() / dtype_size(dtype))});
}

void Model::zero_grads() { zero_tensor(all_gradients()); }

std::vector<GradientRange> Model::gradient_ranges() const {
  const Tensor all = all_gradients();
  const auto* base = static_cast<const unsigned char*>(all.raw());
  const size_t element = dtype_size(all.dtype());
  const int layers = static_cast<int>(config_.layers);
  std::vector<GradientRange> ranges;
  for (const auto& p : parameters_) {
    const Tensor g = p->grad();
    if (!g.defined()) continue;
    const std::string& name = p->names().kiln;
    // Blocks by their prefix "layers.<l>."; the table last; everything else (heads, the
    // final norm, multi-token prediction's modules) before the blocks.
    int ready = 0;
    if (name == "embed.weight") {
      ready = layers + 1;
    } else if (name.rfind("layers.", 0) == 0) {
      ready = layers - std::stoi(name.substr(7));
    }
    const auto offset = static_cast<int64_t>((static_cast<const unsigned char*>(g.raw()) - base) / element);
    ranges.push_back({offset, offset + g.numel(), ready});
  }
  std::sort(ranges.begin(), ranges.end(), [](const GradientRange& a, const GradientRange& b) { return a.begin < b.begin; });
  return ranges;
}

double Model::gradient_norm() const {
  KILN_PHASE("gradient norm");
  return std::sqrt(ops::sum_squares(exec_, all_gradients()));
}

void Model::gradient_sum_squares_to_device(double* out) const {
  KILN_PHASE("gradient norm");
  ops::sum_squares_to_device(exec_, all_gradients(), out);
}

void Model::scale_gradients(double factor) {
  KILN_PHASE("clip");
  ops::scale_inplace(exec_, all_gradients(), factor);
}

}  // namespace kiln
