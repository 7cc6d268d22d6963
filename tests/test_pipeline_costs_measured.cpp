// Per-layer costs measured at startup (train/pipeline_costs_measured.h, dist.pipeline_costs =
// "measure") on tiny CPU models: every layer timed, one time per layer kind, an MoE kind
// timed apart from the dense one; every layer's memory what the model allocates for it
// (dense, MoE and KDA:GQA hybrid models, against counts made another way), the split planned
// from it within a memory limit; `kiln plan` printing a split from them; the key's bad
// values refused naming it.
#include "train/pipeline_costs_measured.h"

#include "core/device_memory.h"
#include "core/error.h"
#include "model/model.h"
#include "test_util.h"
#include "train/memory_check.h"
#include "train/pipeline_costs.h"
#include "train/training_build.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
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

TEST(PipelineCostsMeasured, EveryLayerAndExtraIsTimed) {
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
  }
  EXPECT_GT(measured.first_extra.time + measured.last_extra.time, 0);
  EXPECT_GT(measured.last_extra.time, 0);  // the head over a 259-token vocabulary and its loss
}

// Memory counted another way than through the arenas' offsets: from each layer's parameters
// (the ones named "layers.<l>."; element counts x their dtype's bytes, each tensor at most
// one alignment of padding above it) with AdamW's two fp32 moments per trainable element, and
// from the activation frames a pipeline stage allocates (a frame of layer l's segment less a
// frame of the model's own state alone).
void expect_memory_is_the_models(const Config& config) {
  ASSERT_EQ(config.optim.name, "adamw");
  const PipelineCosts measured = pipeline_costs_measured(config, Device::cpu);
  const PipelineCosts estimated = pipeline_costs_from_config(config, Device::cpu);
  const int64_t layers = config.model.layers;
  ASSERT_EQ(measured.layers.size(), static_cast<size_t>(layers));
  const BuildOptions options = training_build_options(config, Device::cpu);
  const auto framed_model = [&](const std::vector<std::pair<int64_t, int64_t>>& framed) {
    auto model = std::make_unique<Model>(config.model, options);
    model->allocate();
    model->enable_activation_frames(2, framed);
    return model;
  };
  const size_t own_state = framed_model({})->activation_frame_bytes();
  const MemoryBudget whole = plan_training_memory(config, Device::cpu);
  const Model model(config.model, options);
  ASSERT_FALSE(options.dtype == DType::bf16);  // the CPU's f32: no compute copies
  const PipelineMemory memory = measure_pipeline_memory(config, model);
  double sum = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const LayerCost& cost = measured.layers[static_cast<size_t>(l)];
    const PipelineMemory::Layer& layer = memory.layers[static_cast<size_t>(l)];
    const std::string prefix = "layers." + std::to_string(l) + ".";
    size_t values = 0, grads = 0, tensors = 0, trainable = 0;
    for (const auto& p : model.parameters()) {
      if (!p->name().starts_with(prefix)) continue;
      const auto n = static_cast<size_t>(p->shape().numel());
      values += n * dtype_size(p->value().dtype());
      ++tensors;
      if (!p->trainable()) continue;
      grads += n * dtype_size(p->grad().dtype());
      trainable += n;
    }
    ASSERT_GT(tensors, 0u) << l;
    const size_t slack = tensors * kAlignment;  // each tensor's padding is below one alignment
    EXPECT_GE(layer.parameters, values) << l;
    EXPECT_LT(layer.parameters, values + slack) << l;
    EXPECT_GE(layer.gradients, grads) << l;
    EXPECT_LT(layer.gradients, grads + slack) << l;
    EXPECT_GE(layer.optimizer, 8 * trainable) << l;  // exp_avg and exp_avg_sq, f32
    EXPECT_LT(layer.optimizer, 8 * trainable + 2 * slack) << l;
    // One micro-batch's saved state: what a stage's activation frame of this layer holds.
    const size_t frame = framed_model({{l, l + 1}})->activation_frame_bytes() - own_state;
    EXPECT_EQ(layer.activations, frame) << l;
    EXPECT_GE(layer.activations, static_cast<size_t>(options.max_tokens * config.model.hidden) * 4) << l;  // its input row
    // The costs carry them.
    EXPECT_EQ(cost.memory, static_cast<double>(layer.total())) << l;
    EXPECT_EQ(cost.activations, static_cast<double>(layer.activations)) << l;
    // The estimate plans the block alone as the model plans it: everything but the
    // optimizer state, which it spreads by parameter count, agrees.
    double parameters = 0;
    for (size_t i = 0; i < model.parameters().size(); ++i)
      if (model.parameters()[i]->name().starts_with(prefix))
        parameters += static_cast<double>(model.parameters()[i]->shape().numel());
    const double spread = static_cast<double>(whole.optimizer) / static_cast<double>(model.parameter_count()) * parameters;
    EXPECT_NEAR(estimated.layers[static_cast<size_t>(l)].memory - spread,
                static_cast<double>(layer.total() - layer.optimizer), 1e-9 * cost.memory)
        << l;
    EXPECT_EQ(cost.activations, estimated.layers[static_cast<size_t>(l)].activations) << l;
    sum += cost.memory;
  }
  // The embedding's table, gradient and moments (f32), padded to an alignment each.
  const double table = static_cast<double>(config.model.vocab_size * config.model.hidden);
  EXPECT_GE(measured.first_extra.memory, 16 * table);
  EXPECT_LT(measured.first_extra.memory, 16 * table + 4 * kAlignment);
  // Layers, embedding and the rest add up to the memory check's plan (its workspace and
  // host batches aside); a tied head counts the table again.
  const auto planned = static_cast<double>(whole.parameters + whole.gradients + whole.optimizer + whole.activations);
  EXPECT_EQ(static_cast<double>(memory.whole), planned);
  const double tied = config.model.tie_embeddings ? measured.first_extra.memory : 0.0;
  EXPECT_EQ(sum + measured.first_extra.memory + measured.last_extra.memory - tied, planned);
}

