// kiln's model cut into pipeline stages (train/pipeline_model_stage.h), run by the pipeline
// engine over ranks that are threads joined by Gloo, against one model running the same 4
// micro-batches as gradient accumulation (Model::forward_backward). Every rank builds the
// whole model, or (ModelsBuiltPerStage...) only its stages' part; a parameter of a rank's
// stages must have the reference's gradient bit for bit, every other parameter's gradient
// must stay zero. Bitwise is expected: each stage runs
// the same kernels on the same inputs (the residual stream crosses in the wide dtype,
// unrounded), and every schedule runs a stage's backwards in micro-batch order, the order
// the reference accumulates in. The loss, its target count and z match bit for bit too (the
// LM head runs only on the last stage); the routers' objectives of a MoE model are summed
// per stage and then over stages, not block after block, so those slots match to 1e-12
// relative (f64). A tied head's table gets a share from the first stage and one from the
// last: summed over the ranks, they match the reference within rounding (its own test).
#include "dist/free_port.h"
#include "dist/process_group.h"
#include "grad_check.h"
#include "test_util.h"
#include "thread_ranks.h"
#include "tiny_model.h"
#include "train/pipeline_engine.h"
#include "train/pipeline_model_stage.h"
#include "train/pipeline_schedule.h"
#include "train/pipeline_simulator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>

