// A loaded model's weights, checked before they are used (sample, serve, export, score):
// a diverged run's NaN/Inf weights, or a file of zeros (a sparse or never-written copy),
// would otherwise sample garbage or export a broken model without a word.
#pragma once

#include "model/model.h"

#include <string>

namespace kiln::io {

// Throws "[load] SOURCE: tensor 'NAME' holds N non-finite values (NaN/Inf) of M" for the
// first such tensor, and "[load] SOURCE: every weight matrix is zero ..." when all the
// model's matrices are zero (there is no model to use). A matrix that is zero while others
// are not is a warning naming it; zero vectors (biases) are normal and pass.
void check_weights_usable(const Model& model, const std::string& source);

}  // namespace kiln::io
