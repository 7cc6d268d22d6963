// The tanh approximation of GELU and its derivative, for the CPU reference and the CUDA
// kernels alike (T = float or double; std::tanh, whose float overload CUDA provides on the
// device as tanhf). With u = k (x + c x^3), t = tanh(u), k = sqrt(2 / pi), c = 0.044715:
//   gelu_tanh(x)  = 0.5 x (1 + t)
//   gelu_tanh'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2)
#pragma once

#ifdef __CUDACC__
#define KILN_HOST_DEVICE __host__ __device__
#else
#define KILN_HOST_DEVICE
#endif

#include <cmath>

namespace kiln::gelu {

inline constexpr double kSqrt2OverPi = 0.79788456080286535587989211986876;  // sqrt(2 / pi)
inline constexpr double kCubic = 0.044715;

// tanh of the inner polynomial, shared by the value and the derivative.
template <typename T>
KILN_HOST_DEVICE inline T inner_tanh(T x) {
  using std::tanh;
  return tanh(static_cast<T>(kSqrt2OverPi) * (x + static_cast<T>(kCubic) * x * x * x));
}

template <typename T>
KILN_HOST_DEVICE inline T value(T x) {
  const T t = inner_tanh(x);
  return T(0.5) * x * (T(1) + t);
}

template <typename T>
KILN_HOST_DEVICE inline T derivative(T x) {
  const T t = inner_tanh(x);
  const T du = static_cast<T>(kSqrt2OverPi) * (T(1) + T(3) * static_cast<T>(kCubic) * x * x);
  return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * du;
}

}  // namespace kiln::gelu
