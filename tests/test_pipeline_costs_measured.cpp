// Per-layer costs measured at startup (train/pipeline_costs_measured.h, dist.pipeline_costs =
// "measure") on tiny CPU models: every layer timed, one time per layer kind, an MoE kind
// timed apart from the dense one, memory the estimate's; `kiln plan` printing a split from
// them; the key's bad values refused naming it.
#include "train/pipeline_costs_measured.h"

#include "core/error.h"
#include "test_util.h"
#include "train/pipeline_costs.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace kiln {
namespace {

// 4 layers of width 64 over micro-batches of 256 tokens: each measurement takes
// milliseconds.
const std::vector<std::string> kTiny = {"train.device=cpu",      "model.layers=4",     "model.hidden=64",
                                        "model.heads=4",         "model.kv_heads=2",   "model.head_dim=16",
                                        "model.ffn_hidden=64",   "model.max_seq_len=128",
                                        "train.micro_batch_tokens=256"};

Config tiny(std::vector<std::string> more = {}) {
  std::vector<std::string> overrides = kTiny;
  overrides.insert(overrides.end(), more.begin(), more.end());
  return load_config(KILN_SOURCE_DIR "/configs/default.toml", overrides);
}

std::string error_of(const std::function<void()>& run) {
  try {
    run();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(PipelineCostsMeasured, EveryLayerAndExtraIsTimedAndMemoryIsTheEstimates) {
  const Config config = tiny();
  const PipelineCosts measured = pipeline_costs_measured(config, Device::cpu);
  const PipelineCosts estimated = pipeline_costs_from_config(config, Device::cpu);
  EXPECT_TRUE(measured.measured);
  EXPECT_EQ(measured.measured_on, "cpu");
  EXPECT_FALSE(estimated.measured);
  ASSERT_EQ(measured.layers.size(), 4u);
  EXPECT_EQ(measured.layer_kinds, estimated.layer_kinds);
  for (size_t l = 0; l < measured.layers.size(); ++l) {
    EXPECT_GT(measured.layers[l].time, 0) << l;
    // Milliseconds per micro-batch, not FLOPs: a tiny layer's step is far below a second.
    EXPECT_LT(measured.layers[l].time, 1000) << l;
    EXPECT_EQ(measured.layers[l].time, measured.layers[0].time) << l;  // one kind, one time
    EXPECT_EQ(measured.layers[l].memory, estimated.layers[l].memory) << l;
  }
  EXPECT_GT(measured.first_extra.time + measured.last_extra.time, 0);
  EXPECT_GT(measured.last_extra.time, 0);  // the head over a 259-token vocabulary and its loss
  EXPECT_EQ(measured.first_extra.memory, estimated.first_extra.memory);
  EXPECT_EQ(measured.last_extra.memory, estimated.last_extra.memory);
}

// Dense SwiGLU of width 64 on layers 0 and 2, MoE (8 experts of width 512, 4 per token) on
// layers 1 and 3: the two kinds get their own times, the MoE's the larger by far.
TEST(PipelineCostsMeasured, AnMoeKindIsTimedApartFromTheDenseOne) {
  const Config config = tiny({"model.alt_mlp=moe", "model.alt_mlp_layers=every:2", "model.moe.experts=8",
                              "model.moe.top_k=4", "model.moe.expert_hidden=512"});
  const PipelineCosts costs = pipeline_costs_measured(config, Device::cpu);
  ASSERT_EQ(costs.layers.size(), 4u);
  EXPECT_EQ(costs.layer_kinds[0], costs.layer_kinds[2]);
  EXPECT_EQ(costs.layer_kinds[1], costs.layer_kinds[3]);
  ASSERT_NE(costs.layer_kinds[0], costs.layer_kinds[1]);
  EXPECT_EQ(costs.layers[0].time, costs.layers[2].time);
  EXPECT_EQ(costs.layers[1].time, costs.layers[3].time);
  EXPECT_GT(costs.layers[1].time, costs.layers[0].time);
  // The split is planned from them and printed in their unit.
  const PipelineSplit split = plan_pipeline_split(costs, 2);
  ASSERT_EQ(split.size(), 2u);
  const std::string text = describe_pipeline_balance(costs, pipeline_balance(costs, split));
  EXPECT_NE(text.find("time: measured ms per micro-batch on cpu"), std::string::npos) << text;
  EXPECT_NE(text.find("ms per micro-batch, mean"), std::string::npos) << text;
  EXPECT_EQ(text.find("GFLOP"), std::string::npos) << text;
}

TEST(PipelineCostsMeasured, TheKeyChoosesTheSourceAndRefusesOtherValuesNamingIt) {
  EXPECT_FALSE(pipeline_costs_for(tiny(), Device::cpu).measured);
  EXPECT_TRUE(pipeline_costs_for(tiny({"dist.pipeline_costs=measure"}), Device::cpu).measured);
  const std::string e = error_of([] { tiny({"dist.pipeline_costs=guess"}); });
  EXPECT_NE(e.find("dist.pipeline_costs"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  // A config built in code, past the validator, is refused where the costs are chosen.
  Config c = tiny();
  c.dist.pipeline_costs = "guess";
  const std::string e2 = error_of([&] { pipeline_costs_for(c, Device::cpu); });
  EXPECT_NE(e2.find("[dist.pipeline_costs]"), std::string::npos) << e2;
}

TEST(PipelineCostsMeasured, KilnPlanPrintsASplitFromMeasuredCosts) {
  std::string sets;
  for (const std::string& s : kTiny) sets += " --set " + s;
  const std::string plan =
      test::kiln_binary() + " plan " KILN_SOURCE_DIR "/configs/default.toml --pipeline-stages 2" + sets;
  std::string output;
  ASSERT_EQ(test::run_command(plan + " --set dist.pipeline_costs=measure", &output), 0) << output;
  EXPECT_NE(output.find("pipeline split into 2 stages (chosen: the least slowest stage; layer times measured"),
            std::string::npos)
      << output;
  EXPECT_NE(output.find("time: measured ms per micro-batch on cpu"), std::string::npos) << output;
  EXPECT_NE(output.find("predicted balance: slowest stage"), std::string::npos) << output;
  // The default: estimated, and saying so.
  ASSERT_EQ(test::run_command(plan, &output), 0) << output;
  EXPECT_NE(output.find("time: estimated GFLOP per token"), std::string::npos) << output;
  ASSERT_NE(test::run_command(plan + " --set dist.pipeline_costs=guess", &output), 0) << output;
  EXPECT_NE(output.find("dist.pipeline_costs"), std::string::npos) << output;
}

}  // namespace
}  // namespace kiln
