#include "nn/mup.h"

#include "config/config.h"
#include "core/error.h"

#include <cmath>

namespace kiln {

bool mup_enabled(const ModelConfig& m) { return m.mup_base_width > 0; }

double mup_width_ratio(const ModelConfig& m) {
  return mup_enabled(m) ? static_cast<double>(m.hidden) / static_cast<double>(m.mup_base_width) : 1.0;
}

double hidden_init_std(const ModelConfig& m) { return m.init_std / std::sqrt(mup_width_ratio(m)); }

double residual_init_std(const ModelConfig& m) {
  return hidden_init_std(m) / std::sqrt(2.0 * static_cast<double>(m.layers));
}

bool mup_scales_role(ParamRole role) {
  switch (role) {
    case ParamRole::matrix:
    case ParamRole::expert:
    case ParamRole::router:
    case ParamRole::head: return true;  // logits = head x hidden: its fan-in is the width too
    case ParamRole::embedding:
    case ParamRole::norm:
    case ParamRole::bias:
    case ParamRole::state: return false;
  }
  return false;
}

void check_mup(const ModelConfig& m) {
  KILN_CHECK(!(mup_enabled(m) && m.tie_embeddings), "config",
             "model.mup_base_width = {} zero-initializes the LM head, which model.tie_embeddings = true would "
             "make the embedding too: set model.tie_embeddings = false (or model.mup_base_width = 0)",
             m.mup_base_width);
}

}  // namespace kiln
