// Position encodings: "rope" (rotary, rotate_half pairing, tables built once) and "none"
// (NoPE: attention sees no explicit positions). RoPE's frequency scalings
// (model.rope.scaling: linear, ntk, yarn, llama3) change only the tables: the inverse
// frequencies and YaRN's factor on cos and sin (nn/rope_scaling.h); every kernel that
// rotates reads the tables, so training, decode and both devices agree by construction.
//
// Partial rotary (model.rope.fraction < 1) is tables too: the frequencies of a RoPE over
// R = fraction x D dims fill the first R/2 pairs (j, j + D/2), and the pairs after them
// hold cos 1 and sin 0, so their dims pass unrotated. GPT-NeoX's convention rotates the
// first R dims instead (pairs (j, j + R/2)); the two differ by one fixed permutation of the
// head dims, the same for q and k, which leaves every q.k as it is (the GGUF exporter
// applies it to q/k rows for llama.cpp, which rotates GPT-NeoX's way: io/gguf_export.h).
#include "nn/modules.h"
#include "nn/rope_scaling.h"
#include "ops/rope/rope.h"

namespace kiln {

namespace {

class Rope final : public PositionEncoding {
 public:
  Rope(BuildContext& ctx, const ModelConfig& model)
      : exec_(ctx.exec), theta_(model.rope_theta), head_dim_(model.head_dim), rotary_dims_(rotary_dims(model)), scaling_(model.rope) {
    frequencies_ = rope_frequencies(model.rope, model.rope_theta, rotary_dims_);
    // Tables are planned like any buffer and filled once, after allocation, on first use.
    ctx.buffer(cos_, Shape{model.max_seq_len, model.head_dim / 2}, ctx.master_dtype);
    ctx.buffer(sin_, Shape{model.max_seq_len, model.head_dim / 2}, ctx.master_dtype);
  }

  RotaryTables rotary() override {
    if (!filled_) fill();
    return {cos_, sin_};
  }

  // rotate_half pairing (llama.cpp's llama architecture pairs rows interleaved: its
  // exporter permutes the q/k rows the attention marks).
  void export_config(ExportConfig& out) const override {
    if (head_dim_ % 2 != 0) out.refuse("model.head_dim", std::to_string(head_dim_), "RoPE needs an even head_dim");
    // transformers' partial_rotary_factor lives in GPT-NeoX/Phi/StableLM/GLM-shaped
    // classes; the Llama/Qwen2/Qwen3 classes kiln exports to rotate the whole head whatever
    // it says. llama.cpp's qwen2/qwen3 (NEOX) rotate the first rope.dimension_count dims
    // (the exporter reorders q/k rows to match: io/gguf_export.h); its llama refuses fewer.
    // (kiln's export of llama.cpp's gemma2/gemma3 is checked with whole-head rotation only.)
    if (rotary_dims_ != head_dim_ && (out.format() == ExportConfig::Format::hf || out.is("llama") || out.gemma()))
      out.refuse("model.rope.fraction", fmt::format("{}", scaling_.fraction),
                 out.format() == ExportConfig::Format::hf
                     ? "the stock Llama/Qwen classes rotate the whole head (they ignore partial_rotary_factor)"
                     : "llama.cpp's llama rotates the whole head and kiln's gemma2/gemma3 GGUF export writes "
                       "whole-head rotation only (rope.dimension_count must be head_dim)");
    // ntk exports as the plain RoPE of its effective base: the same frequencies at every
    // length (transformers' "dynamic" type would recompute them past max_position_embeddings).
    const bool ntk = scaling_.scaling == "ntk";
    const double theta = ntk ? ntk_theta(scaling_, theta_, rotary_dims_) : theta_;
    const bool plain = scaling_.scaling == "none" || ntk;
    if (out.format() == ExportConfig::Format::gguf) {
      export_gguf(out, theta, plain);
      return;
    }
    // transformers 4.x reads rope_theta (+ rope_scaling); 5.x reads rope_parameters.
    out.set("rope_theta", theta, "model.rope_theta");
    nlohmann::json params = {{"rope_type", plain ? "default" : scaling_.scaling}, {"rope_theta", theta}};
    if (!plain) params.update(scaling_parameters());
    nlohmann::json legacy = params;
    legacy.erase("rope_theta");
    out.set("rope_scaling", plain ? nlohmann::json(nullptr) : legacy, "model.rope.scaling");
    out.set("rope_parameters", params, "model.rope.scaling");
  }