namespace kiln {
namespace {

using namespace kiln::test;
using namespace kiln::pipeline;
using namespace std::chrono_literals;

constexpr int kMicrobatches = 4;
constexpr int64_t kLayers = 4;

ModelConfig dense_config() {
  ModelConfig c = tiny_config(true, false);
  c.layers = kLayers;
  c.dropout = 0.1;  // the recomputed forward must draw the masks the first drew
  return c;
}

ModelConfig moe_config() {
  ModelConfig c = tiny_config(true, false);
  c.layers = kLayers;
  c.mlp = "moe";
  c.moe.experts = 4, c.moe.top_k = 2, c.moe.expert_hidden = 6;
  c.moe.router = "sigmoid_bias";
  c.moe.aux_loss = 1e-2, c.moe.z_loss = 1e-3;
  return c;
}

// Four different micro-batches: content tokens shifted by m, and a PAD tail on odd m (a
// micro-batch of fewer rows than the budget of 24).
std::vector<HostBatch> microbatches() {
  std::vector<HostBatch> out;
  for (int m = 0; m < kMicrobatches; ++m) {
    std::vector<Doc> docs = three_docs();
    for (Doc& d : docs)
      for (size_t i = 1; i < d.tokens.size(); ++i) d.tokens[i] = (d.tokens[i] + m) % 10;
    HostBatch b = pack_docs(docs, m % 2 == 1 ? 4 : 0);
    b.dropout_key = 91 + static_cast<uint64_t>(m);
    out.push_back(std::move(b));
  }
  return out;
}

double loss_scale(const std::vector<HostBatch>& batches) {
  int64_t targets = 0;
  for (const HostBatch& b : batches) targets += b.target_count;
  return 1.0 / static_cast<double>(targets);
}

// f64 unless `fp8` names an FP8 recipe (train.precision; the CPU's emulation computes in
// f32), each projection's FP8 input kept from forward to backward unless `keep` is off.
BuildOptions options(const char* fp8 = nullptr, bool keep = true) {
  BuildOptions o = tiny_build(24, 7, 1e-3);
  if (fp8 != nullptr) {
    o.dtype = DType::f32;
    o.precision = resolve_precision_recipe(fp8, Device::cpu);
    o.precision->keep_fp8_inputs = keep;
  }
  return o;
}

std::unique_ptr<Model> build(const ModelConfig& config, const BuildOptions& o = options()) {
  auto model = std::make_unique<Model>(config, o);
  model->allocate();
  if (o.dtype == DType::f64) {
    init_tiny_model(*model, 33);
  } else {  // init_tiny_model's gains and biases away from 1 and 0, in f32
    model->init_weights(33);
    Rng rng(33);
    for (const auto& p : model->parameters()) {
      if (p->shape().rank() != 1 || p->init().kind == InitKind::constant) continue;
      const double base = p->init().kind == InitKind::ones ? 1.0 : 0.0;
      float* v = p->value().data<float>();
      for (int64_t i = 0; i < p->value().numel(); ++i) v[i] = static_cast<float>(base + 0.2 * rng.normal());
    }
  }
  model->set_micro_batches(kMicrobatches);
  model->zero_grads();
  return model;
}

struct Reference {
  std::vector<LossSums> sums;                 // by micro-batch
  std::vector<std::vector<double>> grads;     // by parameter
  std::vector<std::string> names;
};

Reference reference(const ModelConfig& config, const BuildOptions& o = options()) {
  const std::vector<HostBatch> batches = microbatches();
  std::unique_ptr<Model> model = build(config, o);
  Reference r;
  for (const HostBatch& b : batches) {
    model->load_batch(b);
    r.sums.push_back(model->forward_backward(loss_scale(batches)));
  }
  for (const auto& p : model->parameters()) {
    r.grads.push_back(p->trainable() ? values_of(p->grad()) : std::vector<double>{});  // a router's bias: none
    r.names.push_back(p->name());
  }
  return r;
}

// The stage holding a parameter: its block's, the embedding on the first, the rest (final
// norm, LM head) on the last.
int stage_of(const std::string& name, const std::vector<int64_t>& bounds) {
  const int last = static_cast<int>(bounds.size()) - 2;
  if (name == "embed.weight") return 0;
  if (name.rfind("layers.", 0) != 0) return last;
  const int64_t layer = std::stoll(name.substr(7));
  for (int s = 0; s <= last; ++s)
    if (layer < bounds[static_cast<size_t>(s) + 1]) return s;
  return -1;
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

bool all_zero(const std::vector<double>& a) {
  for (double v : a)
    if (v != 0) return false;
  return true;
}

// A stage's model (BuildOptions::layers: `layers`) with the weights of `whole` (the same
// initial values whatever the stage, by name).
std::unique_ptr<Model> build_stage(const ModelConfig& config, const Model& whole,
                                   const std::vector<std::pair<int64_t, int64_t>>& layers) {
  BuildOptions o = whole.options();
  o.layers = layers;
  auto model = std::make_unique<Model>(config, o);
  model->allocate();
  for (const auto& p : model->parameters()) {
    const Parameter* from = whole.find_parameter(p->name());
    if (from == nullptr) throw std::runtime_error("a stage's parameter the whole model lacks: " + p->name());
    copy_tensor(from->value(), p->value());
  }
  model->set_micro_batches(kMicrobatches);
  model->zero_grads();
  return model;
}

// A tied head's table: the first stage's lookup and the last stage's head each add their
// share of its gradient on their rank, and no other rank touches it (a stage's model of
// neither end holds no table). Summed over the ranks
// (in the gradient's dtype, f64 here, as the trainer's all-reduce sums them) the shares must
// give the reference's gradient: bit for bit when one rank holds both stages (it adds head
// and lookup micro-batch after micro-batch, h0, e0, h1, e1, ..., as the reference does),
// else within 1e-12 of its largest element, since two ranks add
// (h0 + h1 + ...) + (e0 + e1 + ...).
void expect_tied_table_sums_to_the_reference(const std::vector<std::unique_ptr<Model>>& models,
                                             const Schedule& schedule, const Reference& want) {
  const auto table = static_cast<size_t>(
      std::find(want.names.begin(), want.names.end(), "embed.weight") - want.names.begin());
  ASSERT_LT(table, want.names.size());
  const int first = schedule.rank_of(0), last = schedule.rank_of(schedule.stages() - 1);
  std::vector<double> sum(want.grads[table].size(), 0.0);
  for (int r = 0; r < schedule.ranks; ++r) {
    const Parameter* held = models[static_cast<size_t>(r)]->find_parameter("embed.weight");
    if (held == nullptr) {
      EXPECT_TRUE(r != first && r != last) << "rank " << r << " holds an end of the pipeline but no table";
      continue;
    }
    const std::vector<double> got = values_of(held->grad());
    ASSERT_EQ(got.size(), sum.size());
    if (r != first && r != last) {
      EXPECT_TRUE(all_zero(got)) << "the tied table's gradient on rank " << r << ", which holds neither end";
      continue;
    }
    EXPECT_FALSE(all_zero(got)) << "the tied table's gradient on rank " << r;
    for (size_t k = 0; k < sum.size(); ++k) sum[k] += got[k];
  }
  if (first == last) {
    EXPECT_TRUE(same_bits(sum, want.grads[table])) << "the tied table's gradient on rank " << first;
    return;
  }
  double largest = 0, worst = 0;
  for (size_t k = 0; k < sum.size(); ++k) {
    largest = std::max(largest, std::abs(want.grads[table][k]));
    worst = std::max(worst, std::abs(sum[k] - want.grads[table][k]));
  }
  EXPECT_GT(largest, 0.0);
  EXPECT_LE(worst, 1e-12 * largest) << "the tied table's gradient summed over the ranks";
}

enum class Saved { recompute, frames };
// Every rank the whole model, or each its stages' part (BuildOptions::layers).
enum class Built { whole, stages };

// `split`: the stages leave their projections' weight gradients to the W passes
// (ModelStage::split_backward; frames only).
void expect_pipeline_matches_one_model(const ModelConfig& config, const Schedule& schedule,
                                       const std::vector<int64_t>& bounds, const Reference& want, Saved saved,
                                       bool split = false, Built built = Built::whole) {
  SCOPED_TRACE(::testing::Message() << schedule.name << ", " << schedule.ranks << " ranks x "
                                    << schedule.stages_per_rank << " stages, "
                                    << (saved == Saved::frames ? "activation frames" : "recompute")
                                    << (split ? ", split backward" : "")
                                    << (built == Built::stages ? ", a model per rank's stages" : ""));
  ASSERT_EQ(static_cast<int>(bounds.size()) - 1, schedule.stages());
  const int ranks = schedule.ranks;
  const std::vector<HostBatch> batches = microbatches();
  // Built before the threads start, as a rank's process would before its first step.
  std::vector<std::unique_ptr<Model>> models;
  std::vector<std::unique_ptr<ModelStage>> stages;
  // With frames, each rank's model gets its most pairs in flight, as the schedule's
  // simulation counts them, for its stages' layers only; without, the stages recompute.
  const Simulation simulation = simulate(schedule);
  ASSERT_TRUE(simulation.ok) << simulation.problem;
  const std::unique_ptr<Model> whole = built == Built::stages ? build(config) : nullptr;
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::pair<int64_t, int64_t>> mine;
    for (int s = 0; s < schedule.stages(); ++s)
      if (schedule.rank_of(s) == r) mine.emplace_back(bounds[static_cast<size_t>(s)], bounds[static_cast<size_t>(s) + 1]);
    models.push_back(built == Built::stages ? build_stage(config, *whole, mine) : build(config));
    if (saved == Saved::frames)
      models.back()->enable_activation_frames(simulation.peak_in_flight[static_cast<size_t>(r)], mine);
    stages.push_back(std::make_unique<ModelStage>(*models.back(), bounds, batches, loss_scale(batches)));
    stages.back()->split_backward(split);
  }
  const int port = dist::free_loopback_port();
  const auto errors = run_ranks(ranks, [&](int r) {
    dist::ProcessGroup group(placement(r, ranks, port), Device::cpu, 20000ms);
    run_pipeline_step(schedule, *stages[static_cast<size_t>(r)], group.host());
  });
  for (int r = 0; r < ranks; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;

  // Losses: each micro-batch's slot sums over the ranks.
  for (int m = 0; m < kMicrobatches; ++m) {
    LossSums got;
    for (const auto& stage : stages) {
      EXPECT_EQ(stage->inputs_kept(), 0u);
      EXPECT_EQ(stage->frames_held(), 0u);
      EXPECT_EQ(stage->weight_passes_pending(), 0u);
      EXPECT_EQ(stage->framed(), saved == Saved::frames);
      // Every pair of the rank recomputed once without frames, none with them.
      const size_t pairs = static_cast<size_t>(kMicrobatches * schedule.stages_per_rank);
      EXPECT_EQ(stage->recomputed_forwards(), saved == Saved::frames ? 0u : pairs);
      const auto it = stage->losses().find(m);
      if (it == stage->losses().end()) continue;
      for (size_t i = 0; i < got.slot.size(); ++i) got.slot[i] += it->second.slot[i];
    }
    const LossSums& ref = want.sums[static_cast<size_t>(m)];
    EXPECT_GT(ref.loss, 0.0);
    EXPECT_EQ(std::memcmp(&got.slot[0], &ref.loss, sizeof(double)), 0) << "micro-batch " << m << ": " << got.slot[0]
                                                                         << " vs " << ref.loss;
    EXPECT_EQ(got.slot[1], ref.z) << "micro-batch " << m;
    EXPECT_EQ(static_cast<int64_t>(got.slot[2]), ref.count) << "micro-batch " << m;
    for (size_t i = 3; i < got.slot.size(); ++i)
      EXPECT_NEAR(got.slot[i], ref.slot[i], 1e-12 * std::abs(ref.slot[i])) << "micro-batch " << m << " slot " << i;
  }

  // Gradients, by name: the reference's on the owning rank, zero on the other ranks of
  // whole models; a stage's model holds its own stages' parameters only.
  int compared = 0, nonzero = 0;
  for (int r = 0; r < ranks; ++r) {
    const auto& params = models[static_cast<size_t>(r)]->parameters();
    if (built == Built::whole) ASSERT_EQ(params.size(), want.grads.size());
    for (const auto& p : params) {
      const auto i = static_cast<size_t>(std::find(want.names.begin(), want.names.end(), p->name()) - want.names.begin());
      ASSERT_LT(i, want.names.size()) << p->name();
      if (!p->trainable()) continue;
      if (config.tie_embeddings && want.names[i] == "embed.weight") continue;  // below
      const int owner = stage_of(want.names[i], bounds);
      ASSERT_GE(owner, 0) << want.names[i];
      const std::vector<double> got = values_of(p->grad());
      if (schedule.rank_of(owner) == r) {
        EXPECT_TRUE(same_bits(got, want.grads[i])) << want.names[i] << " on rank " << r;
        ++compared;
        nonzero += !all_zero(want.grads[i]);
      } else {
        EXPECT_EQ(built, Built::whole) << want.names[i] << " held by rank " << r << ", not its owner";
        EXPECT_TRUE(all_zero(got)) << want.names[i] << " outside rank " << r << "'s stages";
      }
    }
  }
  if (config.tie_embeddings) {
    expect_tied_table_sums_to_the_reference(models, schedule, want);
    ++compared;
  }
  // Every trainable parameter compared once (the reference keeps no gradient of the others).
  EXPECT_EQ(compared, static_cast<int>(std::count_if(want.grads.begin(), want.grads.end(),
                                                     [](const auto& g) { return !g.empty(); })));
  // Comparisons that can fail: all but a few gradients are nonzero (an expert no token of
  // the 4 micro-batches was routed to has none).
  EXPECT_GE(nonzero * 10, compared * 9);
}

void expect_every_cut_matches(const ModelConfig& config, Saved saved) {
  const Reference want = reference(config);
  // 2 stages on 2 ranks, each schedule; 3 uneven stages with 1F1B; 4 stages interleaved on
  // 2 ranks; 2 stages on one rank (handed over in memory, one model running both); the
  // whole model as one stage.
  for (const Schedule& s :
       {build_gpipe(2, kMicrobatches), build_1f1b(2, kMicrobatches), build_zero_bubble_h1(2, kMicrobatches)})
    expect_pipeline_matches_one_model(config, s, {0, 2, 4}, want, saved);
  expect_pipeline_matches_one_model(config, build_1f1b(3, kMicrobatches), {0, 1, 3, 4}, want, saved);
  expect_pipeline_matches_one_model(config, build_interleaved_1f1b(2, 2, kMicrobatches), {0, 1, 2, 3, 4}, want, saved);
  expect_pipeline_matches_one_model(config, build_interleaved_1f1b(1, 2, kMicrobatches), {0, 3, 4}, want, saved);
  expect_pipeline_matches_one_model(config, build_1f1b(1, kMicrobatches), {0, 4}, want, saved);  // one stage
  if (saved != Saved::frames) return;
  // ZB-H1 as the trainer runs it: weight passes split off, over 2 and 4 ranks and one.
  expect_pipeline_matches_one_model(config, build_zero_bubble_h1(2, kMicrobatches), {0, 2, 4}, want, saved, true);
  expect_pipeline_matches_one_model(config, build_zero_bubble_h1(4, kMicrobatches), {0, 1, 2, 3, 4}, want, saved,
                                    true);
  expect_pipeline_matches_one_model(config, build_zero_bubble_h1(1, kMicrobatches), {0, 4}, want, saved, true);
}

TEST(PipelineModelStage, DenseStagesMatchOneModelBitForBit) {
  expect_every_cut_matches(dense_config(), Saved::recompute);
  expect_every_cut_matches(dense_config(), Saved::frames);
}

TEST(PipelineModelStage, MoeStagesMatchOneModelBitForBit) {
  expect_every_cut_matches(moe_config(), Saved::recompute);
  expect_every_cut_matches(moe_config(), Saved::frames);
}

// A tied head: every gradient but the table's as above (bit for bit on its stage's rank),
// the table's the sum of the first and the last stage's shares.
TEST(PipelineModelStage, TiedHeadStagesMatchOneModel) {
  ModelConfig c = dense_config();
  c.tie_embeddings = true;
  expect_every_cut_matches(c, Saved::recompute);
  expect_every_cut_matches(c, Saved::frames);
}

// Models built per stage (BuildOptions::layers): each rank holds only its stages' blocks
// (the embedding on the first stage, the final norm and the head on the last, a tied
// table on both ends), and the pipeline gives the same losses and gradients as with whole
// models: bit for bit, the tied table's summed shares within rounding.
TEST(PipelineModelStage, ModelsBuiltPerStageMatchOneModel) {
  ModelConfig tied = dense_config();
  tied.tie_embeddings = true;
  for (const ModelConfig& config : {dense_config(), moe_config(), tied}) {
    const Reference want = reference(config);
    expect_pipeline_matches_one_model(config, build_1f1b(2, kMicrobatches), {0, 2, 4}, want, Saved::frames, false,
                                      Built::stages);
    expect_pipeline_matches_one_model(config, build_1f1b(3, kMicrobatches), {0, 1, 3, 4}, want, Saved::recompute,
                                      false, Built::stages);
    expect_pipeline_matches_one_model(config, build_interleaved_1f1b(2, 2, kMicrobatches), {0, 1, 2, 3, 4}, want,
                                      Saved::frames, false, Built::stages);
    expect_pipeline_matches_one_model(config, build_zero_bubble_h1(2, kMicrobatches), {0, 2, 4}, want, Saved::frames,
                                      true, Built::stages);
  }
}

// What a stage's model holds: its blocks' parameters, each with the whole model's initial
// values (init_weights draws by the whole model's index), the whole model's loss slots
// (a dense first stage of a model whose later layers are sparse still has the routers'),
// less memory, zero for the blocks it leaves out; and it refuses what needs the whole model.
TEST(PipelineModelStage, AStagesModelHoldsItsLayersWithTheWholeModelsValues) {
  for (const bool tie : {false, true}) {
    SCOPED_TRACE(tie ? "tied head" : "untied head");
    ModelConfig c = moe_config();
    c.tie_embeddings = tie;
    c.alt_mlp = "swiglu";
    c.alt_mlp_layers = "first:2";  // layers 0-1 dense, 2-3 sparse
    BuildOptions o = options();
    Model whole(c, o);
    whole.allocate();
    whole.init_weights(7);
    BuildOptions first = o, last = o;
    first.layers = {{0, 2}};
    last.layers = {{2, 4}};
    Model a(c, first), b(c, last);
    a.allocate(), b.allocate();
    a.init_weights(7), b.init_weights(7);
    for (const Model* stage : {&a, &b})
      for (const auto& p : stage->parameters()) {
        const Parameter* w = whole.find_parameter(p->name());
        ASSERT_NE(w, nullptr) << p->name();
        EXPECT_TRUE(same_bits(values_of(p->value()), values_of(w->value()))) << p->name();
      }
    EXPECT_EQ(a.parameters().size() + b.parameters().size(), whole.parameters().size() + (tie ? 1 : 0));
    EXPECT_NE(a.find_parameter("embed.weight"), nullptr);
    EXPECT_EQ(b.find_parameter("embed.weight") != nullptr, tie);  // the tied head's table
    EXPECT_EQ(a.find_parameter("final_norm.weight"), nullptr);
    EXPECT_NE(b.find_parameter("final_norm.weight"), nullptr);
    EXPECT_EQ(a.find_parameter("layers.2.mlp.gate.weight"), nullptr);
    for (const char* slot : {"loss", "moe_aux", "moe_z"}) {
      EXPECT_GE(whole.loss_terms().find(slot), 0) << slot;
      EXPECT_EQ(a.loss_terms().find(slot), whole.loss_terms().find(slot)) << slot;
      EXPECT_EQ(b.loss_terms().find(slot), whole.loss_terms().find(slot)) << slot;
    }
    for (const Model* stage : {&a, &b}) {
      EXPECT_LT(stage->memory_plan().parameters, whole.memory_plan().parameters);
      EXPECT_LT(stage->memory_plan().gradients, whole.memory_plan().gradients);
      EXPECT_LT(stage->memory_plan().activations, whole.memory_plan().activations);
    }
    EXPECT_EQ(a.block_memory(3).total(), 0u);
    EXPECT_EQ(b.block_memory(0).total(), 0u);
    EXPECT_EQ(a.block_memory(1).parameters, whole.block_memory(1).parameters);
    EXPECT_EQ(b.block_memory(2).gradients, whole.block_memory(2).gradients);
    a.load_batch(microbatches()[0]), b.load_batch(microbatches()[0]);
    EXPECT_THROW(a.forward_backward(1.0), Error);  // layers 2-3 and the head are elsewhere
    EXPECT_THROW(b.forward_layers(0, 2, 1.0, false), Error);
  }
  BuildOptions outside = options();
  outside.layers = {{2, 5}};
  EXPECT_THROW(Model(moe_config(), outside), Error);
  ModelConfig mtp = dense_config();
  mtp.mtp.depth = 1;
  BuildOptions stage = options();
  stage.layers = {{0, 2}};
  EXPECT_THROW(Model(mtp, stage), Error);
}

// A parameter of a LinearLayer (a projection's weight or bias), whose gradient a split
// backward leaves to the weight pass; the routed experts' (grouped GEMMs) stay at B.
bool is_projection(const std::string& name) {
  return name.find("_proj.") != std::string::npos && name.find(".experts.") == std::string::npos;
}

// The split on one stage holding the whole model, all four forwards, then the four input
// passes (B): the projections' gradients are untouched (zero) and every other gradient is
// already the reference's; then the four weight passes (W): every gradient is the
// reference's, bit for bit. Each frame stays held until its W. In f64, and in FP8 (the
// emulation, f32) with each projection's input kept from the forward (the gated MLP's and
// the shared expert's down projection then take dgrad and wgrad in one call) and without.
void expect_weight_passes_complete_the_gradients(const ModelConfig& config, const BuildOptions& o) {
  const Reference want = reference(config, o);
  std::unique_ptr<Model> model = build(config, o);
  model->enable_activation_frames(kMicrobatches, {{0, kLayers}});
  const std::vector<HostBatch> batches = microbatches();
  ModelStage stage(*model, {0, kLayers}, batches, loss_scale(batches));
  stage.split_backward(true);
  std::vector<unsigned char> out(static_cast<size_t>(stage.output_bytes(0)));
  for (int m = 0; m < kMicrobatches; ++m) stage.forward(m, 0, nullptr, out.data());
  for (int m = 0; m < kMicrobatches; ++m) stage.backward_input(m, 0, nullptr, nullptr);
  EXPECT_EQ(stage.frames_held(), static_cast<size_t>(kMicrobatches));  // W still to read them
  EXPECT_EQ(stage.weight_passes_pending(), static_cast<size_t>(kMicrobatches));
  const auto& params = model->parameters();
  int projections = 0, others = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i]->trainable()) continue;
    const std::vector<double> got = values_of(params[i]->grad());
    if (is_projection(want.names[i])) {
      EXPECT_TRUE(all_zero(got)) << want.names[i] << " after the input passes alone";
      EXPECT_FALSE(all_zero(want.grads[i])) << want.names[i];
      ++projections;
    } else {
      EXPECT_TRUE(same_bits(got, want.grads[i])) << want.names[i] << " after the input passes";
      ++others;
    }
  }
  EXPECT_GE(projections, 4 * static_cast<int>(kLayers));  // q, k, v, o at least, each layer
  EXPECT_GT(others, 0);
  for (int m = 0; m < kMicrobatches; ++m) stage.backward_weight(m, 0);
  EXPECT_EQ(stage.frames_held(), 0u);
  EXPECT_EQ(stage.weight_passes_pending(), 0u);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i]->trainable()) continue;
    EXPECT_TRUE(same_bits(values_of(params[i]->grad()), want.grads[i])) << want.names[i] << " after the weight passes";
  }
}

TEST(PipelineModelStage, WeightPassesAddTheProjectionsGradientsBitForBit) {
  ModelConfig shared = moe_config();
  shared.moe.shared_hidden = 10;
  for (const ModelConfig& c : {dense_config(), moe_config(), shared}) {
    SCOPED_TRACE(c.mlp);
    expect_weight_passes_complete_the_gradients(c, options());
    expect_weight_passes_complete_the_gradients(c, options("fp8_tensorwise"));
    expect_weight_passes_complete_the_gradients(c, options("fp8_tensorwise", false));
    expect_weight_passes_complete_the_gradients(c, options("fp8_blockwise"));
  }
}

TEST(PipelineModelStage, ASplitBackwardNeedsFramesAndItsInputPass) {
  std::unique_ptr<Model> model = build(dense_config());
  ModelStage recomputing(*model, {0, 4}, microbatches(), 1.0);
  EXPECT_EQ(error_of([&] { recomputing.split_backward(true); }).rfind("[dist.pipeline_activations] ", 0), 0u);
  model->enable_activation_frames(2, {{0, 4}});
  ModelStage stage(*model, {0, 4}, microbatches(), 1.0);
  stage.split_backward(true);
  std::vector<unsigned char> out(static_cast<size_t>(stage.output_bytes(0)));
  stage.forward(0, 0, nullptr, out.data());
  EXPECT_EQ(error_of([&] { stage.backward_weight(0, 0); }),
            "[pipeline] weight pass of micro-batch 0 on stage 0 before its input pass");
}

