// Activation recompute (train.recompute_blocks): the recomputed blocks keep only their
// input and run their forward again in backward, so loss and every gradient must equal
// the run that keeps everything, bit for bit; the planned activation memory must shrink;
// a block count beyond the model is refused with the key's name.
#include "grad_check.h"
#include "tiny_model.h"

#include <gtest/gtest.h>

#include <cstring>

namespace kiln {
namespace {

using namespace kiln::test;

struct StepResult {
  LossSums sums;
  std::vector<std::vector<double>> grads;
  size_t activation_bytes = 0;
};

// dropout: the recomputed forward must draw the masks the first forward drew.
StepResult one_step(int64_t recompute_blocks, bool qk_norm, bool tie, double dropout = 0) {
  BuildOptions options = tiny_build(24, 7, 1e-3);
  options.recompute_blocks = recompute_blocks;
  ModelConfig config = tiny_config(qk_norm, tie);
  config.dropout = dropout;
  Model model(config, options);
  model.allocate();
  init_tiny_model(model, 33);
  HostBatch batch = pack_docs(three_docs(), 4);
  batch.dropout_key = 91;
  StepResult r;
  r.activation_bytes = model.memory_plan().activations;
  // Two micro-batches accumulate into the gradients, as grad_accum does.
  model.zero_grads();
  for (int micro = 0; micro < 2; ++micro) {
    model.load_batch(batch);
    const LossSums s = model.forward_backward(1.0 / static_cast<double>(batch.target_count));
    r.sums.loss += s.loss, r.sums.z += s.z, r.sums.count += s.count;
  }
  for (const auto& p : model.parameters()) r.grads.push_back(values_of(p->grad()));
  return r;
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

TEST(Recompute, SameLossAndGradientsToTheBitWithLessMemory) {
  for (bool qk_norm : {false, true}) {
    for (bool tie : {false, true}) {
      for (double dropout : {0.0, 0.25}) {
        SCOPED_TRACE(::testing::Message() << "qk_norm " << qk_norm << ", tied " << tie << ", dropout " << dropout);
        const StepResult kept = one_step(0, qk_norm, tie, dropout);
        size_t previous_bytes = kept.activation_bytes;
        for (int64_t blocks : {1, 2}) {  // the tiny model has 2 layers
          SCOPED_TRACE(::testing::Message() << "recompute_blocks " << blocks);
          const StepResult recomputed = one_step(blocks, qk_norm, tie, dropout);
          EXPECT_EQ(std::memcmp(&kept.sums.loss, &recomputed.sums.loss, sizeof(double)), 0)
              << kept.sums.loss << " vs " << recomputed.sums.loss;
          EXPECT_EQ(kept.sums.count, recomputed.sums.count);
          ASSERT_EQ(kept.grads.size(), recomputed.grads.size());
          for (size_t i = 0; i < kept.grads.size(); ++i)
            EXPECT_TRUE(same_bits(kept.grads[i], recomputed.grads[i])) << i;
          // One block's activations are shared by all recomputed blocks: 1 block saves
          // nothing (its region is still one block), 2 blocks save one block's worth.
          EXPECT_LE(recomputed.activation_bytes, previous_bytes);
          previous_bytes = recomputed.activation_bytes;
        }
        EXPECT_LT(previous_bytes, kept.activation_bytes);
      }
    }
  }
}

// Sparse layers keep statistics across a step's micro-batches (expert load, the balancing
// bias's input) and objectives of their own (aux and z losses): recomputing their blocks
// counts neither twice, and the statistics live outside the region recomputed blocks share.
TEST(Recompute, SparseLayersGiveTheSameLossesGradientsLoadAndBias) {
  struct Sparse {
    std::vector<std::vector<double>> grads, after;  // gradients; parameters and state after the step
    std::vector<std::pair<std::string, double>> load;
  };
  auto run = [](int64_t recompute_blocks) {
    ModelConfig c = tiny_config(true, false);
    c.mlp = "moe";
    c.moe.experts = 4, c.moe.top_k = 2, c.moe.expert_hidden = 6;
    c.moe.router = "sigmoid_bias";
    c.moe.aux_loss = 1e-2, c.moe.z_loss = 1e-3;
    BuildOptions options = tiny_build(24, 7, 1e-3);
    options.recompute_blocks = recompute_blocks;
    Model model(c, options);
    model.allocate();
    init_tiny_model(model, 33);
    const HostBatch batch = pack_docs(three_docs(), 4);
    model.zero_grads();
    for (int micro = 0; micro < 2; ++micro) {
      model.load_batch(batch);
      model.forward_backward(1.0 / static_cast<double>(batch.target_count));
    }
    model.after_step(true);  // the bias moves by the step's load
    Sparse r;
    for (const auto& p : model.parameters()) {
      if (p->trainable()) r.grads.push_back(values_of(p->grad()));
      r.after.push_back(values_of(p->value()));
    }
    r.load = model.component_metrics();
    return r;
  };
  const Sparse kept = run(0);
  ASSERT_FALSE(kept.load.empty());
  for (int64_t blocks : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << "recompute_blocks " << blocks);
    const Sparse recomputed = run(blocks);
    ASSERT_EQ(kept.grads.size(), recomputed.grads.size());
    for (size_t i = 0; i < kept.grads.size(); ++i) EXPECT_TRUE(same_bits(kept.grads[i], recomputed.grads[i])) << i;
    for (size_t i = 0; i < kept.after.size(); ++i) EXPECT_TRUE(same_bits(kept.after[i], recomputed.after[i])) << i;
    EXPECT_EQ(kept.load, recomputed.load);
  }
}

TEST(Recompute, MoreBlocksThanLayersIsRefusedByName) {
  BuildOptions options = tiny_build();
  options.recompute_blocks = 3;
  try {
    Model model(tiny_config(true, false), options);
    FAIL() << "a model of 2 layers accepted recompute_blocks = 3";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.recompute_blocks"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln
