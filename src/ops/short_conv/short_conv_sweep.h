// The short convolution (ops/short_conv/short_conv.h) as one thread's sweep over a tile of
// consecutive tokens of one channel: the GPU's "sweep" kernels (short_conv_sweep_cuda.cu)
// run a thread per (channel, tile), and the CPU tests run the same functions over every
// (channel, tile) against the reference, so the indexing, the halos and the document
// boundaries are checked where CI runs.
//
// Why: the per-element kernels (kda_mixer_cuda.cu) give each (token, channel) a thread
// that binary-searches its document, divides 64-bit indices and recomputes the K
// pre-activations around it, K^2 loads a dx. A sweep keeps the last K inputs and the last K
// pre-activation gradients in registers, reads each input once (plus K - 1 halo rows a
// tile), finds its document once a tile, and sums dw's K taps for its tile in registers.
//
// The accessors carry the layout and the dtype: x(t), dy(t) return float, y(t, v), dx(t, v)
// store; w(j) is tap j. Rows before the start of a token's document read as zero.
#pragma once

#include "core/host_device.h"

#include <cmath>
#include <cstdint>

namespace kiln::short_conv_sweep {

inline constexpr int kMaxTaps = 8;  // window registers; short_conv's GPU limit

// The tile of `tiles` covering tokens [first, last) of n: equal lengths, the last shorter.
KILN_HOST_DEVICE inline int64_t tile_length(int64_t n, int64_t tiles) { return (n + tiles - 1) / tiles; }

// The document of token t, cu [seqs + 1] running 0..n: index d with cu[d] <= t < cu[d + 1]
// (empty documents skipped).
KILN_HOST_DEVICE inline int64_t document_of(const int32_t* cu, int64_t seqs, int64_t t) {
  int64_t lo = 0, hi = seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

KILN_HOST_DEVICE inline float sigmoid(float z) {
  return z >= 0.f ? 1.f / (1.f + expf(-z)) : expf(z) / (1.f + expf(z));
}

// The taps' window: slot j holds x[t - K + 1 + j] after push(x[t]).
struct Window {
  float v[kMaxTaps];
  KILN_HOST_DEVICE void clear() {
#pragma unroll
    for (int j = 0; j < kMaxTaps; ++j) v[j] = 0.f;
  }
  KILN_HOST_DEVICE void push(float x, int K) {
#pragma unroll
    for (int j = 0; j + 1 < kMaxTaps; ++j)
      if (j + 1 < K) v[j] = v[j + 1];
#pragma unroll
    for (int j = 0; j < kMaxTaps; ++j)
      if (j == K - 1) v[j] = x;
  }
};

// The window as token first - 1 left it (slot j: x[first - K + j]), so that push(x[first])
// completes first's taps: x[first - K + 1 .. first - 1] from its document.
template <typename X>
KILN_HOST_DEVICE void load_halo(Window& win, X x, int K, int64_t start, int64_t first) {
  win.clear();
  for (int j = 1; j < K; ++j) {
    const int64_t src = first - K + j;
    if (src >= start) win.v[j] = x(src);
  }
}

// z = sum_j w_j x[t - K + 1 + j], j ascending (the reference's order; rows outside the
// document are zeros in the window).
KILN_HOST_DEVICE inline float preactivation(const Window& win, const float* taps, int K) {
  float z = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxTaps; ++j)
    if (j < K) z += taps[j] * win.v[j];
  return z;
}

template <typename W>
KILN_HOST_DEVICE void load_taps(float* taps, W w, int K) {
#pragma unroll
  for (int j = 0; j < kMaxTaps; ++j) taps[j] = j < K ? w(j) : 0.f;
}

// y[t] = silu(z[t]) for t in [first, last).
template <typename X, typename W, typename Y>
KILN_HOST_DEVICE void forward(const int32_t* cu, int64_t seqs, int K, int64_t first, int64_t last, X x, W w, Y y) {
  if (first >= last) return;
  float taps[kMaxTaps];
  load_taps<W>(taps, w, K);
  int64_t d = document_of(cu, seqs, first);
  Window win;
  load_halo(win, x, K, cu[d], first);
  for (int64_t t = first; t < last; ++t) {
    if (t >= cu[d + 1]) {  // a new document: nothing before it is read
      while (t >= cu[d + 1]) ++d;
      win.clear();
    }
    win.push(x(t), K);
    const float z = preactivation(win, taps, K);
    y(t, z * sigmoid(z));
  }
}

// From dy over [first, last): dx (=) for the tile's tokens and dw_partial[j] (=) its
// tokens' dz[t] x[t - K + 1 + j]. dx[s] = sum_j w_j dz[s + K - 1 - j] reads dz up to K - 1
// tokens past the tile (the halo after it), within s's document; the sweep computes dz[t]
// in token order and finishes dx[t - K + 1] when dz[t] is known, or at a document's end
// with the tokens past it as zeros.
template <typename X, typename W, typename DY, typename DX>
KILN_HOST_DEVICE void backward(const int32_t* cu, int64_t seqs, int64_t n, int K, int64_t first, int64_t last, X x,
                               W w, DY dy, DX dx, float* dw_partial) {
#pragma unroll
  for (int j = 0; j < kMaxTaps; ++j) dw_partial[j] = 0.f;
  if (first >= last) return;
  float taps[kMaxTaps];
  load_taps<W>(taps, w, K);
  int64_t d = document_of(cu, seqs, first);
  int64_t start = cu[d];
  Window win, dz;  // inputs; dz of the last K tokens (slot K - 1 the newest)
  load_halo(win, x, K, start, first);
  dz.clear();
  // dx of token s = newest - K + 1 from the dz window, when s is the tile's and its document's.
  const auto finish = [&](int64_t newest) {
    const int64_t s = newest - K + 1;
    if (s < first || s >= last || s < start) return;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxTaps; ++i)
      if (i < K) sum += taps[K - 1 - i] * dz.v[i];
    dx(s, sum);
  };
  const int64_t stop = last + K - 1 < n ? last + K - 1 : n;
  for (int64_t t = first; t <= stop; ++t) {
    if (t == n || t >= cu[d + 1]) {
      // The document ends at t: its last K - 1 tokens' dx read zeros past it.
      for (int v = 1; v < K; ++v) {
        dz.push(0.f, K);
        finish(t - 1 + v);
      }
      if (t == n || t >= last) break;  // past the tile, a new document has nothing of ours left
      while (t >= cu[d + 1]) ++d;
      start = cu[d];
      win.clear();
      dz.clear();
    }
    if (t == stop) break;
    win.push(x(t), K);
    const float z = preactivation(win, taps, K);
    const float s = sigmoid(z);
    const float g = dy(t) * s * (1.f + z * (1.f - s));
    dz.push(g, K);
    finish(t);
    if (t < last) {
#pragma unroll
      for (int j = 0; j < kMaxTaps; ++j)
        if (j < K) dw_partial[j] += g * win.v[j];
    }
  }
}

}  // namespace kiln::short_conv_sweep
