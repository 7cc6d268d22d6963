// Position encodings: "rope" (rotary, rotate_half pairing, tables built once) and "none"
// (NoPE: attention sees no explicit positions). RoPE scalings plug in by registering a
// variant that computes different inverse frequencies.
#include "nn/modules.h"
#include "ops/rope/rope.h"

namespace kiln {

namespace {

class Rope final : public PositionEncoding {
 public:
  Rope(BuildContext& ctx, const ModelConfig& model) : theta_(model.rope_theta), head_dim_(model.head_dim) {
    inv_freq_ = ops::rope_inverse_frequencies(model.rope_theta, model.head_dim);
    // Tables are planned like any buffer and filled once, after allocation, on first use.
    ctx.buffer(cos_, Shape{model.max_seq_len, model.head_dim / 2}, ctx.master_dtype);
    ctx.buffer(sin_, Shape{model.max_seq_len, model.head_dim / 2}, ctx.master_dtype);
  }

  RotaryTables rotary() override {
    if (!filled_) fill();
    return {cos_, sin_};
  }

  // Plain RoPE, one theta, rotate_half pairing (llama.cpp's llama architecture pairs rows
  // interleaved: its exporter permutes the q/k rows the attention marks).
  void export_config(ExportConfig& out) const override {
    if (head_dim_ % 2 != 0) out.refuse("model.head_dim", std::to_string(head_dim_), "RoPE needs an even head_dim");
    if (out.format() == ExportConfig::Format::gguf) {
      out.set("rope.dimension_count", head_dim_, "model.head_dim");
      out.set("rope.freq_base", static_cast<float>(theta_), "model.rope_theta");
      return;
    }
    // transformers 4.x reads rope_theta (+ rope_scaling); 5.x reads rope_parameters.
    out.set("rope_theta", theta_, "model.rope_theta");
    out.set("rope_scaling", nullptr, "model.position");
    out.set("rope_parameters", {{"rope_type", "default"}, {"rope_theta", theta_}}, "model.rope_theta");
  }

 private:
  void fill() {
    if (cos_.device() == Device::cpu) {
      ops::rope_fill_tables(inv_freq_, cos_, sin_);
    } else {  // build on the host, copy once
      OwnedTensor hc(cos_.dtype(), Device::cpu, cos_.shape()), hs(sin_.dtype(), Device::cpu, sin_.shape());
      ops::rope_fill_tables(inv_freq_, *hc, *hs);
      copy_tensor(*hc, cos_);
      copy_tensor(*hs, sin_);
    }
    filled_ = true;
  }

  double theta_;
  int64_t head_dim_;
  std::vector<float> inv_freq_;
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
