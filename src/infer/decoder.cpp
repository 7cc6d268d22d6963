#include "infer/decoder.h"

#include "ops/attention/cached_attention.h"
#include "ops/elementwise/elementwise.h"
#include "ops/embedding/embedding.h"
#include "ops/cross_entropy/lm_head_loss.h"
#include "ops/linear/linear.h"
#include "ops/rms_norm/rms_norm.h"
#include "ops/rope/rope.h"
#include "ops/split/qkv_split.h"
#include "ops/swiglu/swiglu.h"

#if KILN_WITH_CUDA
#include "core/op_profiler.h"
#include "core/step_graphs.h"
#include "infer/decoder_cuda.h"
#include "ops/cross_entropy/cross_entropy_cuda.h"
#endif

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kiln {

struct Decoder::Layer {
  Tensor attn_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, mlp_norm, gate_up_w, down_w;
};

namespace {

void require_component(bool ok, const char* key, const std::string& value) {
  KILN_CHECK(ok, "decoder", "model.{} = '{}' has no KV-cache decode path (supported: norm rmsnorm, attention gqa, "
             "mlp swiglu, position rope|none)", key, value);
}

// StepGraphs key of a chained greedy step of n rows (greedy_chain); forward's steps use n
// and -n.
constexpr int64_t kChainKey = int64_t{1} << 32;

// The model's attention as nn/gqa_attention.cpp runs it: scale 1/sqrt(D), its window and
// attention softcap.
ops::AttentionOptions attention_options_of(const ModelConfig& m) {
  ops::AttentionOptions o;
  o.window = m.sliding_window;
  o.softcap = m.attention_softcap;
  return o;
}

}  // namespace

Decoder::Decoder(const Model& model, const DecoderOptions& options)
    : model_(model),
      config_(model.config()),
      options_(options),
      device_(model.options().device),
      arena_("decoder", model.options().device) {
  const ModelConfig& m = config_;
  require_component(m.norm == "rmsnorm", "norm", m.norm);
  require_component(m.attention == "gqa", "attention", m.attention);
  require_component(m.mlp == "swiglu", "mlp", m.mlp);
  require_component(m.position == "rope" || m.position == "none", "position", m.position);
  if (options_.max_len <= 0 || options_.max_len > m.max_seq_len) options_.max_len = m.max_seq_len;
  KILN_CHECK(options_.slots > 0 && options_.max_rows > 0 && options_.logit_rows > 0, "decoder",
             "slots, max_rows and logit_rows must be positive");
  // Parameter values are the masters (f32, or f64 on the CPU), also of a bf16 model.
  wide_ = lookup("embed.weight").dtype();
  dtype_ = device_ == Device::cuda ? options_.cuda_dtype : wide_;
  KILN_CHECK(device_ == Device::cpu || (wide_ == DType::f32 && (dtype_ == DType::f32 || dtype_ == DType::bf16)),
             "decoder", "on the GPU the weights must be f32 and the compute dtype f32 or bf16 (got {} weights, {})",
             dtype_name(wide_), dtype_name(dtype_));
  mixed_ = dtype_ != wide_;
  fused_ = device_ == Device::cuda && options_.fuse;
  // Capture needs every kernel on kiln::cuda::stream(); the fp32 RMSNorm front end launches
  // on the legacy stream, so the unfused fp32 GPU path runs its steps uncaptured.
  const bool capturable = mixed_ || fused_;
  graph_rows_ = device_ == Device::cuda && capturable
                    ? std::max<int64_t>(0, std::min({options_.graph_rows, options_.max_rows, options_.logit_rows}))
                    : 0;
  // The fused decode projections: bf16 weights, no q/k/v bias, every k within the kernel's limits.
#if KILN_WITH_CUDA
  if (fused_ && options_.gemv_rows > 0 && dtype_ == DType::bf16 && !m.attention_bias) {
    gemv_rows_ = std::min<int64_t>({8, options_.gemv_rows, options_.max_rows});
    for (int64_t k : {m.hidden, m.heads * m.head_dim, m.ffn_hidden})
      if (!cuda::decode_gemv_fits(gemv_rows_, k)) gemv_rows_ = 0;
  }
  one_kernel_attention_ = gemv_rows_ > 0 && options_.one_kernel_attention &&
                          cuda::decode_attention_fits(m.heads, m.kv_heads, m.head_dim);
#endif
  const DType dt = dtype_, wide = wide_;
  const int64_t r = options_.max_rows, d = m.hidden, hq = m.heads, hkv = m.kv_heads, hd = m.head_dim;

  embed_ = lookup("embed.weight");  // rows are looked up in the master: the residual stream is wide
  final_norm_ = lookup("final_norm.weight");
  compute_weight(m.tie_embeddings ? embed_ : lookup("lm_head.weight"), head_);
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    auto layer = std::make_unique<Layer>();
    layer->attn_norm = lookup(p + "attn_norm.weight");
    layer->mlp_norm = lookup(p + "mlp_norm.weight");
    compute_weight(fused({p + "attn.q_proj.weight", p + "attn.k_proj.weight", p + "attn.v_proj.weight"}),
                   layer->qkv_w);
    if (m.attention_bias)
      layer->qkv_b = fused({p + "attn.q_proj.bias", p + "attn.k_proj.bias", p + "attn.v_proj.bias"});
    if (m.qk_norm) {
      layer->q_norm = lookup(p + "attn.q_norm.weight");
      layer->k_norm = lookup(p + "attn.k_norm.weight");
    }
    compute_weight(lookup(p + "attn.o_proj.weight"), layer->o_w);
    compute_weight(fused({p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}), layer->gate_up_w);
    compute_weight(lookup(p + "mlp.down_proj.weight"), layer->down_w);
    layers_.push_back(std::move(layer));
  }

  cache_ = std::make_unique<KvCache>(arena_, KvCacheShape{m.layers, options_.slots, options_.max_len, hkv, hd}, dt);
  arena_.reserve(inputs_, DType::i32, Shape{3, r});
  arena_.reserve(x_, wide, Shape{r, d});
  arena_.reserve(h_, dt, Shape{r, d});
  arena_.reserve(branch_, dt, Shape{r, d});
  arena_.reserve(rstd_, wide, Shape{r});
  arena_.reserve(qkv_, dt, Shape{r, (hq + 2 * hkv) * hd});
  arena_.reserve(q_, dt, Shape{r, hq, hd});
  arena_.reserve(k_, dt, Shape{r, hkv, hd});
  arena_.reserve(v_, dt, Shape{r, hkv, hd});
  if (m.qk_norm) {
    arena_.reserve(qn_, dt, Shape{r, hq, hd});
    arena_.reserve(kn_, dt, Shape{r, hkv, hd});
    arena_.reserve(qk_rstd_, wide, Shape{r * std::max(hq, hkv)});
  }
  arena_.reserve(attn_, dt, Shape{r, hq, hd});
  arena_.reserve(gate_up_, dt, Shape{r, 2 * m.ffn_hidden});
  arena_.reserve(act_, dt, Shape{r, m.ffn_hidden});
  if (device_ == Device::cuda) {  // the largest split workspace of any row count
    int64_t elems = 0;
    for (int64_t n = 1; n <= r; ++n)
      elems = std::max(elems, ops::cached_attention_workspace(n, hq, hkv, hd, options_.max_len));
    if (elems > 0) arena_.reserve(attn_workspace_, DType::f32, Shape{elems});
  }
  const int64_t lr = options_.logit_rows;
  arena_.reserve(gather_, dt, Shape{lr, d});
  arena_.reserve(logits_, wide, Shape{lr, m.vocab_size});
  if (device_ == Device::cuda) arena_.reserve(argmax_, DType::i32, Shape{lr});
  const bool chains_on_device = device_ == Device::cuda && graph_rows_ > 0;
  KILN_CHECK(options_.chain_steps >= 1, "decoder", "chain_steps must be at least 1, not {}", options_.chain_steps);
  if (chains_on_device) arena_.reserve(chain_, DType::i32, Shape{options_.chain_steps * graph_rows_ + 1});
  if (m.position == "rope") {
    arena_.reserve(cos_, wide, Shape{options_.max_len, hd / 2});
    arena_.reserve(sin_, wide, Shape{options_.max_len, hd / 2});
  }
  arena_.allocate();
  if (chain_.defined()) zero_tensor(chain_);  // the step counter starts at 0

  for (const auto& [master, copy] : to_convert_) ops::convert(master, *copy);  // once: masters -> bf16
  to_convert_.clear();
  weight_bytes_ = final_norm_.nbytes() + head_.nbytes();
  for (const auto& L : layers_)
    for (const Tensor* t : {&L->attn_norm, &L->qkv_w, &L->qkv_b, &L->q_norm, &L->k_norm, &L->o_w, &L->mlp_norm,
                            &L->gate_up_w, &L->down_w})
      if (t->defined()) weight_bytes_ += t->nbytes();
  tokens_ = inputs_.rows(0, 1).view(Shape{r});
  slots_ = inputs_.rows(1, 2).view(Shape{r});
  positions_ = inputs_.rows(2, 3).view(Shape{r});
  host_inputs_.assign(static_cast<size_t>(3 * r), 0);
  if (device_ == Device::cuda) host_argmax_ = PinnedArray<int32_t>(static_cast<size_t>(options_.logit_rows));
  if (chain_.defined()) host_chain_ = PinnedArray<int32_t>(static_cast<size_t>(options_.chain_steps * graph_rows_));
  sorted_slots_.reserve(static_cast<size_t>(r));
  if (device_ != Device::cpu || wide != DType::f32) host_logits_ = OwnedTensor(wide, Device::cpu, logits_.shape());
  if (m.position == "rope") {  // the model's own tables: same inverse frequencies and fp32 angles
    OwnedTensor hc(wide, Device::cpu, cos_.shape()), hs(wide, Device::cpu, sin_.shape());
    ops::rope_fill_tables(ops::rope_inverse_frequencies(m.rope_theta, hd), *hc, *hs);
    copy_tensor(*hc, cos_);
    copy_tensor(*hs, sin_);
  }
#if KILN_WITH_CUDA
  if (graph_rows_ > 0) graphs_ = std::make_shared<cuda::StepGraphs>("decoder");
#endif
}

