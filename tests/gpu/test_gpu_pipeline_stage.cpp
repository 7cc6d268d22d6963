// kiln's model cut into pipeline stages (train/pipeline_model_stage.h) on the GPU, as
// tests/test_pipeline_model_stage.cpp checks them on the CPU: the pipeline engine runs a
// schedule on one rank (a Gloo context of one, in this process) holding every stage of a
// GPU model, op by op, each boundary crossing through the engine's host buffers; against
// one GPU model of the same weights running the same micro-batches as gradient
// accumulation (Model::forward_backward). The same kernels run on the same inputs in the
// same order, so every trainable parameter's gradient must match bit for bit, and so must
// the LM loss, its z and target count; the routers' objectives are summed per stage and then
// over stages rather than block after block, so those slots match within 1e-12 relative.
//
// Cuts: two stages interleaved on the rank (v = 2, uneven), four (v = 4), the whole model as
// one stage under 1F1B, and ZB-H1 with the backward split into input and weight passes
// (frames only); each with activation frames (the schedule's peak in flight) and with
// stage-input recompute. Models: dense with dropout (the recomputed forward must draw the
// first forward's masks), MoE with the sigmoid-bias router and its balance and z losses, a
// tied head (one rank holds both ends: the table's two shares add in the reference's
// order); fp32 and bf16 mixed precision, and FP8 (tensorwise, inputs kept) for the split.
#include "dist/free_port.h"
#include "dist/process_group.h"
#include "gpu/gpu_harness.h"
#include "gpu/whole_model.h"
#include "nn/precision_recipe.h"
#include "thread_ranks.h"
#include "train/pipeline_engine.h"
#include "train/pipeline_model_stage.h"
#include "train/pipeline_schedule.h"
#include "train/pipeline_simulator.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;
using namespace kiln::pipeline;
using namespace std::chrono_literals;

constexpr int kMicrobatches = 4;
constexpr int64_t kLayers = 4;
constexpr int64_t kTokens = 88;  // the token budget; the micro-batches use 72 to 88 rows

ModelConfig dense_config() {
  ModelConfig c;
  c.name = "pipeline-stage-gpu";
  c.vocab_size = 259, c.hidden = 64, c.layers = kLayers, c.heads = 4, c.kv_heads = 2, c.head_dim = 16;
  c.ffn_hidden = 128, c.max_seq_len = 128, c.qk_norm = true, c.tie_embeddings = false;
  c.dropout = 0.1;
  return c;
}

ModelConfig moe_config() {
  ModelConfig c = dense_config();
  c.dropout = 0;
  c.mlp = "moe";
  c.moe.experts = 8, c.moe.top_k = 2, c.moe.expert_hidden = 48, c.moe.shared_hidden = 32;
  c.moe.router = "sigmoid_bias";
  c.moe.aux_loss = 1e-2, c.moe.z_loss = 1e-3;
  return c;
}

ModelConfig tied_config() {
  ModelConfig c = dense_config();
  c.tie_embeddings = true;
  return c;
}

// Four different micro-batches, each with its own dropout key and PAD tail.
std::vector<HostBatch> microbatches() {
  std::vector<HostBatch> out;
  out.push_back(packed_documents({17, 40, 23}, 8, 11));
  out.push_back(packed_documents({30, 50}, 0, 12));
  out.push_back(packed_documents({60, 5, 15}, 8, 13));
  out.push_back(packed_documents({72}, 4, 14));
  for (size_t m = 0; m < out.size(); ++m) out[m].dropout_key = 91 + m;
  return out;
}

double loss_scale(const std::vector<HostBatch>& batches) {
  int64_t targets = 0;
  for (const HostBatch& b : batches) targets += b.target_count;
  return 1.0 / static_cast<double>(targets);
}

BuildOptions options(DType dtype, const char* fp8 = nullptr) {
  BuildOptions o = options_for(Device::cuda, dtype, kTokens);
  if (fp8 != nullptr) o.precision = resolve_precision_recipe(fp8, Device::cuda);
  return o;
}

// A GPU model with the CPU model's weights of `seed` (the MoE init's routers x 30), zero
// gradients.
std::unique_ptr<Model> build(const ModelConfig& config, const BuildOptions& o) {
  Model init(config, options_for(Device::cpu, DType::f32, kTokens));
  init.allocate();
  init_moe_weights(init, 53);  // init_weights, and the routers' scale where there are any
  auto model = std::make_unique<Model>(config, o);
  model->allocate();
  copy_weights(init, *model);
  model->set_micro_batches(kMicrobatches);
  model->zero_grads();
  return model;
}

// Each trainable parameter's gradient as its bytes (host), by parameter.
std::vector<std::vector<unsigned char>> gradient_bytes(Model& model) {
  std::vector<std::vector<unsigned char>> out;
  for (const auto& p : model.parameters()) {
    if (!p->trainable()) {
      out.emplace_back();
      continue;
    }
    const OwnedTensor host = to_host(p->grad());
    const auto* bytes = static_cast<const unsigned char*>(host->raw());
    out.emplace_back(bytes, bytes + host->nbytes());
  }
  return out;
}

