// A module a pipeline stage's model leaves out (BuildOptions::layers) still counts: the
// parameters it would declare shift the indices that initial values are drawn by
// (Model::init_weights), and the loss slots it would reserve (a router's) are part of the
// layout every stage's sums are added in. This builds it into a throwaway context -- its
// own arenas, parameter list and registries, planned and never allocated -- that shares
// only the loss context, and returns how many parameters it declared.
#pragma once

#include "nn/parameter.h"

#include <cstddef>
#include <functional>

namespace kiln {

size_t count_skipped_parameters(const BuildContext& ctx, const std::function<void(BuildContext&)>& build);

}  // namespace kiln
