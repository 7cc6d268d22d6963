// The tanh approximation of GELU and its derivative, for the CPU reference and the CUDA
// kernels alike (T = float or double; std::exp, whose float overload CUDA provides on the
// device as expf). With u = k (x + c x^3), t = tanh(u), k = sqrt(2 / pi), c = 0.044715:
//   gelu_tanh(x)  = 0.5 x (1 + t)
//   gelu_tanh'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2)
// computed through s = sigmoid(2u) = (1 + t) / 2, so value = x s and derivative =
// s + 2 x s (1 - s) k (1 + 3 c x^2): 1 + t cancels for negative x (t -> -1), which in fp32
// left the derivative off by 2e-6 absolute (3.7e-5 of the output's scale on an H200, past
// the f32 tolerance of 1e-5); s is formed without a difference.
#pragma once

#include "core/host_device.h"

#include <cmath>

namespace kiln::gelu {

inline constexpr double kSqrt2OverPi = 0.79788456080286535587989211986876;  // sqrt(2 / pi)
inline constexpr double kCubic = 0.044715;

// sigmoid(2u) of the inner polynomial u, shared by the value and the derivative.
template <typename T>
KILN_HOST_DEVICE inline T inner_sigmoid(T x) {
  using std::exp;
  const T u = static_cast<T>(kSqrt2OverPi) * (x + static_cast<T>(kCubic) * x * x * x);
  return T(1) / (T(1) + exp(T(-2) * u));  // exp overflowing to inf gives 0, as it should
}

template <typename T>
KILN_HOST_DEVICE inline T value(T x) {
  return x * inner_sigmoid(x);
}

template <typename T>
KILN_HOST_DEVICE inline T derivative(T x) {
  const T s = inner_sigmoid(x);
  const T du = static_cast<T>(kSqrt2OverPi) * (T(1) + T(3) * static_cast<T>(kCubic) * x * x);
  return s + T(2) * x * s * (T(1) - s) * du;
}

}  // namespace kiln::gelu
