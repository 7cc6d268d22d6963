// What the FP8 linear layers' GPU tests share (test_gpu_fp8_linear.cpp,
// test_gpu_fp8_blockwise_linear.cpp): the GEMM bound a GPU result is held to against the
// CPU emulation (test_gpu_fp8_linear.cpp's file comment derives it), and a small training
// run in captured step graphs.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "gpu/bf16_tensors.h"
#include "gpu/gpu_harness.h"
#include "ops/linear/linear.h"
#include "gpu/training_run.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace kiln::gpu_test::fp8_linear {

// y [m, n] = A B^T with A read at a[i * a_row + p * a_col], B at b[j * b_row + p * b_col]:
// each element's sum_p |a_ip b_jp|, the GEMM bound's scale.
inline std::vector<double> abs_products(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col,
                                 const float* b, int64_t b_row, int64_t b_col) {
  std::vector<double> s(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t p = 0; p < k; ++p)
        s[i * n + j] += std::fabs(static_cast<double>(a[i * a_row + p * a_col]) * b[j * b_row + p * b_col]);
  return s;
}

inline void expect_within_bound(const Tensor& gpu_f32, const Tensor& cpu, const std::vector<double>& abs_sums, int64_t k,
                         bool bf16_output, const char* what) {
  const double gemm = 1.15 * ((std::min<int64_t>(k, 128) + 4) * std::ldexp(1.0, -14) + (k + 4) * std::ldexp(1.0, -24));
  int64_t outside = 0, first = -1;
  double worst = 0;
  for (int64_t i = 0; i < cpu.numel(); ++i) {
    const double ref = cpu.data<float>()[i], got = gpu_f32.data<float>()[i];
    const double bound = gemm * abs_sums[i] + (bf16_output ? std::ldexp(1.0, -8) : 0.0) * std::fabs(ref) +
                         std::ldexp(1.0, -24) * std::fabs(ref) + 1e-30;
    const double excess = std::fabs(got - ref) / bound;
    if (!(excess <= 1.0)) outside += 1, first = first < 0 ? i : first;
    worst = std::max(worst, excess);
  }
  EXPECT_EQ(outside, 0) << what << ": " << outside << " of " << cpu.numel() << " elements outside the bound (first at "
                        << first << "); worst |error| / bound " << worst;
}

// The tests/gpu/test_gpu_kda_mixer.cpp run's shape with gqa attention everywhere, every
// dimension a multiple of 16, in captured step graphs.
// `extra` overrides come after these (a blockwise run widens the model to whole 128-blocks).
inline TrainingRun train(const std::string& out, const std::string& precision,
                         const std::vector<std::string>& extra = {}) {
  std::vector<std::string> overrides = {
      "data.path=" + test::source_dir() + "/data/tinyshakespeare.txt", "train.out_dir=" + out, "train.device=cuda",
      "train.precision=" + precision, "train.cuda_graphs=true", "model.hidden=64", "model.layers=2", "model.heads=4",
      "model.kv_heads=2", "model.head_dim=16", "model.ffn_hidden=128", "model.max_seq_len=64",
      "train.micro_batch_tokens=256", "train.grad_accum=2", "train.steps=40", "train.eval_every=0",
      "train.eval_batches=1", "train.sample_every=0", "train.sample_tokens=0", "log.every=1",
      "checkpoint.save_final=false", "optim.warmup_steps=5"};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  return run_training(overrides, out);
}

// A run against its bf16 run (the same config, seed and data): both logged `steps` losses,
// the run used captured graphs and learned (last loss half a nat under the first), every
// loss is finite; returns the mean and the largest relative gap per step.
struct LossGaps {
  double mean = 0, most = 0;
};
inline LossGaps gaps_to_bf16(const TrainingRun& run, const TrainingRun& bf16, size_t steps) {
  LossGaps g;
  EXPECT_EQ(run.losses.size(), steps);
  EXPECT_EQ(bf16.losses.size(), run.losses.size());
  EXPECT_GT(run.graph_launches, 0);
  if (run.losses.size() != steps || bf16.losses.size() != steps) return {1e9, 1e9};
  EXPECT_LT(run.losses.back(), run.losses.front() - 0.5);
  for (size_t i = 0; i < steps; ++i) {
    EXPECT_TRUE(std::isfinite(run.losses[i])) << i;
    const double gap = std::fabs(run.losses[i] - bf16.losses[i]) / bf16.losses[i];
    g.most = std::max(g.most, gap), g.mean += gap / static_cast<double>(steps);
  }
  return g;
}

// A call the FP8 layer hands to the bf16 GEMM: `fp8_forward(x, w, y)` gives ops::linear's
// y bit for bit, for bf16 x [n, in] and w [out, in] drawn from `seed`.
template <typename Forward>
void expect_bf16_gemm_bit_for_bit(Forward&& fp8_forward, int64_t n, int64_t in, int64_t out, uint64_t seed) {
  const ExecContext exec;
  const OwnedTensor x = upload(*bf16_values(Shape{n, in}, seed, 1.0), DType::bf16);
  const OwnedTensor w = upload(*bf16_values(Shape{out, in}, seed + 1, 0.05), DType::bf16);
  const OwnedTensor y = poisoned(DType::bf16, Shape{n, out}), y_ref = poisoned(DType::bf16, Shape{n, out});
  fp8_forward(*x, *w, *y);
  ops::linear_forward(exec, *x, *w, Tensor(), *y_ref);
  const OwnedTensor got = to_host(*y), want = to_host(*y_ref);
  EXPECT_EQ(std::memcmp(got->raw(), want->raw(), got->nbytes()), 0);
}

}  // namespace kiln::gpu_test::fp8_linear