// More pairs in flight than frames: the forward that finds none free says so, before it
// overwrites anything. GPipe on one rank holding both stages keeps all 8 pairs in flight.
TEST(PipelineModelStage, RunningOutOfActivationFramesIsAnError) {
  std::unique_ptr<Model> model = build(dense_config());
  model->enable_activation_frames(3, {{0, 2}});
  ModelStage stage(*model, {0, 2, 4}, microbatches(), 1.0);
  std::vector<unsigned char> out(static_cast<size_t>(stage.output_bytes(0)));
  for (int m = 0; m < 3; ++m) stage.forward(m, 0, nullptr, out.data());
  EXPECT_EQ(error_of([&] { stage.forward(3, 0, nullptr, out.data()); }),
            "[pipeline] micro-batch 3 on stage 0: more micro-batches in flight than the model's 3 activation frames");
}

// Frames copy only the framed blocks (and the model's own state): one layer's frames take
// less memory than all four's, and each extra frame the same again.
TEST(PipelineModelStage, ActivationFramesHoldOnlyTheirLayers) {
  const auto extra = [](int frames, std::vector<std::pair<int64_t, int64_t>> layers) {
    std::unique_ptr<Model> model = build(dense_config());
    model->enable_activation_frames(frames, layers);
    return model->activation_frame_bytes();
  };
  const size_t one_layer = extra(2, {{1, 2}}), all_layers = extra(2, {{0, 4}}), none = extra(2, {});
  EXPECT_GT(none, 0u);  // the model's own state: its batch, the final norm's
  EXPECT_LT(none, one_layer);
  EXPECT_LT(one_layer, all_layers);
  EXPECT_EQ(extra(3, {{1, 2}}), 2 * one_layer);
  EXPECT_EQ(all_layers - none, 4 * (one_layer - none));  // the dense model's blocks are alike
}

TEST(PipelineModelStage, BoundsThatDoNotCoverTheModelAreRefused) {
  std::unique_ptr<Model> model = build(dense_config());
  EXPECT_EQ(error_of([&] { ModelStage stage(*model, {0, 2, 3}, microbatches(), 1.0); }),
            "[pipeline] stage boundaries must run from 0 to model.layers = 4");
}

}  // namespace
}  // namespace kiln