struct Reference {
  std::vector<LossSums> sums;  // by micro-batch
  std::vector<std::vector<unsigned char>> grads;
};

Reference reference(const ModelConfig& config, const BuildOptions& o) {
  const std::vector<HostBatch> batches = microbatches();
  std::unique_ptr<Model> model = build(config, o);
  Reference r;
  for (const HostBatch& b : batches) {
    model->load_batch(b);
    r.sums.push_back(model->forward_backward(loss_scale(batches)));
  }
  r.grads = gradient_bytes(*model);
  return r;
}

bool all_zero(const std::vector<unsigned char>& bytes) {
  for (unsigned char b : bytes)
    if (b != 0) return false;
  return true;
}

// A micro-batch's loss sums against one model's: the main loss, z and target count bit for
// bit, the routers' sums within 1e-12 (they add per stage, then over the stages).
void expect_same_sums(const LossSums& got, const LossSums& ref, int m) {
  EXPECT_GT(ref.loss, 0.0);
  EXPECT_EQ(std::memcmp(&got.slot[0], &ref.loss, sizeof(double)), 0)
      << "micro-batch " << m << ": " << got.slot[0] << " vs " << ref.loss;
  EXPECT_EQ(got.slot[1], ref.z) << "micro-batch " << m;
  EXPECT_EQ(static_cast<int64_t>(got.slot[2]), ref.count) << "micro-batch " << m;
  for (size_t i = 3; i < got.slot.size(); ++i)
    EXPECT_NEAR(got.slot[i], ref.slot[i], 1e-12 * std::abs(ref.slot[i])) << "micro-batch " << m << " slot " << i;
}

enum class Saved { recompute, frames };

void expect_stages_match_one_model(const ModelConfig& config, const BuildOptions& o, const Schedule& schedule,
                                   const std::vector<int64_t>& bounds, const Reference& want, Saved saved,
                                   bool split = false) {
  SCOPED_TRACE(::testing::Message() << schedule.name << ", " << schedule.stages() << " stages on one rank, "
                                    << (saved == Saved::frames ? "activation frames" : "recompute")
                                    << (split ? ", split backward" : ""));
  ASSERT_EQ(schedule.ranks, 1);
  ASSERT_EQ(static_cast<int>(bounds.size()) - 1, schedule.stages());
  const std::vector<HostBatch> batches = microbatches();
  std::unique_ptr<Model> model = build(config, o);
  if (saved == Saved::frames) {
    const Simulation simulation = simulate(schedule);
    ASSERT_TRUE(simulation.ok) << simulation.problem;
    model->enable_activation_frames(simulation.peak_in_flight[0], {{0, kLayers}});
  }
  ModelStage stage(*model, bounds, batches, loss_scale(batches));
  stage.split_backward(split);
  const int port = dist::free_loopback_port();
  dist::ProcessGroup group(test::placement(0, 1, port), Device::cpu, 20000ms);
  run_pipeline_step(schedule, stage, group.host());

  EXPECT_EQ(stage.inputs_kept(), 0u);
  EXPECT_EQ(stage.frames_held(), 0u);
  EXPECT_EQ(stage.weight_passes_pending(), 0u);
  EXPECT_EQ(stage.recomputed_forwards(),
            saved == Saved::frames ? 0u : static_cast<size_t>(kMicrobatches * schedule.stages()));
  for (int m = 0; m < kMicrobatches; ++m) {
    const auto it = stage.losses().find(m);
    ASSERT_NE(it, stage.losses().end()) << "micro-batch " << m;
    expect_same_sums(it->second, want.sums[static_cast<size_t>(m)], m);
  }
  const std::vector<std::vector<unsigned char>> got = gradient_bytes(*model);
  ASSERT_EQ(got.size(), want.grads.size());
  int compared = 0, nonzero = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (want.grads[i].empty()) continue;  // not trainable (a router's bias)
    EXPECT_EQ(got[i], want.grads[i]) << model->parameters()[i]->name();
    ++compared;
    nonzero += !all_zero(want.grads[i]);
  }
  // Comparisons that can fail: nearly every gradient is nonzero (an expert no token was
  // routed to has none).
  EXPECT_GE(nonzero * 10, compared * 9);
}

void expect_every_cut_matches(const ModelConfig& config, const BuildOptions& o) {
  const Reference want = reference(config, o);
  for (const Saved saved : {Saved::frames, Saved::recompute}) {
    expect_stages_match_one_model(config, o, build_interleaved_1f1b(1, 2, kMicrobatches), {0, 1, 4}, want, saved);
    expect_stages_match_one_model(config, o, build_interleaved_1f1b(1, 4, kMicrobatches), {0, 1, 2, 3, 4}, want,
                                  saved);
    expect_stages_match_one_model(config, o, build_1f1b(1, kMicrobatches), {0, 4}, want, saved);
  }
  expect_stages_match_one_model(config, o, build_zero_bubble_h1(1, kMicrobatches), {0, 4}, want, Saved::frames, true);
}

