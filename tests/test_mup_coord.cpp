// muP's coordinate check (Yang et al. 2022, section 7; docs/mup.md): the same tiny model at
// widths 64 to 1024, a few AdamW steps at one learning rate on one batch, then the RMS of
// each layer's residual stream and of the logits. Under muP (base width 64) every one stays
// within a band across widths; without it they grow with width (the updates of Adam move a
// width-W matrix's output ~ W times as far). CPU, fp32.
#include "grad_check.h"
#include "tiny_model.h"

#include "config/config.h"
#include "core/rng.h"
#include "nn/mup.h"
#include "train/optimizer_groups.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace kiln {
namespace {

constexpr int64_t kBase = 64, kLayers = 2, kTokens = 32, kVocab = 64, kSteps = 4;
constexpr double kLr = 1e-2;
const std::vector<int64_t> kWidths = {64, 128, 256, 512, 1024};

double rms(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s / static_cast<double>(v.size()));
}

// Per layer l = 1..L the residual stream after block l, then the logits: their RMS.
std::vector<double> coordinates(int64_t width, bool mup) {
  ModelConfig c;
  c.vocab_size = kVocab;
  c.hidden = width;
  c.layers = kLayers;
  c.head_dim = 32;
  c.heads = width / 32;  // the width grows by heads, as in the presets' families
  c.kv_heads = c.heads;
  c.ffn_hidden = 2 * width;
  c.max_seq_len = kTokens;
  c.tie_embeddings = false;
  c.mup_base_width = mup ? kBase : 0;
  BuildOptions o;
  o.dtype = DType::f32;
  o.max_tokens = kTokens;
  o.loss_chunk_rows = kTokens;
  Model m(c, o);
  OptimConfig oc;
  oc.weight_decay = 0;
  Arena state("optimizer", Device::cpu);
  auto optimizer = make_optimizer(m.exec(), oc, m.parameters(), mup_width_ratio(c));
  optimizer->plan(state);
  m.allocate();
  state.allocate();
  m.init_weights(7);
  // One document of random tokens, the same at every width.
  Rng rng(42);
  test::Doc doc;
  for (int64_t i = 0; i <= kTokens; ++i) doc.tokens.push_back(static_cast<int32_t>(rng.below(kVocab)));
  doc.targets.assign(doc.tokens.begin() + 1, doc.tokens.end());
  doc.tokens.pop_back();
  const HostBatch batch = test::pack_docs({doc});
  m.load_batch(batch);
  for (int64_t s = 0; s < kSteps; ++s) {
    m.zero_grads();
    m.forward_backward(1.0 / static_cast<double>(batch.target_count));
    optimizer->step(kLr);
  }
  std::vector<float> logits;
  m.logits(0, kTokens, logits);  // its forward leaves the residual stream of these weights
  std::vector<double> out;
  for (int64_t l = 1; l <= kLayers; ++l)
    out.push_back(rms(test::values_of(m.backbone().residual(l).rows(0, kTokens))));
  out.push_back(rms(std::vector<double>(logits.begin(), logits.end())));
  return out;
}

// For each coordinate, its values over kWidths (printed: docs/mup.md quotes them).
std::vector<std::vector<double>> sweep(bool mup) {
  std::vector<std::vector<double>> by_coord(kLayers + 1);
  for (int64_t w : kWidths) {
    const std::vector<double> c = coordinates(w, mup);
    std::printf("%s width %4lld:", mup ? "muP" : "SP ", static_cast<long long>(w));
    for (size_t i = 0; i < c.size(); ++i) {
      by_coord[i].push_back(c[i]);
      std::printf(" %s %.4f", i < static_cast<size_t>(kLayers) ? "residual" : "logits", c[i]);
    }
    std::printf("\n");
  }
  return by_coord;
}

// muP: every coordinate within a factor kBand over the widths (64 -> 1024 is 16x). Measured
// (docs/mup.md): at most 1.9x, the second block's residual, from width 64 (two heads) to 256.
constexpr double kBand = 2.0;
// Without muP each coordinate's largest value over the widths is at least kGrowth x its
// value at width 64. Measured: the residual stream ~1900-3500x, the logits 4.7x (the loss
// holds them back once they are large).
constexpr double kGrowth = 4.0;

TEST(MupCoordCheck, ActivationsStayInABandAcrossWidthsWithMup) {
  for (const std::vector<double>& v : sweep(true)) {
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    EXPECT_LT(*hi / *lo, kBand) << "muP: a coordinate moves by " << *hi / *lo << "x from width 64 to 1024";
  }
}

TEST(MupCoordCheck, ActivationsGrowWithWidthWithoutMup) {
  for (const std::vector<double>& v : sweep(false)) {
    const double growth = *std::max_element(v.begin(), v.end()) / v.front();
    EXPECT_GT(growth, kGrowth) << "standard parametrization: grows only " << growth << "x";
  }
}

}  // namespace
}  // namespace kiln