Decoder::~Decoder() = default;

size_t Decoder::graphs() const {
#if KILN_WITH_CUDA
  if (graphs_) return graphs_->size();
#endif
  return 0;
}

// The weight a GEMM reads: the master itself, or on the mixed path a compute copy
// reserved here and converted once the arena exists.
void Decoder::compute_weight(const Tensor& master, Tensor& dst) {
  if (!mixed_ || master.rank() != 2) {
    dst = master;
    return;
  }
  arena_.reserve(dst, dtype_, master.shape());
  to_convert_.emplace_back(master, &dst);
}

Tensor Decoder::lookup(const std::string& name) const {
  const Parameter* p = model_.find_parameter(name);
  KILN_CHECK(p != nullptr, "decoder", "the model has no parameter '{}'", name);
  return p->value();
}

// Parts stacked by rows as one matrix (or vector): the model's fused storage when the parts
// are adjacent in memory (as the training modules lay them out), else a one-time copy.
Tensor Decoder::fused(const std::vector<std::string>& names) {
  std::vector<Tensor> parts;
  for (const std::string& n : names) parts.push_back(lookup(n));
  int64_t rows = 0;
  bool adjacent = true;
  const auto* expect = static_cast<const uint8_t*>(parts[0].raw());
  for (const Tensor& t : parts) {
    KILN_CHECK(t.rank() == parts[0].rank() && (t.rank() == 1 || t.size(1) == parts[0].size(1)), "decoder",
               "parameters {} cannot be stacked", names[0]);
    adjacent = adjacent && static_cast<const uint8_t*>(t.raw()) == expect;
    expect = static_cast<const uint8_t*>(t.raw()) + t.nbytes();
    rows += t.size(0);
  }
  const Shape shape = parts[0].rank() == 1 ? Shape{rows} : Shape{rows, parts[0].size(1)};
  const Tensor& first = parts[0];
  if (adjacent) return Tensor(first.raw(), first.dtype(), first.device(), shape);
  copies_.push_back(std::make_unique<OwnedTensor>(first.dtype(), first.device(), shape));
  const Tensor& dst = **copies_.back();
  int64_t at = 0;
  for (const Tensor& t : parts) {
    copy_tensor(t, dst.rows(at, at + t.size(0)));
    at += t.size(0);
  }
  return dst;
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
// kernels and library calls on the stream (it may be captured into a graph).
void Decoder::step(int64_t n, bool with_logits) {
  if (fused_) return step_fused(n, with_logits);
  const ModelConfig& m = config_;
  const int64_t hq = m.heads, hkv = m.kv_heads, hd = m.head_dim;
  const Tensor tok = tokens_.rows(0, n), slot = slots_.rows(0, n), pos = positions_.rows(0, n);
  const Tensor x = x_.rows(0, n), h = h_.rows(0, n), branch = branch_.rows(0, n), rstd = rstd_.rows(0, n);
  const Tensor qkv = qkv_.rows(0, n), q = q_.rows(0, n), k = k_.rows(0, n), v = v_.rows(0, n), o = attn_.rows(0, n);
  const Tensor gate_up = gate_up_.rows(0, n), act = act_.rows(0, n);
  const ops::AttentionOptions attention_options = attention_options_of(m);
  // x += branch: in place, or fp32 + bf16 -> fp32 on the mixed path.
  auto residual_add = [&] { mixed_ ? ops::add(x, branch, x) : ops::add_inplace(x, branch); };

  ops::embedding_forward(tok, embed_, x);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = *layers_[l];
    const Tensor& k_cache = cache_->k(static_cast<int64_t>(l));
    const Tensor& v_cache = cache_->v(static_cast<int64_t>(l));
    ops::rms_norm_forward(x, L.attn_norm, m.norm_eps, h, rstd);
    ops::linear_forward(h, L.qkv_w, L.qkv_b, qkv);
    if (m.qk_norm) {
      const Tensor qn = qn_.rows(0, n), kn = kn_.rows(0, n);
      ops::qkv_split(qkv, qn, kn, v);
      ops::rms_norm_forward(qn.view(Shape{n * hq, hd}), L.q_norm, m.norm_eps, q.view(Shape{n * hq, hd}),
                            qk_rstd_.rows(0, n * hq));
      ops::rms_norm_forward(kn.view(Shape{n * hkv, hd}), L.k_norm, m.norm_eps, k.view(Shape{n * hkv, hd}),
                            qk_rstd_.rows(0, n * hkv));
    } else {
      ops::qkv_split(qkv, q, k, v);
    }
    if (m.position == "rope") {
      ops::rope_apply(q, pos, cos_, sin_, false);
      ops::rope_apply(k, pos, cos_, sin_, false);
    }
    ops::kv_cache_write(k, v, slot, pos, k_cache, v_cache);
    ops::cached_attention_forward(q, k_cache, v_cache, slot, pos, attention_options, o, attn_workspace_);
    ops::linear_forward(o.view(Shape{n, hq * hd}), L.o_w, Tensor(), branch);
    residual_add();
    ops::rms_norm_forward(x, L.mlp_norm, m.norm_eps, h, rstd);
    ops::linear_forward(h, L.gate_up_w, Tensor(), gate_up);
    ops::swiglu_forward(gate_up, act);
    ops::linear_forward(act, L.down_w, Tensor(), branch);
    residual_add();
  }
  ops::rms_norm_forward(x, final_norm_, m.norm_eps, h, rstd);  // h = final hidden states
  if (with_logits) ops::lm_head_logits(h, head_, config_.logit_softcap, logits_.rows(0, n));
}

