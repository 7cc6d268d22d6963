// Scalar functions of the CPU references written so that neither tail overflows or loses
// its value: the sigmoid from whichever side keeps exp's argument <= 0, and softplus as
// max(x, 0) + log1p(exp(-|x|)). Shared by the KDA gate, its mixer's ops and the short
// convolution's SiLU.
#pragma once

#include <algorithm>
#include <cmath>

namespace kiln::cpu {

template <typename T>
T stable_sigmoid(T x) {
  return x >= 0 ? T(1) / (T(1) + std::exp(-x)) : std::exp(x) / (T(1) + std::exp(x));
}

// log(1 + e^x).
template <typename T>
T stable_softplus(T x) {
  return std::max(x, T(0)) + std::log1p(std::exp(-std::abs(x)));
}

}  // namespace kiln::cpu