TEST(PipelineCostsMeasured, DenseLayersMemoryIsWhatTheModelAllocates) {
  expect_memory_is_the_models(tiny());
}

// MoE (8 experts of width 512, 2 per token) on layers 1 and 3, SwiGLU of width 64 on 0 and 2:
// an MoE layer's MLP has 64 times the dense one's parameters, and what it saves of its
// routed tokens makes its activations larger too.
TEST(PipelineCostsMeasured, MoeLayersMemoryIsWhatTheModelAllocates) {
  const Config config = tiny({"model.alt_mlp=moe", "model.alt_mlp_layers=every:2", "model.moe.experts=8",
                              "model.moe.top_k=2", "model.moe.expert_hidden=512"});
  expect_memory_is_the_models(config);
  const PipelineCosts costs = pipeline_costs_measured(config, Device::cpu);
  EXPECT_GT(costs.layers[1].memory, 4 * costs.layers[0].memory);
  EXPECT_GT(costs.layers[1].activations, costs.layers[0].activations);
  EXPECT_EQ(costs.layers[1].memory, costs.layers[3].memory);
  EXPECT_EQ(costs.layers[0].memory, costs.layers[2].memory);
}

// A KDA:GQA hybrid (KDA on layers 1 and 3), untied head (the table once, on the first stage).
TEST(PipelineCostsMeasured, HybridLayersMemoryIsWhatTheModelAllocates) {
  const Config config =
      tiny({"model.alt_attention=kda", "model.alt_attention_layers=every:2", "model.tie_embeddings=false"});
  expect_memory_is_the_models(config);
  const PipelineCosts costs = pipeline_costs_measured(config, Device::cpu);
  EXPECT_NE(costs.layers[0].memory, costs.layers[1].memory);
  EXPECT_EQ(costs.layers[1].memory, costs.layers[3].memory);
}

// The planner given measured memory: within a limit every split's stage fits, and a limit
// below the leanest split's fullest stage is refused naming the key.
TEST(PipelineCostsMeasured, TheSplitIsPlannedWithinAMemoryLimitFromMeasuredMemory) {
  const Config config = tiny({"model.layers=6", "model.alt_mlp=moe", "model.alt_mlp_layers=4,5",
                              "model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_hidden=512"});
  PipelineCosts costs = pipeline_costs_measured(config, Device::cpu);
  ASSERT_EQ(costs.layers.size(), 6u);
  // Even times (measured ones vary from run to run, and this is about memory): by time alone
  // three layers a stage.
  for (LayerCost& layer : costs.layers) layer.time = 1;
  costs.first_extra.time = costs.last_extra.time = 0;
  const PipelineSplit free = plan_pipeline_split(costs, 2);
  const double free_memory = pipeline_balance(costs, free).max_memory;
  // The leanest split in memory, by hand over the five cuts.
  double leanest = free_memory;
  for (int64_t cut = 1; cut < 6; ++cut)
    leanest = std::min(leanest, pipeline_balance(costs, {0, cut}).max_memory);
  // The fastest split (cut at 3) puts layer 3 beside the large MoE layers 4 and 5 and the
  // head; the leanest takes it off that stage: the limit changes the plan.
  ASSERT_EQ(free, (PipelineSplit{0, 3}));
  ASSERT_LT(leanest, free_memory);
  const PipelineSplit fits = plan_pipeline_split(costs, 2, leanest);
  validate_pipeline_split(fits, 6, 2, "test");
  EXPECT_NE(fits, free);
  EXPECT_LE(pipeline_balance(costs, fits).max_memory, leanest);
  // Stage memory counts each layer's measured activations once per micro-batch in flight.
  PipelineCosts framed = costs;
  framed.stage_in_flight = {3, 1};
  const PipelineBalance b = pipeline_balance(framed, fits);
  EXPECT_DOUBLE_EQ(b.stages[0].memory - pipeline_balance(costs, fits).stages[0].memory,
                   2 * [&] {
                     double a = 0;
                     for (int64_t l = 0; l < fits[1]; ++l) a += costs.layers[static_cast<size_t>(l)].activations;
                     return a;
                   }());
  try {
    plan_pipeline_split(costs, 2, 0.99 * leanest, "--pipeline-stages", "--stage-memory-gib");
    FAIL() << "a limit no split meets was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--stage-memory-gib"), std::string::npos) << e.what();
  }
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