// The GPU step with the fused kernels: per block, the q/k/v epilogue and the two residual
// adds (each with the RMSNorm after it: the MLP's, then the next block's or the final one)
// are one kernel each instead of six and four op calls. Steps of up to gemv_rows_ rows that
// compute their logits (the captured decode steps) run step_gemv instead.
void Decoder::step_fused([[maybe_unused]] int64_t n, [[maybe_unused]] bool with_logits) {
#if KILN_WITH_CUDA
  if (with_logits && n <= gemv_rows_) return step_gemv(n);
  const ModelConfig& m = config_;
  const int64_t d = m.hidden;
  const auto eps = static_cast<float>(m.norm_eps);
  const Tensor tok = tokens_.rows(0, n);
  const Tensor x = x_.rows(0, n), h = h_.rows(0, n), branch = branch_.rows(0, n), qkv = qkv_.rows(0, n);
  const Tensor o = attn_.rows(0, n), gate_up = gate_up_.rows(0, n), act = act_.rows(0, n);
  auto gain = [](const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; };

  ops::embedding_forward(tok, embed_, x);
  // x += branch (skipped when undefined), h = RMSNorm(x) * gain; timed as one op by kiln's
  // op profiler, like the q/k/v kernel.
  auto add_norm = [&](const Tensor& add, const Tensor& norm_gain) {
    OpScope scope("add_rms_norm (fused)", Device::cuda);
    cuda::add_rms_norm(dtype_, x.data<float>(), add.defined() ? add.raw() : nullptr, gain(norm_gain), eps, n, d,
                       h.raw());
  };
  add_norm(Tensor(), layers_[0]->attn_norm);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = *layers_[l];
    ops::linear_forward(h, L.qkv_w, L.qkv_b, qkv);
    attend(l, n);
    ops::linear_forward(o.view(Shape{n, m.heads * m.head_dim}), L.o_w, Tensor(), branch);
    add_norm(branch, L.mlp_norm);
    ops::linear_forward(h, L.gate_up_w, Tensor(), gate_up);
    ops::swiglu_forward(gate_up, act);
    ops::linear_forward(act, L.down_w, Tensor(), branch);
    add_norm(branch, l + 1 < layers_.size() ? layers_[l + 1]->attn_norm : final_norm_);
  }
  if (with_logits) ops::lm_head_logits(h, head_, config_.logit_softcap, logits_.rows(0, n));  // h = final hidden states
