// The pointwise activations of the ungated MLPs and their derivatives, shared by the CPU
// reference and the CUDA kernels (T = float or double):
//   gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))  (GPT-2's "gelu_new")
//   relu2(x)     = max(x, 0)^2                                          (Primer / nanoGPT speedruns)
#pragma once

#include "ops/geglu/gelu_tanh.h"

namespace kiln::activation {

enum class Kind { gelu_tanh, relu2 };

template <typename T>
KILN_HOST_DEVICE inline T value(Kind kind, T x) {
  if (kind == Kind::gelu_tanh) return gelu::value(x);
  const T r = x > T(0) ? x : T(0);
  return r * r;
}

template <typename T>
KILN_HOST_DEVICE inline T derivative(Kind kind, T x) {
  if (kind == Kind::gelu_tanh) return gelu::derivative(x);
  return x > T(0) ? T(2) * x : T(0);
}

inline const char* name(Kind kind) { return kind == Kind::gelu_tanh ? "gelu_tanh" : "relu2"; }

}  // namespace kiln::activation
