// What a parameter is for, assigned by the component that reserves it: optimizers group
// parameters by role (train/optimizer_groups.h: each role's optimizer, learning rate,
// weight decay and betas come from [optim.<role>]), so no optimizer recognizes a tensor by
// its name or rank.
#pragma once

#include <array>
#include <string_view>

namespace kiln {

enum class ParamRole {
  embedding,  // the token embedding (and a head tied to it)
  head,       // an untied LM head
  matrix,     // a dense projection: attention q/k/v/o, MLP and shared-expert weights
  expert,     // one routed expert's matrix
  router,     // an MoE router's logit weights
  norm,       // norm gains and DyT's alpha
  bias,       // additive biases (attention, norms)
  state,      // model state not trained by gradients (a router's balancing bias):
              // no optimizer's
};

// The trained roles, each configured by its [optim.<role>] section.
inline constexpr std::array<ParamRole, 7> kTrainedRoles = {
    ParamRole::embedding, ParamRole::head, ParamRole::matrix, ParamRole::expert,
    ParamRole::router,    ParamRole::norm, ParamRole::bias};

// Its name in config sections and reports: "embedding", "head", ...
std::string_view role_name(ParamRole role);

}  // namespace kiln
