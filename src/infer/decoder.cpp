#include "infer/decoder.h"

#include "nn/attn_res_decode.h"

#include "ops/elementwise/elementwise.h"
#include "ops/embedding/embedding.h"

#if KILN_WITH_CUDA
#include "core/step_graphs.h"
#include "infer/decoder_cuda.h"
#include "ops/decode/decode_kernels.h"
#endif

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kiln {

namespace {

// StepGraphs key of a chained greedy step of n rows (greedy_chain); forward's steps use n
// and -n.
constexpr int64_t kChainKey = int64_t{1} << 32;

}  // namespace

Decoder::Decoder(Model& model, const DecoderOptions& options)
    : model_(model),
      config_(model.config()),
      options_(options),
      device_(model.options().device),
      arena_("decoder", model.options().device),
      workspace_(model.options().device) {
  const ModelConfig& m = config_;
  if (options_.max_len <= 0 || options_.max_len > m.max_seq_len) options_.max_len = m.max_seq_len;
  KILN_CHECK(options_.slots > 0 && options_.max_rows > 0 && options_.logit_rows > 0, "decoder",
             "slots, max_rows and logit_rows must be positive");
  KILN_CHECK(options_.chain_steps >= 1, "decoder", "chain_steps must be at least 1, not {}", options_.chain_steps);
  dtype_ = model.options().dtype;
  // The masters' dtype: f32, or f64 on the CPU reference; f32 on the mixed path also where the
  // 2-D weights are bf16 masters (optim.master_weights), whose embedding widens exactly.
  wide_ = dtype_ == DType::bf16 ? DType::f32 : model.backbone().embedding().value().dtype();
  KILN_CHECK(device_ == Device::cpu || (wide_ == DType::f32 && (dtype_ == DType::f32 || dtype_ == DType::bf16)),
             "decoder", "on the GPU the model must compute in f32 or bf16 with f32 masters (got {} with {} masters)",
             dtype_name(dtype_), dtype_name(wide_));
  const bool mixed = dtype_ != wide_;
  const bool fuse = device_ == Device::cuda && options_.fuse;
  // Capture needs every kernel on the context's stream; the fp32 RMSNorm front end launched
  // on the legacy stream once, so the unfused fp32 GPU path runs its steps uncaptured.
  const bool capturable = mixed || fuse;
  graph_rows_ = device_ == Device::cuda && capturable
                    ? std::max<int64_t>(0, std::min({options_.graph_rows, options_.max_rows, options_.logit_rows}))
                    : 0;
  if (fuse && options_.gemv_rows > 0 && dtype_ == DType::bf16)
    fused_branch_rows_ = std::min<int64_t>({8, options_.gemv_rows, options_.max_rows});

  // The components' decoders: each plans its state and scratch here.
  model.refresh_compute_weights();  // the copies the decoders read (a forward would do it)
  DecodeContext ctx{arena_, workspace_, exec_, device_, dtype_, wide_};
  ctx.slots = options_.slots, ctx.max_len = options_.max_len, ctx.max_rows = options_.max_rows;
  ctx.fuse = fuse, ctx.fused_branch_rows = fused_branch_rows_, ctx.one_kernel_attention = options_.one_kernel_attention;
  const Backbone& backbone = model.backbone();
  KILN_CHECK(backbone.whole(), "decode", "a pipeline stage's model holds part of the layers: decode with the whole model");
  for (const auto& block : backbone.blocks()) blocks_.push_back(block->make_decoder(ctx));
  if (backbone.attn_res()) attn_res_ = std::make_unique<AttnResDecoder>(ctx, *backbone.attn_res(), m.hidden);
  state_bytes_ = arena_.planned_bytes();
  final_norm_ = backbone.final_norm().make_decoder(ctx);
  head_ = model.head().make_decoder(ctx, backbone.final_norm());
  embed_ = backbone.embedding().value();

  const DType dt = dtype_, wide = wide_;
  const int64_t r = options_.max_rows, d = m.hidden;
  arena_.reserve(inputs_, DType::i32, Shape{3, r});
  arena_.reserve(x_, wide, Shape{r, d});
  arena_.reserve(h_, dt, Shape{r, d});
  arena_.reserve(branch_, dt, Shape{r, d});
  const int64_t lr = options_.logit_rows;
  arena_.reserve(gather_, dt, Shape{lr, d});
  arena_.reserve(logits_, wide, Shape{lr, m.vocab_size});
  if (device_ == Device::cuda) arena_.reserve(argmax_, DType::i32, Shape{lr});
  const bool chains_on_device = device_ == Device::cuda && graph_rows_ > 0;
  if (chains_on_device) arena_.reserve(chain_, DType::i32, Shape{options_.chain_steps * graph_rows_ + 1});
  arena_.allocate();
  workspace_.allocate();
  if (chain_.defined()) zero_tensor(chain_);  // the step counter starts at 0

  // What a step reads of the weights: every parameter but the embedding table (looked up by
  // rows), matrices in the compute dtype, gains and biases wide; a tied head reads the
  // embedding's compute copy whole.
  const Parameter* embedding = &backbone.embedding();
  for (const auto& p : model.parameters())
    if (p.get() != embedding && !p->training_only())
      weight_bytes_ += static_cast<size_t>(p->shape().numel()) * dtype_size(p->shape().rank() == 2 ? dt : wide);
  if (m.tie_embeddings) weight_bytes_ += static_cast<size_t>(m.vocab_size * d) * dtype_size(dt);
  tokens_ = inputs_.rows(0, 1).view(Shape{r});
  slots_ = inputs_.rows(1, 2).view(Shape{r});
  positions_ = inputs_.rows(2, 3).view(Shape{r});
  host_inputs_.assign(static_cast<size_t>(3 * r), 0);
  if (device_ == Device::cuda) host_argmax_ = PinnedArray<int32_t>(static_cast<size_t>(options_.logit_rows));
  if (chain_.defined()) host_chain_ = PinnedArray<int32_t>(static_cast<size_t>(options_.chain_steps * graph_rows_));
  sorted_slots_.reserve(static_cast<size_t>(r));
  if (device_ != Device::cpu || wide != DType::f32) host_logits_ = OwnedTensor(wide, Device::cpu, logits_.shape());
#if KILN_WITH_CUDA
  if (graph_rows_ > 0) graphs_ = std::make_shared<cuda::StepGraphs>("decoder", exec_);
#endif
}

Decoder::~Decoder() = default;

size_t Decoder::graphs() const {
#if KILN_WITH_CUDA
  if (graphs_) return graphs_->size();
#endif
  return 0;
}

void Decoder::copy_slot(int32_t from, int32_t to, int64_t positions) {
  KILN_CHECK(from >= 0 && from < options_.slots && to >= 0 && to < options_.slots && from != to, "decoder",
             "copy_slot from slot {} to slot {} (distinct slots in [0, {}) needed)", from, to, options_.slots);
  KILN_CHECK(positions >= 0 && positions <= options_.max_len, "decoder", "copy_slot of {} positions (at most {})",
             positions, options_.max_len);
  for (const auto& block : blocks_) block->copy_slot(from, to, positions);
}

void Decoder::reset_slot(int32_t slot) {
  KILN_CHECK(slot >= 0 && slot < options_.slots, "decoder", "reset_slot of slot {} outside [0, {})", slot,
             options_.slots);
  for (const auto& block : blocks_) block->reset_slot(slot);
}

void Decoder::forward(std::span<const int32_t> tokens, std::span<const int32_t> slots,
                      std::span<const int32_t> positions) {
  const auto n = static_cast<int64_t>(tokens.size());
  KILN_CHECK(n > 0 && n <= options_.max_rows, "decoder", "a step of {} rows (1 to {} allowed)", n, options_.max_rows);
  KILN_CHECK(slots.size() == tokens.size() && positions.size() == tokens.size(), "decoder",
             "tokens, slots and positions must have the same length");
  // Checked here, before anything runs: the GPU kernels trust these device values.
  for (size_t i = 0; i < tokens.size(); ++i) {
    KILN_CHECK(tokens[i] >= 0 && tokens[i] < config_.vocab_size, "decoder",
               "row {}: token id {} is outside the vocabulary [0, {})", i, tokens[i], config_.vocab_size);
    KILN_CHECK(slots[i] >= 0 && slots[i] < options_.slots, "decoder", "row {}: slot {} outside [0, {})", i, slots[i],
               options_.slots);
    KILN_CHECK(positions[i] >= 0 && positions[i] < options_.max_len, "decoder",
               "row {}: position {} outside the cache length {}", i, positions[i], options_.max_len);
  }
  const int64_t r = options_.max_rows;
  std::copy(tokens.begin(), tokens.end(), host_inputs_.begin());
  std::copy(slots.begin(), slots.end(), host_inputs_.begin() + r);
  std::copy(positions.begin(), positions.end(), host_inputs_.begin() + 2 * r);
  if (device_ == Device::cuda) {
    // Enqueued on the step's stream without waiting for the device: from pageable memory
    // the driver stages the values before returning, so host_inputs_ is free again at once.
    copy_to_device_async(inputs_.raw(), host_inputs_.data(), inputs_.nbytes());
  } else {
    copy_tensor(Tensor(host_inputs_.data(), DType::i32, Device::cpu, inputs_.shape()), inputs_);
  }
  rows_ = n;
  logits_ready_ = 0;
  // Rows of distinct sequences (a decode step) may take the one-kernel attention; a step
  // with several rows of one sequence (a prefill chunk) may not, so it keys its own graph.
  sorted_slots_.assign(slots.begin(), slots.end());
  std::sort(sorted_slots_.begin(), sorted_slots_.end());
  distinct_slots_ = std::adjacent_find(sorted_slots_.begin(), sorted_slots_.end()) == sorted_slots_.end();
#if KILN_WITH_CUDA
  if (n <= graph_rows_) {
    graphs_->run(distinct_slots_ ? n : -n, [this, n] { step(n, true); });
    logits_ready_ = n;
    return;
  }
#endif
  step(n, false);
}

// Everything of a step after its inputs are on the device; on the GPU it only enqueues
// kernels and library calls on the stream (it may be captured into a graph). The blocks
// thread the residual stream through; a branch's output is added by the next norm on its
// way (or, on the fused projections, by the branch itself).
void Decoder::step(int64_t n, bool with_logits) {
  DecodeRows rows;
  rows.tokens = tokens_.rows(0, n), rows.slots = slots_.rows(0, n), rows.positions = positions_.rows(0, n);
  rows.count = n;
  rows.distinct_slots = distinct_slots_;
  rows.fused_branches = with_logits && n <= fused_branch_rows_;
  DecodeStepBuffers s{x_.rows(0, n), h_.rows(0, n), branch_.rows(0, n)};
  ops::embedding_forward(exec_, rows.tokens, embed_, s.x);
  if (config_.embed_scale != 1.0) ops::scale_inplace(exec_, s.x, config_.embed_scale);
  if (attn_res_) {
    attn_res_->forward(blocks_, s, rows);  // Block Attention Residuals (nn/attn_res_decode.h)
  } else {
    for (const auto& block : blocks_) block->forward(s, rows);
  }
  if (rows.fused_branches && head_->fused()) {  // the final norm folded into the head
    if (s.pending) residual_add(exec_, s.x, s.branch, dtype_ != wide_);
    head_->logits_fused(s.x, logits_.rows(0, n));
    return;
  }
  final_norm_->add_norm(s.x, s.pending ? s.branch : Tensor(), s.h);  // h = final hidden states
  if (with_logits) head_->logits(s.h, logits_.rows(0, n));
}

void Decoder::check_rows(std::span<const int32_t> rows) const {
  for (const int32_t r : rows)
    KILN_CHECK(r >= 0 && r < rows_, "decoder", "logits of row {} outside the last step's {} rows", r, rows_);
}

// Logits of up to logit_rows rows of the last step, into logits_.rows(0, rows.size()).
Tensor Decoder::compute_logits(std::span<const int32_t> rows) {
  const auto m = static_cast<int64_t>(rows.size());
  for (int64_t j = 0; j < m; ++j) {
    const int32_t r = rows[static_cast<size_t>(j)];
    copy_tensor(h_.rows(r, r + 1), gather_.rows(j, j + 1));
  }
  const Tensor lg = logits_.rows(0, m);
  head_->logits(gather_.rows(0, m), lg);
  return lg;
}

void Decoder::logits(std::span<const int32_t> rows, std::vector<float>& out) {
  check_rows(rows);
  const int64_t vocab = config_.vocab_size, chunk = options_.logit_rows;
  const auto count = static_cast<int64_t>(rows.size());
  out.resize(static_cast<size_t>(count * vocab));
  const OwnedTensor& host = host_logits_;
  if (logits_ready_ > 0 && count > 0) {  // a captured step computed them: copy out the span asked for
    const int32_t lo = *std::min_element(rows.begin(), rows.end());
    const int32_t hi = *std::max_element(rows.begin(), rows.end()) + 1;
    copy_tensor(logits_.rows(lo, hi), host->rows(0, hi - lo));
    const float* src = host->data<float>();
    for (int64_t j = 0; j < count; ++j)
      std::copy_n(src + (rows[static_cast<size_t>(j)] - lo) * vocab, vocab, out.data() + j * vocab);
    return;
  }
  for (int64_t begin = 0; begin < count; begin += chunk) {
    const int64_t m = std::min(chunk, count - begin);
    const Tensor lg = compute_logits(rows.subspan(static_cast<size_t>(begin), static_cast<size_t>(m)));
    float* dst = out.data() + begin * vocab;
    if (!host.tensor.defined()) {
      std::copy(lg.data<float>(), lg.data<float>() + m * vocab, dst);
      continue;
    }
    copy_tensor(lg, host->rows(0, m));
    for (int64_t i = 0; i < m * vocab; ++i)
      dst[i] = host->dtype() == DType::f32 ? host->data<float>()[i] : static_cast<float>(host->data<double>()[i]);
  }
}

void Decoder::greedy(std::span<const int32_t> rows, std::vector<int32_t>& out) {
  check_rows(rows);
  const int64_t vocab = config_.vocab_size;
  out.resize(rows.size());
  if (device_ == Device::cpu) {
    std::vector<float> lg;
    logits(rows, lg);
    for (size_t j = 0; j < rows.size(); ++j) {
      const float* row = lg.data() + static_cast<int64_t>(j) * vocab;
      out[j] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
    }
    return;
  }
#if KILN_WITH_CUDA
  auto ids = [&](const Tensor& lg) {  // argmax of each row of lg on the device, then to host_argmax_
    const int64_t m = lg.size(0);
    cuda::argmax_rows_f32(exec_, lg.data<float>(), m, vocab, argmax_.data<int32_t>());
    copy_to_host_async(host_argmax_.data(), argmax_.raw(), sizeof(int32_t) * static_cast<size_t>(m));
    synchronize_stream();
  };
  if (logits_ready_ > 0) {
    ids(logits_.rows(0, logits_ready_));
    for (size_t j = 0; j < rows.size(); ++j) out[j] = host_argmax_[static_cast<size_t>(rows[j])];
    return;
  }
  const int64_t chunk = options_.logit_rows, count = static_cast<int64_t>(rows.size());
  for (int64_t begin = 0; begin < count; begin += chunk) {
    const int64_t m = std::min(chunk, count - begin);
    ids(compute_logits(rows.subspan(static_cast<size_t>(begin), static_cast<size_t>(m))));
    std::copy_n(host_argmax_.data(), m, out.begin() + begin);
  }
#endif
}

void Decoder::greedy_chain(int64_t steps, std::vector<int32_t>& out) {
  const int64_t n = rows_, r = options_.max_rows;
  KILN_CHECK(steps >= 1 && steps <= options_.chain_steps, "decoder", "greedy_chain of {} steps (1 to {} allowed)",
             steps, options_.chain_steps);
  KILN_CHECK(n > 0 && distinct_slots_, "decoder",
             "greedy_chain follows a forward whose rows are distinct sequences (a decode step)");
  // The last forward's rows as uploaded (host_inputs_: tokens, slots, positions).
  const auto slots = host_inputs_.begin() + r, positions = host_inputs_.begin() + 2 * r;
  for (int64_t i = 0; i < n; ++i)
    KILN_CHECK(positions[i] + steps - 1 < options_.max_len, "decoder",
               "greedy_chain: row {} would pass the cache length {}", i, options_.max_len);
  out.resize(static_cast<size_t>(steps * n));
#if KILN_WITH_CUDA
  if (chain_.defined() && logits_ready_ == n) {
    // Every step a graph: record the ids, advance the inputs, run the step, take its argmax.
    int32_t* history = chain_.data<int32_t>();
    int32_t* counter = history + options_.chain_steps * graph_rows_;
    const float* logits = logits_.data<float>();
    int32_t* ids = argmax_.data<int32_t>();
    const int64_t vocab = config_.vocab_size;
    cuda::argmax_rows_f32(exec_, logits, n, vocab, ids);
    for (int64_t s = 1; s < steps; ++s)
      graphs_->run(kChainKey + n, [&] {
        cuda::record_greedy_ids(exec_, ids, n, history, counter, true, tokens_.data<int32_t>(), positions_.data<int32_t>());
        step(n, true);
        cuda::argmax_rows_f32(exec_, logits, n, vocab, ids);
      });
    cuda::record_greedy_ids(exec_, ids, n, history, counter, false, nullptr, nullptr);
    copy_to_host_async(host_chain_.data(), history, sizeof(int32_t) * static_cast<size_t>(steps * n));
    synchronize_stream();
    std::copy_n(host_chain_.data(), steps * n, out.begin());
    // The host's copy of the inputs follows the device's: the last step's tokens and positions.
    for (int64_t i = 0; i < n && steps > 1; ++i) {
      host_inputs_[static_cast<size_t>(i)] = out[static_cast<size_t>((steps - 2) * n + i)];
      positions[i] += static_cast<int32_t>(steps - 1);
    }
    return;
  }
#endif
  // Elsewhere (the CPU, steps not captured): the same steps one by one.
  std::vector<int32_t> rows(static_cast<size_t>(n)), ids;
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<int32_t> step_slots(slots, slots + n), step_positions(positions, positions + n);
  for (int64_t s = 0; s < steps; ++s) {
    greedy(rows, ids);
    std::copy(ids.begin(), ids.end(), out.begin() + s * n);
    if (s + 1 == steps) break;
    for (int32_t& p : step_positions) ++p;
    forward(ids, step_slots, step_positions);
  }
}

}  // namespace kiln
