#include "nn/modules.h"

#include "nn/moe/moe_mlp.h"

namespace kiln {

// Function-local statics: built on first use, with their built-ins registered, so no
// static-initialization order or linker-dropped registrar can lose an entry.
NormRegistry& norm_registry() {
  static NormRegistry* registry = [] {
    auto* r = new NormRegistry("norm");
    register_rms_norm(*r);
    register_layer_norm(*r);
    register_gemma_rms_norm(*r);
    register_dyt_norm(*r);
    return r;
  }();
  return *registry;
}

PositionRegistry& position_registry() {
  static PositionRegistry* registry = [] {
    auto* r = new PositionRegistry("position encoding");
    register_rope(*r);
    return r;
  }();
  return *registry;
}

MixerRegistry& mixer_registry() {
  static MixerRegistry* registry = [] {
    auto* r = new MixerRegistry("token mixer");
    register_gqa_attention(*r);
    register_kda_mixer(*r);
    register_mla_mixer(*r);
    return r;
  }();
  return *registry;
}

MlpRegistry& mlp_registry() {
  static MlpRegistry* registry = [] {
    auto* r = new MlpRegistry("mlp");
    register_swiglu_mlp(*r);
    register_geglu_mlp(*r);
    register_ungated_mlps(*r);
    register_moe_mlp(*r);
    return r;
  }();
  return *registry;
}

}  // namespace kiln