 private:
  const ExecContext& exec_;
  // The keys of transformers' rope_parameters for the scaling (modeling_rope_utils).
  nlohmann::json scaling_parameters() const {
    const RopeConfig& r = scaling_;
    if (r.scaling == "linear") return {{"factor", r.factor}};
    if (r.scaling == "llama3")
      return {{"factor", r.factor},
              {"low_freq_factor", r.low_freq_factor},
              {"high_freq_factor", r.high_freq_factor},
              {"original_max_position_embeddings", r.original_max_seq_len}};
    // yarn: the attention factor as kiln resolved it, so no reader recomputes a default.
    return {{"factor", r.factor},
            {"original_max_position_embeddings", r.original_max_seq_len},
            {"beta_fast", r.beta_fast},
            {"beta_slow", r.beta_slow},
            {"attention_factor", static_cast<double>(frequencies_.attention_factor)},
            {"truncate", true}};
  }

  void export_gguf(ExportConfig& out, double theta, bool plain) const {
    out.set("rope.dimension_count", rotary_dims_, rotary_dims_ == head_dim_ ? "model.head_dim" : "model.rope.fraction");
    out.set("rope.freq_base", static_cast<float>(theta), "model.rope_theta");
    if (plain) return;
    // llama.cpp's gemma3 leaves its sliding layers unscaled (rope_freq_scale_train_swa),
    // which kiln's local RoPE would match, but that is not checked against llama.cpp yet.
    if (out.gemma())
      out.refuse("model.rope.scaling", "'" + scaling_.scaling + "'",
                 "kiln's gemma2/gemma3 GGUF export writes unscaled (or ntk) RoPE only (export hf)");
    if (scaling_.scaling != "linear")  // llama.cpp's yarn and rope_freqs are not checked against kiln's tables
      out.refuse("model.rope.scaling", "'" + scaling_.scaling + "'",
                 "kiln's GGUF export carries linear and ntk RoPE scaling only (yarn and llama3: export hf)");
    out.set("rope.scaling.type", "linear", "model.rope.scaling");
    out.set("rope.scaling.factor", static_cast<float>(scaling_.factor), "model.rope.factor");
  }

  void fill() {
    const float scale = frequencies_.attention_factor;
    if (cos_.device() == Device::cpu) {
      ops::rope_fill_tables(exec_, frequencies_.inv_freq, cos_, sin_, scale);
    } else {  // build on the host, copy once
      OwnedTensor hc(cos_.dtype(), Device::cpu, cos_.shape()), hs(sin_.dtype(), Device::cpu, sin_.shape());
      ops::rope_fill_tables(exec_, frequencies_.inv_freq, *hc, *hs, scale);
      copy_tensor(*hc, cos_);
      copy_tensor(*hs, sin_);
    }
    filled_ = true;
  }

  double theta_;
  int64_t head_dim_;
  int64_t rotary_dims_;  // R of the file comment: head_dim_ unless partial
  RopeConfig scaling_;
  RopeFrequencies frequencies_;
  Tensor cos_, sin_;  // [max_seq_len, head_dim / 2]
  bool filled_ = false;
};

class NoPositionEncoding final : public PositionEncoding {
 public:
  RotaryTables rotary() override { return {}; }
  void export_config(ExportConfig& out) const override {
    out.refuse("model.position", "'none'", "the stock families kiln exports use rotary embeddings");
  }
};

}  // namespace

void register_rope(PositionRegistry& registry) {
  registry.add("rope", "rotary embedding, rotate_half pairing (j, j + D/2), theta = model.rope_theta",
               [](BuildContext& ctx, const ModelConfig& m) { return std::make_unique<Rope>(ctx, m); });
  registry.add("none", "no position encoding (NoPE)",
               [](BuildContext&, const ModelConfig&) { return std::make_unique<NoPositionEncoding>(); });
}

}  // namespace kiln
