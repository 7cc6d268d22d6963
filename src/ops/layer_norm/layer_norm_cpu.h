// CPU reference of ops/layer_norm/layer_norm.h on raw arrays (T = float or double; every
// sum accumulates in T). Inputs are validated by the front end.
#pragma once

#include <cstdint>

namespace kiln::cpu {

// w, b null: no gain / no bias.
template <typename T>
void layer_norm_forward(const T* x, const T* w, const T* b, double eps, int64_t rows, int64_t cols, T* y, T* mean,
                        T* rstd);

// dw, db null: not computed.
template <typename T>
void layer_norm_backward(const T* x, const T* w, const T* mean, const T* rstd, const T* dy, int64_t rows, int64_t cols,
                         T* dx, T* dw, T* db, bool accumulate_dx);

}  // namespace kiln::cpu