class PipelineStageGpu : public GpuTest {};

TEST_F(PipelineStageGpu, DenseStagesMatchOneModelBitForBit) {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    expect_every_cut_matches(dense_config(), options(dtype));
  }
}

TEST_F(PipelineStageGpu, MoeStagesMatchOneModelBitForBit) {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    expect_every_cut_matches(moe_config(), options(dtype));
  }
}

TEST_F(PipelineStageGpu, TiedHeadStagesMatchOneModelBitForBit) {
  expect_every_cut_matches(tied_config(), options(DType::bf16));
}

// FP8's kept inputs: the split's weight passes read the forward's e4m3 copies of x from the
// frames.
TEST_F(PipelineStageGpu, Fp8StagesMatchOneModelBitForBit) {
  const BuildOptions o = options(DType::bf16, "fp8_tensorwise");
  const Reference want = reference(dense_config(), o);
  expect_stages_match_one_model(dense_config(), o, build_zero_bubble_h1(1, kMicrobatches), {0, 4}, want,
                                Saved::frames, true);
  expect_stages_match_one_model(dense_config(), o, build_interleaved_1f1b(1, 2, kMicrobatches), {0, 1, 4}, want,
                                Saved::recompute);
}

// Models built per stage (BuildOptions::layers, as dist.pipeline_model = "stages" builds
// them) on the GPU: layers [0, 2) and [2, 4) in two models holding only their parameters,
// each micro-batch run forward through both and back (the boundary through host memory, as
// the engine's), against one GPU model: each micro-batch's loss, z and target count, and
// every parameter's gradient, bit for bit (the routers' loss sums within 1e-12).
void expect_models_built_per_stage_match_one_model(const ModelConfig& config, const BuildOptions& o) {
  const Reference want = reference(config, o);
  const std::unique_ptr<Model> names = build(config, o);  // the reference's parameter names
  Model init(config, options_for(Device::cpu, DType::f32, kTokens));
  init.allocate();
  init_moe_weights(init, 53);  // build()'s weights
  const auto stage_model = [&](int64_t first, int64_t last) {
    BuildOptions part = o;
    part.layers = {{first, last}};
    auto model = std::make_unique<Model>(config, part);
    model->allocate();
    for (const auto& p : model->parameters()) copy_tensor(init.find_parameter(p->name())->value(), p->value());
    model->set_micro_batches(kMicrobatches);
    model->zero_grads();
    return model;
  };
  const std::unique_ptr<Model> first = stage_model(0, 2), last = stage_model(2, kLayers);
  EXPECT_EQ(first->parameter_count() + last->parameter_count(), names->parameter_count());  // untied: no copy
  const std::vector<HostBatch> batches = microbatches();
  const double scale = loss_scale(batches);
  for (int m = 0; m < kMicrobatches; ++m) {
    const HostBatch& batch = batches[static_cast<size_t>(m)];
    first->load_batch(batch);
    const LossSums a = first->forward_layers(0, 2, scale, false);
    const OwnedTensor boundary = to_host(first->stage_activation(2));
    last->load_batch(batch);
    copy_tensor(*boundary, last->stage_activation(2));
    const LossSums b = last->forward_layers(2, kLayers, scale, false);
    const LossSums heads = last->stage_heads(scale);
    last->backward_layers(2, kLayers);
    const OwnedTensor dboundary = to_host(last->stage_gradient());
    copy_tensor(*dboundary, first->stage_gradient());
    first->backward_layers(0, 2);
    // The heads' slots (main loss, z, count) and every stage's routers' sums beyond them.
    LossSums got = heads;
    for (size_t i = 3; i < got.slot.size(); ++i) got.slot[i] = a.slot[i] + b.slot[i] + heads.slot[i];
    expect_same_sums(got, want.sums[static_cast<size_t>(m)], m);
  }
  std::map<std::string, std::vector<unsigned char>> got;
  for (Model* model : {first.get(), last.get()}) {
    const std::vector<std::vector<unsigned char>> grads = gradient_bytes(*model);
    for (size_t i = 0; i < grads.size(); ++i) got[model->parameters()[i]->name()] = grads[i];
  }
  int compared = 0, nonzero = 0;
  for (size_t i = 0; i < want.grads.size(); ++i) {
    const std::string& name = names->parameters()[i]->name();
    ASSERT_TRUE(got.count(name)) << name << " is in neither stage's model";
    if (want.grads[i].empty()) continue;  // not trainable (a router's bias)
    EXPECT_EQ(got[name], want.grads[i]) << name;
    ++compared;
    nonzero += !all_zero(want.grads[i]);
  }
  EXPECT_EQ(got.size(), want.grads.size());  // and no parameter of their own
  EXPECT_GE(nonzero * 10, compared * 9);
}

TEST_F(PipelineStageGpu, ModelsBuiltPerStageMatchOneModelBitForBit) {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    expect_models_built_per_stage_match_one_model(dense_config(), options(dtype));
    expect_models_built_per_stage_match_one_model(moe_config(), options(dtype));
  }
}

}  // namespace
}  // namespace kiln