#endif
}

// A block's attention after its q|k|v projection (qkv_): q/k norm, RoPE and the cache write
// in one kernel, then attention over the cache into attn_.
void Decoder::attend([[maybe_unused]] size_t l, [[maybe_unused]] int64_t n) {
#if KILN_WITH_CUDA
  const ModelConfig& m = config_;
  const Layer& L = *layers_[l];
  const bool rope = m.position == "rope";
  const Tensor slot = slots_.rows(0, n), pos = positions_.rows(0, n), q = q_.rows(0, n);
  const Tensor& k_cache = cache_->k(static_cast<int64_t>(l));
  const Tensor& v_cache = cache_->v(static_cast<int64_t>(l));
  auto gain = [](const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; };
  {
    OpScope scope("qkv_to_cache (fused)", Device::cuda);
    cuda::qkv_to_cache(dtype_, qkv_.raw(), n, m.heads, m.kv_heads, m.head_dim, gain(L.q_norm), gain(L.k_norm),
                       static_cast<float>(m.norm_eps), rope ? cos_.data<float>() : nullptr,
                       rope ? sin_.data<float>() : nullptr, slot.data<int32_t>(), pos.data<int32_t>(),
                       options_.max_len, q.raw(), k_cache.raw(), v_cache.raw());
  }
  ops::cached_attention_forward(q, k_cache, v_cache, slot, pos, attention_options_of(m), attn_.rows(0, n),
                                attn_workspace_);
#endif
}

