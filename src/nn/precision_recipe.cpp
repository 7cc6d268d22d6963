#include "nn/precision_recipe.h"

#include "config/layer_pattern.h"
#include "core/device_choice.h"
#include "core/error.h"

namespace kiln {

std::string_view gemm_format_name(GemmFormat format) {
  switch (format) {
    case GemmFormat::f64: return "f64";
    case GemmFormat::f32: return "f32";
    case GemmFormat::bf16: return "bf16";
    case GemmFormat::fp8_tensorwise: return "fp8_tensorwise";
    case GemmFormat::fp8_blockwise: return "fp8_blockwise";
  }
  return "?";
}

PrecisionRecipe PrecisionRecipe::uniform(DType compute) {
  KILN_CHECK(compute == DType::f64 || compute == DType::f32 || compute == DType::bf16, "model",
             "no precision recipe computes in {}", dtype_name(compute));
  const GemmFormat format = compute == DType::bf16 ? GemmFormat::bf16
                            : compute == DType::f64 ? GemmFormat::f64
                                                    : GemmFormat::f32;
  PrecisionRecipe r;
  r.compute = compute;
  r.master = compute == DType::bf16 ? DType::f32 : compute;
  r.dense = r.expert = r.lm_head = r.router = format;
  return r;
}

std::string PrecisionRecipe::describe() const {
  std::string text = mixed() ? "bf16 mixed" : compute == DType::f64 ? "fp64" : "fp32";
  if (dense != uniform(compute).dense) text += ", " + std::string(gemm_format_name(dense)) + " GEMMs";
  if (is_fp8(dense) && fp8_layers != "all") text += " in blocks " + fp8_layers;
  if (expert != uniform(compute).expert) text += ", experts in " + std::string(gemm_format_name(expert));
  return text;
}

GemmFormat PrecisionRecipe::format(ParamRole role) const {
  switch (role) {
    case ParamRole::expert: return expert;
    case ParamRole::router: return router;
    case ParamRole::head:
    case ParamRole::embedding: return lm_head;
    default: return dense;
  }
}

PrecisionRecipe PrecisionRecipe::for_block(int64_t layer, int64_t layers) const {
  PrecisionRecipe r = *this;
  if (is_fp8(dense) && !parse_layer_set("train.fp8_layers", fp8_layers, layers)[static_cast<size_t>(layer)])
    r.dense = uniform(compute).dense;
  return r;
}

PrecisionRecipe resolve_precision_recipe(const std::string& setting, Device device) {
  KILN_CHECK(setting != "fp16", "train.precision",
             "'{}' is not built yet (auto, fp32, bf16, fp8_tensorwise and fp8_blockwise are)", setting);
  if (setting == "fp8_tensorwise" || setting == "fp8_blockwise") {
    // Transformer Engine's split: the attention, MLP and shared-expert projections in FP8;
    // the LM head, router and routed experts (not LinearLayers yet) and everything else in
    // the device's own precision (f32 on the CPU, bf16 mixed on the GPU).
    PrecisionRecipe r = PrecisionRecipe::uniform(device == Device::cpu ? DType::f32 : DType::bf16);
    r.dense = setting == "fp8_tensorwise" ? GemmFormat::fp8_tensorwise : GemmFormat::fp8_blockwise;
    return r;
  }
  return PrecisionRecipe::uniform(resolve_precision(setting, device));
}

}  // namespace kiln
