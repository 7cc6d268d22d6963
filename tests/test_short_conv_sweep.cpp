// The short convolution's sweep (ops/short_conv/short_conv_sweep.h), the body of its
// "sweep" CUDA kernels, run here over every (channel, tile) as the GPU's threads run it,
// against the CPU reference (ops/short_conv) in f64: y, dx and dw (the tiles' partial sums
// added in tile order), with documents that are empty, shorter than the kernel and that
// end on tile edges, and tiles shorter than the kernel's halo.
#include "grad_check.h"
#include "ops/short_conv/short_conv.h"
#include "ops/short_conv/short_conv_sweep.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace kiln {
namespace {

using namespace kiln::test;
namespace sweep = short_conv_sweep;

struct SweepRun {
  std::vector<double> y, dx, dw;
};

// Every (channel, tile) of `tile` tokens, as the kernels' blocks run them.
SweepRun run_sweep(const std::vector<int32_t>& cu, int64_t ch, int K, int64_t tile, const std::vector<double>& x,
                   const std::vector<double>& w, const std::vector<double>& dy) {
  const int64_t n = cu.back(), seqs = static_cast<int64_t>(cu.size()) - 1;
  const int64_t tiles = (n + tile - 1) / tile;
  SweepRun out{std::vector<double>(n * ch, NAN), std::vector<double>(n * ch, NAN), std::vector<double>(ch * K, 0.0)};
  for (int64_t c = 0; c < ch; ++c) {
    const auto xs = [&](int64_t t) { return static_cast<float>(x[t * ch + c]); };
    const auto ws = [&](int j) { return static_cast<float>(w[c * K + j]); };
    const auto dys = [&](int64_t t) { return static_cast<float>(dy[t * ch + c]); };
    for (int64_t b = 0; b < tiles; ++b) {
      const int64_t first = b * tile, last = std::min(n, first + tile);
      sweep::forward(cu.data(), seqs, K, first, last, xs, ws, [&](int64_t t, float v) { out.y[t * ch + c] = v; });
      float partial[sweep::kMaxTaps];
      sweep::backward(cu.data(), seqs, n, K, first, last, xs, ws, dys,
                      [&](int64_t t, float v) { out.dx[t * ch + c] = v; }, partial);
      for (int j = 0; j < K; ++j) out.dw[c * K + j] += partial[j];
    }
  }
  return out;
}

void expect_close(const char* what, const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << what << "[" << i << "] never written";
    EXPECT_NEAR(got[i], want[i], 2e-5 * (1 + std::abs(want[i]))) << what << "[" << i << "]";
  }
}

TEST(ShortConvSweep, EveryTileMatchesTheReference) {
  // Documents of 1, 63, 0, 65, 7, 2 and 1 tokens: boundaries at 64 and 129 meet tiles of 64
  // and 1..3 edges; the 2- and 1-token documents are shorter than the kernel.
  const std::vector<int32_t> cu{0, 1, 64, 64, 129, 136, 138, 139};
  const int64_t n = cu.back(), ch = 5;
  OwnedTensor cu_t = i32_tensor(cu), x = random_f64(Shape{n, ch}, 31), dy = random_f64(Shape{n, ch}, 33);
  for (int K : {4, 2, 1, 3, 8}) {
    OwnedTensor w = random_f64(Shape{ch, K}, 32, 0.5);
    OwnedTensor y = nan_f64(Shape{n, ch}), dx = nan_f64(Shape{n, ch}), dw = filled_f64(Shape{ch, K}, 0.0);
    ops::short_conv_forward(process_exec(), *x, *w, *cu_t, *y);
    ops::short_conv_backward(process_exec(), *x, *w, *cu_t, *dy, *dx, *dw);
    for (int64_t tile : {1, 2, 3, 7, 32, 64, 200}) {
      SCOPED_TRACE(::testing::Message() << "kernel " << K << ", tile " << tile);
      const SweepRun got = run_sweep(cu, ch, K, tile, values_of(*x), values_of(*w), values_of(*dy));
      expect_close("y", got.y, values_of(*y));
      expect_close("dx", got.dx, values_of(*dx));
      expect_close("dw", got.dw, values_of(*dw));
    }
  }
}

// One document over the whole batch, and tiles that do not divide it.
TEST(ShortConvSweep, OneLongDocument) {
  const std::vector<int32_t> cu{0, 301};
  const int64_t n = cu.back(), ch = 3;
  const int K = 4;
  OwnedTensor cu_t = i32_tensor(cu), x = random_f64(Shape{n, ch}, 41), dy = random_f64(Shape{n, ch}, 43);
  OwnedTensor w = random_f64(Shape{ch, K}, 42, 0.5);
  OwnedTensor y = nan_f64(Shape{n, ch}), dx = nan_f64(Shape{n, ch}), dw = filled_f64(Shape{ch, K}, 0.0);
  ops::short_conv_forward(process_exec(), *x, *w, *cu_t, *y);
  ops::short_conv_backward(process_exec(), *x, *w, *cu_t, *dy, *dx, *dw);
  for (int64_t tile : {sweep::tile_length(n, 7), int64_t{64}, int64_t{5}}) {
    SCOPED_TRACE(::testing::Message() << "tile " << tile);
    const SweepRun got = run_sweep(cu, ch, K, tile, values_of(*x), values_of(*w), values_of(*dy));
    expect_close("y", got.y, values_of(*y));
    expect_close("dx", got.dx, values_of(*dx));
    expect_close("dw", got.dw, values_of(*dw));
  }
}

TEST(ShortConvSweep, FindsEachTokensDocumentPastEmptyOnes) {
  const std::vector<int32_t> cu{0, 1, 64, 64, 64, 129};
  EXPECT_EQ(sweep::document_of(cu.data(), 5, 0), 0);
  EXPECT_EQ(sweep::document_of(cu.data(), 5, 1), 1);
  EXPECT_EQ(sweep::document_of(cu.data(), 5, 63), 1);
  EXPECT_EQ(sweep::document_of(cu.data(), 5, 64), 4);  // 2 and 3 are empty
  EXPECT_EQ(sweep::document_of(cu.data(), 5, 128), 4);
}

}  // namespace
}  // namespace kiln