#if KILN_WITH_CUDA
// The one-kernel attention of block l over the step's n rows: qkv_ in, attn_ out.
cuda::DecodeAttentionArgs Decoder::attention_args(size_t l, int64_t n) const {
  const ModelConfig& m = config_;
  const Layer& L = *layers_[l];
  const bool rope = m.position == "rope";
  auto gain = [](const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; };
  const ops::AttentionOptions options = attention_options_of(m);  // as attend()
  cuda::DecodeAttentionArgs a{};
  a.rows = n, a.q_heads = m.heads, a.kv_heads = m.kv_heads, a.head_dim = m.head_dim, a.max_len = options_.max_len;
  a.qkv = qkv_.raw();
  a.q_gain = gain(L.q_norm), a.k_gain = gain(L.k_norm), a.eps = static_cast<float>(m.norm_eps);
  a.cos = rope ? cos_.data<float>() : nullptr, a.sin = rope ? sin_.data<float>() : nullptr;
  a.slots = slots_.data<int32_t>(), a.positions = positions_.data<int32_t>();
  // As the cached_attention front end: 1/sqrt(D) in double, then rounded.
  a.scale = static_cast<float>(options.scale > 0 ? options.scale : 1.0 / std::sqrt(static_cast<double>(m.head_dim)));
  a.window = options.window, a.softcap = static_cast<float>(options.softcap);
  a.k_cache = cache_->k(static_cast<int64_t>(l)).raw(), a.v_cache = cache_->v(static_cast<int64_t>(l)).raw();
  a.out = attn_.raw();
  return a;
}
#endif

