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

namespace kiln {

struct Decoder::Layer {
  Tensor attn_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, mlp_norm, gate_up_w, down_w;
};

namespace {

void require_component(bool ok, const char* key, const std::string& value) {
  KILN_CHECK(ok, "decoder", "model.{} = '{}' has no KV-cache decode path (supported: norm rmsnorm, attention gqa, "
             "mlp swiglu, position rope|none)", key, value);
}

// A host span as a CPU tensor view (no copy).
Tensor host_view(std::span<const int32_t> v) {
  return Tensor(const_cast<int32_t*>(v.data()), DType::i32, Device::cpu, Shape{static_cast<int64_t>(v.size())});
}

}  // namespace

Decoder::Decoder(const Model& model, const DecoderOptions& options)
    : model_(model), config_(model.config()), options_(options), arena_("decoder", model.options().device) {
  const ModelConfig& m = config_;
  require_component(m.norm == "rmsnorm", "norm", m.norm);
  require_component(m.attention == "gqa", "attention", m.attention);
  require_component(m.mlp == "swiglu", "mlp", m.mlp);
  require_component(m.position == "rope" || m.position == "none", "position", m.position);
  if (options_.max_len <= 0 || options_.max_len > m.max_seq_len) options_.max_len = m.max_seq_len;
  KILN_CHECK(options_.slots > 0 && options_.max_rows > 0 && options_.logit_rows > 0, "decoder",
             "slots, max_rows and logit_rows must be positive");
  const DType dt = model.options().dtype;
  const int64_t r = options_.max_rows, d = m.hidden, hq = m.heads, hkv = m.kv_heads, hd = m.head_dim;

  embed_ = lookup("embed.weight");
  final_norm_ = lookup("final_norm.weight");
  head_ = m.tie_embeddings ? embed_ : lookup("lm_head.weight");
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    auto layer = std::make_unique<Layer>();
    layer->attn_norm = lookup(p + "attn_norm.weight");
    layer->mlp_norm = lookup(p + "mlp_norm.weight");
    layer->qkv_w = fused({p + "attn.q_proj.weight", p + "attn.k_proj.weight", p + "attn.v_proj.weight"});
    if (m.attention_bias)
      layer->qkv_b = fused({p + "attn.q_proj.bias", p + "attn.k_proj.bias", p + "attn.v_proj.bias"});
    if (m.qk_norm) {
      layer->q_norm = lookup(p + "attn.q_norm.weight");
      layer->k_norm = lookup(p + "attn.k_norm.weight");
    }
    layer->o_w = lookup(p + "attn.o_proj.weight");
    layer->gate_up_w = fused({p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"});
    layer->down_w = lookup(p + "mlp.down_proj.weight");
    layers_.push_back(std::move(layer));
  }

  cache_ = std::make_unique<KvCache>(arena_, KvCacheShape{m.layers, options_.slots, options_.max_len, hkv, hd}, dt);
  arena_.reserve(tokens_, DType::i32, Shape{r});
  arena_.reserve(slots_, DType::i32, Shape{r});
  arena_.reserve(positions_, DType::i32, Shape{r});
  arena_.reserve(x_, dt, Shape{r, d});
  arena_.reserve(h_, dt, Shape{r, d});
  arena_.reserve(branch_, dt, Shape{r, d});
  arena_.reserve(rstd_, dt, Shape{r});
  arena_.reserve(qkv_, dt, Shape{r, (hq + 2 * hkv) * hd});
  arena_.reserve(q_, dt, Shape{r, hq, hd});
  arena_.reserve(k_, dt, Shape{r, hkv, hd});
  arena_.reserve(v_, dt, Shape{r, hkv, hd});
  if (m.qk_norm) {
    arena_.reserve(qn_, dt, Shape{r, hq, hd});
    arena_.reserve(kn_, dt, Shape{r, hkv, hd});
    arena_.reserve(qk_rstd_, dt, Shape{r * std::max(hq, hkv)});
  }
  arena_.reserve(attn_, dt, Shape{r, hq, hd});
  arena_.reserve(gate_up_, dt, Shape{r, 2 * m.ffn_hidden});
  arena_.reserve(act_, dt, Shape{r, m.ffn_hidden});
  const int64_t lr = options_.logit_rows;
  arena_.reserve(gather_, dt, Shape{lr, d});
  arena_.reserve(logits_, dt, Shape{lr, m.vocab_size});
  if (m.position == "rope") {
    arena_.reserve(cos_, dt, Shape{options_.max_len, hd / 2});
    arena_.reserve(sin_, dt, Shape{options_.max_len, hd / 2});
  }
  arena_.allocate();
  if (model.options().device != Device::cpu || dt != DType::f32)
    host_logits_ = OwnedTensor(dt, Device::cpu, logits_.shape());
  if (m.position == "rope") {  // the model's own tables: same inverse frequencies and fp32 angles
    OwnedTensor hc(dt, Device::cpu, cos_.shape()), hs(dt, Device::cpu, sin_.shape());
    ops::rope_fill_tables(ops::rope_inverse_frequencies(m.rope_theta, hd), *hc, *hs);
    copy_tensor(*hc, cos_);
    copy_tensor(*hs, sin_);
  }
}

Decoder::~Decoder() = default;

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
  const ModelConfig& m = config_;
  const int64_t hq = m.heads, hkv = m.kv_heads, hd = m.head_dim;
  rows_ = n;
  const Tensor tok = tokens_.rows(0, n), slot = slots_.rows(0, n), pos = positions_.rows(0, n);
  copy_tensor(host_view(tokens), tok);
  copy_tensor(host_view(slots), slot);
  copy_tensor(host_view(positions), pos);
  const Tensor x = x_.rows(0, n), h = h_.rows(0, n), branch = branch_.rows(0, n), rstd = rstd_.rows(0, n);
  const Tensor qkv = qkv_.rows(0, n), q = q_.rows(0, n), k = k_.rows(0, n), v = v_.rows(0, n), o = attn_.rows(0, n);
  const Tensor gate_up = gate_up_.rows(0, n), act = act_.rows(0, n);
  const ops::AttentionOptions attention_options;  // as nn/gqa_attention.cpp: scale 1/sqrt(D)

  ops::embedding_forward(tok, embed_, x);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = *layers_[l];
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
    ops::kv_cache_write(k, v, slot, pos, cache_->k(static_cast<int64_t>(l)), cache_->v(static_cast<int64_t>(l)));
    ops::cached_attention_forward(q, cache_->k(static_cast<int64_t>(l)), cache_->v(static_cast<int64_t>(l)), slot, pos,
                                  attention_options, o);
    ops::linear_forward(o.view(Shape{n, hq * hd}), L.o_w, Tensor(), branch);
    ops::add_inplace(x, branch);
    ops::rms_norm_forward(x, L.mlp_norm, m.norm_eps, h, rstd);
    ops::linear_forward(h, L.gate_up_w, Tensor(), gate_up);
    ops::swiglu_forward(gate_up, act);
    ops::linear_forward(act, L.down_w, Tensor(), branch);
    ops::add_inplace(x, branch);
  }
  ops::rms_norm_forward(x, final_norm_, m.norm_eps, h, rstd);  // h = final hidden states
}

void Decoder::logits(std::span<const int32_t> rows, std::vector<float>& out) {
  const int64_t vocab = config_.vocab_size, chunk = options_.logit_rows;
  const auto count = static_cast<int64_t>(rows.size());
  out.resize(static_cast<size_t>(count * vocab));
  const OwnedTensor& host = host_logits_;
  for (int64_t begin = 0; begin < count; begin += chunk) {
    const int64_t m = std::min(chunk, count - begin);
    for (int64_t j = 0; j < m; ++j) {
      const int32_t r = rows[static_cast<size_t>(begin + j)];
      KILN_CHECK(r >= 0 && r < rows_, "decoder", "logits of row {} outside the last step's {} rows", r, rows_);
      copy_tensor(h_.rows(r, r + 1), gather_.rows(j, j + 1));
    }
    const Tensor lg = logits_.rows(0, m);
    ops::lm_head_logits(gather_.rows(0, m), head_, 0.0, lg);
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

}  // namespace kiln
