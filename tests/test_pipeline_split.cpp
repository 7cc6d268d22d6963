// The pipeline split planner (train/pipeline_split.h) against brute force over every split,
// memory limits, uneven layers, splits given by hand, and `kiln plan --pipeline-stages`.
#include "train/pipeline_split.h"

#include "core/error.h"
#include "model/model.h"
#include "test_util.h"
#include "train/pipeline_costs.h"
#include "train/training_build.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>

namespace kiln {
namespace {

// Every split's stage times and memories, summed layer by layer (not through the planner's
// prefix sums).
struct Candidate {
  PipelineSplit split;
  double max_time = 0, squares = 0, max_memory = 0;
};
std::vector<Candidate> every_split(const PipelineCosts& costs, int64_t stages) {
  const auto layers = static_cast<int64_t>(costs.layers.size());
  std::vector<Candidate> out;
  PipelineSplit split{0};
  std::function<void()> extend = [&] {
    if (static_cast<int64_t>(split.size()) == stages) {
      Candidate c{split};
      for (size_t s = 0; s < split.size(); ++s) {
        const int64_t end = s + 1 < split.size() ? split[s + 1] : layers;
        double time = 0, memory = 0;
        for (int64_t l = split[s]; l < end; ++l) {
          time += costs.layers[l].time;
          memory += costs.layers[l].memory;
        }
        if (s == 0) time += costs.first_extra.time, memory += costs.first_extra.memory;
        if (end == layers) time += costs.last_extra.time, memory += costs.last_extra.memory;
        c.max_time = std::max(c.max_time, time);
        c.max_memory = std::max(c.max_memory, memory);
        c.squares += time * time;
      }
      out.push_back(c);
      return;
    }
    const int64_t left = stages - static_cast<int64_t>(split.size());  // stages still to start
    for (int64_t first = split.back() + 1; first <= layers - left; ++first) {
      split.push_back(first);
      extend();
      split.pop_back();
    }
  };
  extend();
  return out;
}

PipelineCosts random_costs(std::mt19937& rng, int64_t layers) {
  std::uniform_real_distribution<double> time(0.1, 10.0), memory(1.0, 5.0);
  std::uniform_int_distribution<int> coarse(1, 4);  // small integers too: many exact ties
  PipelineCosts c;
  const bool ties = rng() % 2 == 0;
  for (int64_t l = 0; l < layers; ++l) c.layers.push_back({ties ? coarse(rng) * 1.0 : time(rng), memory(rng)});
  c.first_extra = {ties ? 0.0 : time(rng) / 4, memory(rng)};
  c.last_extra = {ties ? 1.0 : time(rng) / 2, memory(rng)};
  return c;
}

TEST(PipelineSplit, MatchesBruteForceOverEverySplit) {
  std::mt19937 rng(46);
  int cases = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t layers = 2 + static_cast<int64_t>(rng() % 9);  // 2..10
    const int64_t stages = 2 + static_cast<int64_t>(rng() % 3);  // 2..4
    if (stages > layers) continue;
    const PipelineCosts costs = random_costs(rng, layers);
    const std::vector<Candidate> all = every_split(costs, stages);
    // Without a limit, and with one between the leanest split's fullest stage and the most.
    double least_memory = INFINITY;
    for (const auto& c : all) least_memory = std::min(least_memory, c.max_memory);
    for (const double limit : {0.0, least_memory * 1.15}) {
      double best = INFINITY;
      for (const auto& c : all)
        if (limit == 0 || c.max_memory <= limit) best = std::min(best, c.max_time);
      double best_squares = INFINITY;
      for (const auto& c : all)
        if ((limit == 0 || c.max_memory <= limit) && c.max_time <= best * (1 + 1e-12))
          best_squares = std::min(best_squares, c.squares);
      const PipelineSplit split = plan_pipeline_split(costs, stages, limit);
      ASSERT_EQ(static_cast<int64_t>(split.size()), stages);
      const PipelineBalance b = pipeline_balance(costs, split);
      EXPECT_NEAR(b.max_time, best, 1e-9 * best) << "trial " << trial;
      double squares = 0;
      for (const auto& s : b.stages) squares += s.time * s.time;
      EXPECT_NEAR(squares, best_squares, 1e-9 * best_squares) << "trial " << trial;
      if (limit > 0) EXPECT_LE(b.max_memory, limit * (1 + 1e-12)) << "trial " << trial;
      EXPECT_EQ(plan_pipeline_split(costs, stages, limit), split);  // deterministic
      ++cases;
    }
  }
  EXPECT_GT(cases, 400);
}

TEST(PipelineSplit, BalanceReportsStagesAndEfficiency) {
  PipelineCosts c;
  for (double t : {1.0, 2.0, 3.0, 4.0}) c.layers.push_back({t, 10 * t});
  c.first_extra = {0.5, 100};
  c.last_extra = {1.5, 200};
  const PipelineBalance b = pipeline_balance(c, {0, 2, 3});
  ASSERT_EQ(b.stages.size(), 3u);
  EXPECT_EQ(b.stages[0].first, 0);
  EXPECT_EQ(b.stages[0].end, 2);
  EXPECT_DOUBLE_EQ(b.stages[0].time, 3.5);     // 1 + 2 + the embedding's 0.5
  EXPECT_DOUBLE_EQ(b.stages[0].memory, 130);
  EXPECT_DOUBLE_EQ(b.stages[1].time, 3.0);
  EXPECT_DOUBLE_EQ(b.stages[2].time, 5.5);     // 4 + the head's 1.5
  EXPECT_DOUBLE_EQ(b.stages[2].memory, 240);
  EXPECT_DOUBLE_EQ(b.max_time, 5.5);
  EXPECT_DOUBLE_EQ(b.efficiency, 4.0 / 5.5);   // mean 12 / 3
}

TEST(PipelineSplit, MemoryLimitIsKeptOrRefusedInOneLine) {
  PipelineCosts c;
  for (int l = 0; l < 8; ++l) c.layers.push_back({1.0, l < 4 ? 1.0 : 3.0});
  // Memory 1, 1, 1, 1, 3, 3, 3, 3: by time alone two stages of 4 layers (memory 4 and 12). Within
  // 8 no two-stage split fits (the second stage holds at least 9), three do: 3 layers a stage
  // at best by time (3, 3, 2), e.g. memory 3, 7, 6.
  EXPECT_EQ(plan_pipeline_split(c, 2), (PipelineSplit{0, 4}));
  const PipelineSplit three = plan_pipeline_split(c, 3, 8.0);
  const PipelineBalance b = pipeline_balance(c, three);
  EXPECT_LE(b.max_memory, 8.0);
  EXPECT_DOUBLE_EQ(b.max_time, 3.0);  // 3 + 3 + 2 at best by time with 8 layers
  try {
    plan_pipeline_split(c, 2, 8.0, "--pipeline-stages", "--stage-memory-gib");
    FAIL() << "a limit no split meets was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("[--stage-memory-gib] no split of 8 layers into 2 stages", 0), 0u) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  EXPECT_THROW(plan_pipeline_split(c, 9), Error);  // more stages than layers
}

// A stage keeping n micro-batches in flight keeps n copies of its layers' activations. Four
// layers of time 1 and memory 10, 5 of it activations; stage 0 keeps 4 in flight, stage 1 one:
// stage 0 with k layers needs 10k + 3 x 5k = 25k. Within 40 it holds one layer (by time alone,
// two: 50 would not fit); without in-flight counts two layers a stage fit (20 each).
TEST(PipelineSplit, InFlightMicroBatchesCountTheirActivations) {
  PipelineCosts c;
  for (int l = 0; l < 4; ++l) c.layers.push_back({1.0, 10.0, 5.0});
  EXPECT_EQ(plan_pipeline_split(c, 2, 40.0), (PipelineSplit{0, 2}));
  c.stage_in_flight = {4, 1};
  EXPECT_EQ(plan_pipeline_split(c, 2, 40.0), (PipelineSplit{0, 1}));
  const PipelineBalance b = pipeline_balance(c, {0, 2});
  EXPECT_DOUBLE_EQ(b.stages[0].memory, 50.0);
  EXPECT_EQ(b.stages[0].in_flight, 4);
  EXPECT_DOUBLE_EQ(b.stages[1].memory, 20.0);
  EXPECT_EQ(b.stages[1].in_flight, 1);
  EXPECT_DOUBLE_EQ(b.max_memory, 50.0);
  const std::string printed = describe_pipeline_balance(c, b);
  EXPECT_NE(printed.find("in flight"), std::string::npos) << printed;
  EXPECT_NE(printed.find("fullest stage 0.00 MiB"), std::string::npos) << printed;  // 50 bytes
}

// A hybrid where every 4th layer costs 3x (layers 3, 7, 11 of 12), and a head costing 2 on the
// last stage: 20 in all over 4 stages. Three layers a stage puts the head beside a heavy
// layer (3, 5, 5, 7); by cost the slowest stage takes 6 (the least: brute force), and no
// stage holds two heavy layers.
TEST(PipelineSplit, UnevenHybridLayersSplitByCostNotCount) {
  PipelineCosts c;
  for (int l = 0; l < 12; ++l) c.layers.push_back({l % 4 == 3 ? 3.0 : 1.0, 1.0});
  c.last_extra = {2.0, 0.0};
  const PipelineSplit split = plan_pipeline_split(c, 4);
  const PipelineBalance b = pipeline_balance(c, split);
  double best = INFINITY;
  for (const auto& cand : every_split(c, 4)) best = std::min(best, cand.max_time);
  EXPECT_DOUBLE_EQ(best, 6.0);
  EXPECT_DOUBLE_EQ(b.max_time, best);
  EXPECT_DOUBLE_EQ(pipeline_balance(c, {0, 3, 6, 9}).max_time, 7.0);
  for (const auto& s : b.stages) {
    int heavy = 0;
    for (int64_t l = s.first; l < s.end; ++l) heavy += l % 4 == 3;
    EXPECT_LE(heavy, 1) << s.first << ".." << s.end - 1;
  }
  EXPECT_NEAR(b.efficiency, 5.0 / 6.0, 1e-12);
}

TEST(PipelineSplit, GivenSplitIsValidatedInOneLineNamingTheKey) {
  const std::string key = "--pipeline-split";
  EXPECT_NO_THROW(validate_pipeline_split({0, 3, 6, 9}, 12, 4, key));
  const auto error = [&](const PipelineSplit& split, int64_t stages) {
    try {
      validate_pipeline_split(split, 12, stages, key);
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.rfind("[--pipeline-split] ", 0), 0u) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
      return what;
    }
    ADD_FAILURE() << "accepted";
    return std::string();
  };
  EXPECT_NE(error({1, 3, 6}, 0).find("starts at layer 1, not 0"), std::string::npos);
  EXPECT_NE(error({0, 6, 6}, 0).find("stage 2 starts at layer 6"), std::string::npos);   // empty stage
  EXPECT_NE(error({0, 8, 4}, 0).find("stage 2 starts at layer 4"), std::string::npos);   // out of order
  EXPECT_NE(error({0, 6, 12}, 0).find("the model has 12 layers"), std::string::npos);    // past the end
  EXPECT_NE(error({0, 6}, 4).find("2 first layers for 4 pipeline stages"), std::string::npos);
  EXPECT_NE(error({}, 0).find("empty"), std::string::npos);
  EXPECT_EQ(parse_pipeline_split("0,6,12", key), (PipelineSplit{0, 6, 12}));
  EXPECT_THROW(parse_pipeline_split("0,x", key), Error);
  EXPECT_THROW(parse_pipeline_split("0,-3", key), Error);
}

// Costs from the config: a dense layer's time by hand (default.toml: hidden 192, 6 q / 2 kv
// heads of 32, SwiGLU 512, context 256), every layer's the same; the layers' and the head's
// times add up to the model's own FLOPs count (the MFU one).
TEST(PipelineCosts, DenseLayersCostWhatTheyComputeAndAddUpToTheModel) {
  const Config config = load_config(KILN_SOURCE_DIR "/configs/default.toml", {"train.device=cpu"});
  const PipelineCosts costs = pipeline_costs_from_config(config, Device::cpu);
  ASSERT_EQ(costs.layers.size(), 4u);
  const double d = 192, q = 6 * 32, kv = 2 * 32, ffn = 512, seq = 256;
  const double matmul = d * q + 2 * d * kv + q * d + 3 * d * ffn;
  const double by_hand = 3 * (2 * matmul + 2 * q * seq);  // scores and values at an average context of seq / 2
  double sum = costs.last_extra.time + costs.first_extra.time;
  for (const LayerCost& layer : costs.layers) {
    EXPECT_DOUBLE_EQ(layer.time, by_hand);
    EXPECT_EQ(layer.memory, costs.layers[0].memory);
    // f32: at least the parameters and their gradients, 4 bytes each.
    EXPECT_GT(layer.memory, 8 * matmul);
    // Its saved activations: at least the residual-stream input [256 tokens, 192] in f32,
    // part of its memory.
    EXPECT_GE(layer.activations, 256 * d * 4);
    EXPECT_LT(layer.activations, layer.memory);
    sum += layer.time;
  }
  const Model model(config.model, training_build_options(config, Device::cpu));
  EXPECT_NEAR(sum, model.flops_per_token(256), 1e-9 * sum);
  EXPECT_GT(costs.last_extra.time, 0);  // the head's 6 x vocab x hidden
  EXPECT_GT(costs.first_extra.memory, 0);
}

// A hybrid: KDA on every 4th layer of 8, attention elsewhere. Layers of one kind cost the
// same, the two kinds differ.
TEST(PipelineCosts, HybridLayersGetUnevenCosts) {
  const Config config = load_config(KILN_SOURCE_DIR "/configs/default.toml",
                                    {"train.device=cpu", "model.layers=8", "model.alt_attention=kda",
                                     "model.alt_attention_layers=every:4"});
  const PipelineCosts costs = pipeline_costs_from_config(config, Device::cpu);
  ASSERT_EQ(costs.layers.size(), 8u);
  for (int l = 0; l < 8; ++l) {
    const int same = l % 4 == 3 ? 3 : 0;  // "every:4" is layers 3 and 7
    EXPECT_EQ(costs.layers[l].time, costs.layers[same].time) << l;
    EXPECT_EQ(costs.layer_kinds[l], costs.layer_kinds[same]) << l;
  }
  EXPECT_NE(costs.layers[0].time, costs.layers[3].time);
  EXPECT_NE(costs.layer_kinds[0], costs.layer_kinds[3]);
  EXPECT_EQ(costs.layer_kinds[3], "kda+swiglu");
  const Model model(config.model, training_build_options(config, Device::cpu));
  double sum = costs.first_extra.time + costs.last_extra.time;
  for (const LayerCost& layer : costs.layers) sum += layer.time;
  EXPECT_NEAR(sum, model.flops_per_token(256), 1e-9 * sum);
}

TEST(PipelineSplit, KilnPlanPrintsTheSplitOfAPreset) {
  std::string output;
  const std::string plan = test::kiln_binary() + " plan " KILN_SOURCE_DIR "/configs/bench-0.6b.toml";
  ASSERT_EQ(test::run_command(plan + " --pipeline-stages 4", &output), 0) << output;
  EXPECT_NE(output.find("pipeline split into 4 stages"), std::string::npos) << output;
  EXPECT_NE(output.find("predicted balance: slowest stage"), std::string::npos) << output;
  EXPECT_NE(output.find("in flight"), std::string::npos) << output;
  for (const char* row : {"\n  0     0..", "\n  3     "}) EXPECT_NE(output.find(row), std::string::npos) << output;
  // A given split: printed as given; a bad one: one line naming the flag.
  ASSERT_EQ(test::run_command(plan + " --pipeline-split 0,1", &output), 0) << output;
  EXPECT_NE(output.find("given by --pipeline-split"), std::string::npos) << output;
  ASSERT_NE(test::run_command(plan + " --pipeline-split 0,0", &output), 0) << output;
  EXPECT_NE(output.find("kiln: error: [--pipeline-split]"), std::string::npos) << output;
}

}  // namespace
}  // namespace kiln