// A decode step on the fused projections (infer/decoder_cuda.h): per block, the q|k|v
// projection reads the residual stream through the attention norm, the o and down
// projections add into it, and the gate|up projection applies the MLP norm and SwiGLU;
// the LM head reads it through the final norm. Five kernels per block.
void Decoder::step_gemv([[maybe_unused]] int64_t n) {
#if KILN_WITH_CUDA
  const ModelConfig& m = config_;
  const int64_t d = m.hidden, qkv_cols = (m.heads + 2 * m.kv_heads) * m.head_dim, attn_cols = m.heads * m.head_dim;
  const auto eps = static_cast<float>(m.norm_eps);
  float* x = x_.data<float>();
  ops::embedding_forward(tokens_.rows(0, n), embed_, x_.rows(0, n));
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = *layers_[l];
    {
      OpScope scope("norm + qkv projection (fused)", Device::cuda);
      cuda::norm_gemv(dtype_, x, L.attn_norm.data<float>(), eps, n, d, L.qkv_w.raw(), qkv_cols, qkv_.raw());
    }
    if (one_kernel_attention_ && distinct_slots_) {
      OpScope scope("attention with q/k norm, RoPE, cache write (fused)", Device::cuda);
      cuda::decode_attention(attention_args(l, n));
    } else {
      attend(l, n);
    }
    {
      OpScope scope("o projection + residual (fused)", Device::cuda);
      cuda::gemv_add_residual(attn_.raw(), n, attn_cols, L.o_w.raw(), d, x);
    }
    {
      OpScope scope("norm + gate|up + swiglu (fused)", Device::cuda);
      cuda::norm_gemv_swiglu(x, L.mlp_norm.data<float>(), eps, n, d, L.gate_up_w.raw(), m.ffn_hidden, act_.raw());
    }
    {
      OpScope scope("down projection + residual (fused)", Device::cuda);
      cuda::gemv_add_residual(act_.raw(), n, m.ffn_hidden, L.down_w.raw(), d, x);
    }
  }
  OpScope scope("final norm + lm head (fused)", Device::cuda);
  cuda::norm_gemv(DType::f32, x, final_norm_.data<float>(), eps, n, d, head_.raw(), m.vocab_size, logits_.raw());
  if (m.logit_softcap > 0)
    cuda::softcap_f32(logits_.data<float>(), n * m.vocab_size, static_cast<float>(m.logit_softcap));
#endif
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
  ops::lm_head_logits(gather_.rows(0, m), head_, config_.logit_softcap, lg);
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
    cuda::argmax_rows_f32(lg.data<float>(), m, vocab, argmax_.data<int32_t>());
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
    cuda::argmax_rows_f32(logits, n, vocab, ids);
    for (int64_t s = 1; s < steps; ++s)
      graphs_->run(kChainKey + n, [&] {
        cuda::record_greedy_ids(ids, n, history, counter, true, tokens_.data<int32_t>(), positions_.data<int32_t>());
        step(n, true);
        cuda::argmax_rows_f32(logits, n, vocab, ids);
      });
    cuda::record_greedy_ids(ids, n, history, counter, false, nullptr, nullptr);
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
