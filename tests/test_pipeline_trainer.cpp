// The trainer with a pipeline (dist.pipeline_stages > 1; train/pipeline_trainer_step.h) on
// the CPU with real processes joined by Gloo: every schedule over 2 and 4 stages trains
// as one process over the same global batch, bit for bit; 2 stages x 2 data-parallel
// replicas train as 2 data-parallel ranks, bit for bit; a pipeline checkpoint resumes in
// one process, at another split and at another layout; 2 stages x 3 replicas match 3
// data-parallel ranks within rounding; ZeRO-1 and ZeRO-2 over 2 x 2, and 4 stages x 2
// replicas (with and without ZeRO-2), train as 2 data-parallel ranks, bit for bit but
// ZeRO-2's gradient norm; a tied head trains as one process (2, 3 and
// interleaved stages) and 2 x 2 as 2 data-parallel ranks, within rounding; stages that
// recompute their forward instead of keeping activation frames train bitwise too; a killed
// stage ends the others naming it; models built per stage (dist.pipeline_model = "stages")
// train as one process, as whole models and as data-parallel ranks, ZeRO sharding each
// stage over its replicas, and resume across splits and layouts; bad pipeline keys and
// world sizes are refused naming the key.
#include "config/config.h"
#include "dist/free_port.h"
#include "fault_test_util.h"
#include "io/safetensors.h"
#include "train/pipeline_trainer_step.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <thread>
#include <utility>
#include <vector>

using namespace kiln;
using namespace kiln::test;

namespace {

// Every rank on one thread (a bitwise-comparable run needs a fixed thread count); 8 layers
// so 4 ranks x 2 virtual stages each get one; an untied head (a tied one is tested on its
// own: its table's gradient is not bitwise).
const std::string kModel =
    "--set train.threads=1 --set model.layers=8 --set model.tie_embeddings=false --set train.steps=6 ";

// MoE layers (sigmoid-bias router, aux loss) and QK-Clip under Muon.
const std::string kSparse =
    "--set model.mlp=moe --set model.moe.experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32 "
    "--set model.moe.router=sigmoid_bias --set model.moe.aux_loss=0.01 --set optim.name=muon "
    "--set optim.qk_clip.enabled=true --set optim.qk_clip.tau=1.5 ";

class PipelineTrainer : public TinyRunTest {
 protected:
  PipelineTrainer() : TinyRunTest("kiln_pipeline_trainer", 300) {}
  std::string single(const std::string& out, const std::string& extra = "") const {
    return tiny_train(corpus_, out, kModel + "--set train.grad_accum=4 " + extra);
  }
  // `stages` x `replicas` ranks by `kiln launch`, one stage each (v for the interleaved schedule).
  std::string pipeline(int stages, const std::string& schedule, const std::string& out,
                       const std::string& extra = "", int replicas = 1) const {
    const std::string args = fmt::format("--set dist.pipeline_stages={} --set dist.pipeline_schedule={} {}", stages,
                                         schedule, schedule == "interleaved" ? "--set dist.pipeline_virtual_stages=2 " : "");
    const std::string train = single(out, args + extra);
    return launched(stages * replicas, train);
  }
  // `ranks` data-parallel ranks, train.grad_accum micro-batches each.
  std::string data_parallel(const std::string& out, const std::string& extra = "", int ranks = 2) const {
    return launched(ranks, single(out, extra));
  }
  // Bitwise holds because each stage runs the one-process kernels on the same inputs in
  // the same micro-batch order (test_pipeline_model_stage), and the all-reduce adds only
  // zeros to each gradient and to the main loss's sum (a parameter's gradient comes from
  // one rank alone).
  void check_every_schedule(int stages) {
    std::string output;
    const std::string one = dir_ + "/one";
    ASSERT_EQ(run_with_fault(single(one), "", &output), 0) << output;
    for (const std::string schedule : {"gpipe", "1f1b", "interleaved", "zb_h1"}) {
      SCOPED_TRACE(fmt::format("{} stages, {}", stages, schedule));
      const std::string out = fmt::format("{}/{}-{}", dir_, stages, schedule);
      ASSERT_EQ(run_with_fault(pipeline(stages, schedule, out), "", &output), 0) << output;
      EXPECT_CONTAINS(output, fmt::format("pipeline: {} stages on {} ranks (",
                                          schedule == "interleaved" ? 2 * stages : stages, stages));
      // Each rank ran its own stage(s): rank 1 stage 1 (and 1 + stages, interleaved), its
      // forward state kept in activation frames (dist.pipeline_activations' default).
      EXPECT_CONTAINS(read_file(out + "/rank-1.log"), "; this rank runs stage 1");
      EXPECT_CONTAINS(output, " activation frames of its stages' saved activations, one per micro-batch in flight");
      // ZB-H1 leaves the projections' weight gradients to its W passes (by default).
      EXPECT_EQ(output.find("backward split: ") != std::string::npos, schedule == "zb_h1") << output;
      expect_identical(out, one);
    }
    // And ZB-H1 with its backward whole at B (dist.pipeline_split_backward = false).
    const std::string out = fmt::format("{}/{}-zb_h1-whole", dir_, stages);
    ASSERT_EQ(run_with_fault(pipeline(stages, "zb_h1", out, "--set dist.pipeline_split_backward=false "), "", &output),
              0)
        << output;
    EXPECT_EQ(output.find("backward split: "), std::string::npos) << output;
    expect_identical(out, one);
  }
  void expect_identical(const std::string& a, const std::string& b);
  void expect_close(const std::string& a, const std::string& b);
  void expect_same_but_the_norm(const std::string& a, const std::string& b, double tolerance = 1e-12);
  void expect_a_killed_rank_named(int world, int victim, const std::string& extra);
};

// Within rounding: every step's loss and gradient norm within 1e-6 relative (tokens and
// learning rate exact), every final weight within 1e-5 of the largest magnitude.
void PipelineTrainer::expect_close(const std::string& a, const std::string& b) {
  const std::vector<TrainRecord> x = train_records(a), y = train_records(b);
  ASSERT_EQ(x.size(), y.size());
  ASSERT_FALSE(x.empty());
  const auto near = [](double u, double v, double tolerance) { return std::abs(u - v) <= tolerance * std::abs(v); };
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i].tokens, y[i].tokens) << "step " << x[i].step;
    EXPECT_EQ(x[i].lr, y[i].lr) << "step " << x[i].step;
    EXPECT_TRUE(near(x[i].loss.get<double>(), y[i].loss.get<double>(), 1e-6)) << "step " << x[i].step;
    EXPECT_TRUE(near(x[i].grad_norm.get<double>(), y[i].grad_norm.get<double>(), 1e-6)) << "step " << x[i].step;
  }
  const io::SafetensorsFile p = io::SafetensorsFile::open(a + "/model/model.safetensors");
  const io::SafetensorsFile q = io::SafetensorsFile::open(b + "/model/model.safetensors");
  ASSERT_EQ(p.names(), q.names());
  for (const std::string& name : p.names()) {
    const OwnedTensor u = io::read_tensor(p, name, DType::f32), v = io::read_tensor(q, name, DType::f32);
    ASSERT_EQ(u.tensor.numel(), v.tensor.numel()) << name;
    double worst = 0, largest = 0;
    for (int64_t i = 0; i < u.tensor.numel(); ++i) {
      worst = std::max(worst, static_cast<double>(std::abs(u.tensor.data<float>()[i] - v.tensor.data<float>()[i])));
      largest = std::max(largest, static_cast<double>(std::abs(v.tensor.data<float>()[i])));
    }
    EXPECT_LE(worst, 1e-5 * std::max(largest, 1.0)) << name;
  }
}

// Bit for bit: every step's loss, gradient norm, learning rate and tokens, and every final weight.
void PipelineTrainer::expect_identical(const std::string& a, const std::string& b) {
  const std::vector<TrainRecord> x = train_records(a), y = train_records(b);
  ASSERT_EQ(x.size(), y.size());
  ASSERT_FALSE(x.empty());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i].step, y[i].step);
    EXPECT_EQ(x[i].tokens, y[i].tokens) << "step " << x[i].step;
    EXPECT_EQ(x[i].lr, y[i].lr) << "step " << x[i].step;
    EXPECT_EQ(x[i].loss, y[i].loss) << "step " << x[i].step;
    EXPECT_EQ(x[i].grad_norm, y[i].grad_norm) << "step " << x[i].step;
  }
  const io::SafetensorsFile p = io::SafetensorsFile::open(a + "/model/model.safetensors");
  const io::SafetensorsFile q = io::SafetensorsFile::open(b + "/model/model.safetensors");
  ASSERT_EQ(p.names(), q.names());
  for (const std::string& name : p.names()) {
    const OwnedTensor u = io::read_tensor(p, name, DType::f32), v = io::read_tensor(q, name, DType::f32);
    ASSERT_EQ(u.tensor.numel(), v.tensor.numel()) << name;
    int64_t differing = 0;
    for (int64_t i = 0; i < u.tensor.numel(); ++i) differing += u.tensor.data<float>()[i] != v.tensor.data<float>()[i];
    EXPECT_EQ(differing, 0) << name;
  }
}

// ZeRO-2's comparison: everything bit for bit (every step's loss, learning rate and tokens,
// every final weight) but the gradient norm, summed per shard and then over the ranks:
// within `tolerance` relative.
void PipelineTrainer::expect_same_but_the_norm(const std::string& a, const std::string& b, double tolerance) {
  const std::vector<TrainRecord> x = train_records(a), y = train_records(b);
  ASSERT_EQ(x.size(), y.size());
  ASSERT_FALSE(x.empty());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i].tokens, y[i].tokens) << "step " << x[i].step;
    EXPECT_EQ(x[i].lr, y[i].lr) << "step " << x[i].step;
    EXPECT_EQ(x[i].loss, y[i].loss) << "step " << x[i].step;
    const double u = x[i].grad_norm.get<double>(), v = y[i].grad_norm.get<double>();
    EXPECT_LE(std::abs(u - v), tolerance * v) << "step " << x[i].step;
  }
  EXPECT_EQ(read_file(a + "/model/model.safetensors"), read_file(b + "/model/model.safetensors"));
}

// The last logged step's expert loads and QK-Clip figures of `run` equal `reference`'s; the
// routers' loss sums within 1e-12 (they add per stage, then over the stages: not the one
// process's order).
void expect_same_moe_and_clip_logs(const std::string& reference, const std::string& run) {
  const std::vector<nlohmann::json> a = metrics_of_kind(reference, "train"), b = metrics_of_kind(run, "train");
  ASSERT_EQ(a.size(), b.size());
  for (const char* key : {"moe.0.load_max", "moe.7.load_max", "attn.0.max_logit", "attn.7.clipped"}) {
    ASSERT_TRUE(a.back().contains(key)) << a.back().dump();
    EXPECT_EQ(b.back()[key], a.back()[key]) << key;
  }
  const double x = a.back()["moe_aux"].get<double>(), y = b.back()["moe_aux"].get<double>();
  EXPECT_LE(std::abs(x - y), 1e-12 * std::abs(x)) << x << " vs " << y;
}

}  // namespace

TEST_F(PipelineTrainer, EveryScheduleOverTwoStagesTrainsBitwiseAsOneProcess) { check_every_schedule(2); }

TEST_F(PipelineTrainer, EveryScheduleOverFourStagesTrainsBitwiseAsOneProcess) { check_every_schedule(4); }

// ZeRO over a pipeline's ranks: 2 stages with dist.zero = 1 and 2 against one process. Each
// parameter's gradient comes from one stage's rank, the other adding zeros, so the sum (the
// all-reduce, or ZeRO-2's reduce-scatter) is exact in any order, and each rank updates its
// shard as the one process does. ZeRO-1: losses, gradient norms and weights bit for bit.
// ZeRO-2: losses and weights bit for bit; its gradient norm is summed per shard and then
// over the ranks, so within 1e-12 relative (its steps before the resume below too). (ZeRO-2 hung here in its second step while the
// pipeline's transfers shared the gradients' Gloo context: ProcessGroup::pipeline.) Then
// ZeRO-2's sharded checkpoint at step 4 of an 8-step run, killed at step 5, resumes in one
// process (the optimizer state gathered whole) with the uninterrupted run's losses and
// weights, bit for bit.
TEST_F(PipelineTrainer, ZeroOverTheStagesRanksTrainsAsOneProcess) {
  std::string output;
  const std::string one = dir_ + "/one";
  ASSERT_EQ(run_with_fault(single(one), "", &output), 0) << output;
  for (int zero : {1, 2}) {
    SCOPED_TRACE(fmt::format("ZeRO-{}", zero));
    const std::string out = fmt::format("{}/zero{}", dir_, zero);
    ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", out, fmt::format("--set dist.zero={} ", zero)), "", &output), 0)
        << output;
    EXPECT_CONTAINS(output, fmt::format("ZeRO-{}: rank 0 updates ", zero));
    if (zero == 1) expect_identical(out, one);
    else expect_same_but_the_norm(out, one);
  }
  const std::string eight = "--set train.steps=8 ";
  const std::string straight = dir_ + "/straight", moved = dir_ + "/moved";
  ASSERT_EQ(run_with_fault(single(straight, eight), "", &output), 0) << output;
  ASSERT_NE(run_with_fault(pipeline(2, "1f1b", moved, eight + "--set dist.zero=2 "), "kill_at_step:5", &output), 0)
      << output;
  EXPECT_EQ(latest_of(moved), "step-00000004");
  ASSERT_EQ(run_with_fault(single(moved, eight + "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(moved, 4) + " at step 4");
  expect_same_but_the_norm(moved, straight);
}

// dist.pipeline_activations = recompute: each stage keeps its input only and runs its forward
// again before the backward; the same kernels on the same inputs, so bit for bit again.
TEST_F(PipelineTrainer, RecomputedStagesTrainBitwiseAsOneProcess) {
  std::string output;
  const std::string one = dir_ + "/one", out = dir_ + "/recompute";
  ASSERT_EQ(run_with_fault(single(one), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", out, "--set dist.pipeline_activations=recompute "), "", &output), 0)
      << output;
  EXPECT_CONTAINS(output, "each stage's forward recomputed before its backward");
  expect_identical(out, one);
}

// A tied head (model.tie_embeddings = true, the default config's) over 2 stages (1F1B), 3
// stages (GPipe) and 4 stages interleaved on 2 ranks, against one process; 2 stages x 2
// replicas against 2 data-parallel ranks; MoE layers with QK-Clip under Muon over 2 stages.
// The table's gradient comes from the first stage (lookup) and the last (head), on two
// ranks; the step's all-reduce sums the two shares, and the norm counts the table once (a
// table counted twice, or one rank's share alone, would miss the norm by far more than the
// tolerance). Within rounding, not bitwise: one process adds head and lookup micro-batch
// after micro-batch, the ranks each their own share over the micro-batches and then the
// two shares.
TEST_F(PipelineTrainer, ATiedHeadTrainsAsOneProcessWithinRounding) {
  std::string output;
  const std::string tied = "--set model.tie_embeddings=true ";
  const std::string one = dir_ + "/one", ddp = dir_ + "/ddp";
  ASSERT_EQ(run_with_fault(single(one, tied), "", &output), 0) << output;
  const std::vector<std::pair<int, std::string>> runs = {{2, "1f1b"}, {3, "gpipe"}, {2, "interleaved"}};
  for (const auto& [stages, schedule] : runs) {
    SCOPED_TRACE(fmt::format("{} stages, {}", stages, schedule));
    const std::string out = fmt::format("{}/tied-{}-{}", dir_, stages, schedule);
    ASSERT_EQ(run_with_fault(pipeline(stages, schedule, out, tied), "", &output), 0) << output;
    EXPECT_CONTAINS(read_file(out + "/rank-1.log"), "; this rank runs stage 1");
    expect_close(out, one);
  }
  ASSERT_EQ(run_with_fault(data_parallel(ddp, tied), "", &output), 0) << output;
  const std::string grid = dir_ + "/tied-2x2";
  ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", grid, tied, 2), "", &output), 0) << output;
  expect_close(grid, ddp);
  const std::string sparse_one = dir_ + "/tied-sparse-one", sparse_two = dir_ + "/tied-sparse-two";
  ASSERT_EQ(run_with_fault(single(sparse_one, tied + kSparse), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", sparse_two, tied + kSparse), "", &output), 0) << output;
  expect_close(sparse_two, sparse_one);
}

// MoE layers (sigmoid-bias router: its balancing bias follows the step's expert loads,
// summed over the stages) and QK-Clip (each head's largest logit, the max over the stages)
// with Muon: the step statistics of the layers a rank does not run are the reduction's
// neutral values, so every rank acts on the whole step's.
TEST_F(PipelineTrainer, MoeAndQkClipTrainBitwiseAsOneProcess) {
  std::string output;
  const std::string& sparse = kSparse;
  const std::string one = dir_ + "/one", two = dir_ + "/two";
  ASSERT_EQ(run_with_fault(single(one, sparse), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", two, sparse), "", &output), 0) << output;
  expect_identical(two, one);
  expect_same_moe_and_clip_logs(one, two);
  // ZB-H1's split backward over 4 stages: the routers, experts and norms at B, the
  // projections at W.
  const std::string zb = dir_ + "/zb";
  ASSERT_EQ(run_with_fault(pipeline(4, "zb_h1", zb, sparse), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "backward split: ");
  expect_identical(zb, one);
  expect_same_moe_and_clip_logs(one, zb);
}

// train.precision = fp8_tensorwise (the CPU's emulation): ZB-H1's weight passes read the
// operands the whole backward would -- the kept FP8 inputs, the copied dy -- so 2 stages
// train bit for bit as one process, dense and with an MoE shared expert (its down
// projection's one-call dgrad and wgrad), with the inputs kept and without.
TEST_F(PipelineTrainer, Fp8ZeroBubbleSplitTrainsBitwiseAsOneProcess) {
  std::string output;
  const std::string shared = "--set model.mlp=moe --set model.moe.shared_hidden=64 ";
  for (const std::string& extra : {std::string(), shared, shared + "--set train.fp8_keep_inputs=false "}) {
    SCOPED_TRACE(extra);
    const std::string fp8 = "--set train.precision=fp8_tensorwise " + extra;
    const std::string one = dir_ + "/one-fp8", zb = dir_ + "/zb-fp8";
    std::filesystem::remove_all(one), std::filesystem::remove_all(zb);
    ASSERT_EQ(run_with_fault(single(one, fp8), "", &output), 0) << output;
    ASSERT_EQ(run_with_fault(pipeline(2, "zb_h1", zb, fp8), "", &output), 0) << output;
    EXPECT_CONTAINS(output, "fp8_tensorwise GEMMs");
    EXPECT_CONTAINS(output, "backward split: ");
    expect_identical(zb, one);
  }
}

// dist.pipeline_costs = measure: rank 0 times the layers, plans the split, prints its
// predicted balance and sends the split to rank 1; any split trains bitwise as one process.
TEST_F(PipelineTrainer, MeasuredCostsPlanOneSplitForEveryRank) {
  std::string output;
  const std::string one = dir_ + "/one", two = dir_ + "/measured";
  ASSERT_EQ(run_with_fault(single(one), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", two, "--set dist.pipeline_costs=measure "), "", &output), 0) << output;
  expect_identical(two, one);
  const std::string& rank0 = output;  // rank 0's console is the launch's; the others' go to their logs
  const std::string rank1 = read_file(two + "/rank-1.log");
  EXPECT_CONTAINS(rank0, "split planned from measured costs (dist.pipeline_costs):");
  EXPECT_CONTAINS(rank0, "time: measured ms per micro-batch on cpu");
  EXPECT_CONTAINS(rank1, "; this rank runs stage 1");
  EXPECT_EQ(rank1.find("split planned from measured costs"), std::string::npos) << rank1;
  // Both ranks run the same split: the layers line is the same on both.
  const auto layers = [](const std::string& log) {
    const size_t at = log.find("), layers ");
    return at == std::string::npos ? std::string() : log.substr(at, log.find(';', at) - at);
  };
  EXPECT_FALSE(layers(rank0).empty()) << rank0;
  EXPECT_EQ(layers(rank0), layers(rank1));
}

// 12 steps in one process, against: 2 stages cut at layer 3, killed at the start of step 5
// (checkpoint at 4); resumed as 2 stages cut at layer 6 (another split), killed at step 9
// (checkpoint at 8); resumed in one process to the end. Bit for bit.
TEST_F(PipelineTrainer, ACheckpointResumesInOneProcessAndAtAnotherSplit) {
  std::string output;
  const std::string twelve = "--set train.steps=12 ";
  const std::string straight = dir_ + "/straight", moved = dir_ + "/moved";
  ASSERT_EQ(run_with_fault(single(straight, twelve), "", &output), 0) << output;
  ASSERT_NE(run_with_fault(pipeline(2, "1f1b", moved, twelve + "--set dist.pipeline_split=0,3"), "kill_at_step:5",
                           &output),
            0)
      << output;
  EXPECT_EQ(latest_of(moved), "step-00000004");
  ASSERT_NE(run_with_fault(pipeline(2, "zb_h1", moved, twelve + "--set dist.pipeline_split=0,6 --resume"),
                           "kill_at_step:9", &output),
            0)
      << output;
  EXPECT_CONTAINS(output, "layers 0..5, 6..7; this rank runs stage 0");
  EXPECT_EQ(latest_of(moved), "step-00000008");
  ASSERT_EQ(run_with_fault(single(moved, twelve + "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(moved, 8) + " at step 8");
  expect_identical(moved, straight);
}

// A pipeline checkpoint under data parallelism: 2 stages killed at step 5 (checkpoint at 4,
// one data rank of 4 micro-batches), resumed on 2 data-parallel ranks, which keep the
// global batch at 2 micro-batches each. Equal to the uninterrupted run within 1e-5: the
// data-parallel sum over the ranks adds in another order than one process's accumulation.
TEST_F(PipelineTrainer, ACheckpointResumesUnderDataParallelism) {
  std::string output;
  const std::string straight = dir_ + "/straight", moved = dir_ + "/moved";
  ASSERT_EQ(run_with_fault(single(straight, "--set train.steps=8"), "", &output), 0) << output;
  ASSERT_NE(run_with_fault(pipeline(2, "gpipe", moved, "--set train.steps=8"), "kill_at_step:5", &output), 0) << output;
  EXPECT_EQ(latest_of(moved), "step-00000004");
  const std::string ddp = single(moved, "--set train.steps=8 --resume");
  ASSERT_EQ(run_with_fault(fmt::format("{} launch --nproc 2 --grace 20 -- {}", kiln_binary(),
                                       ddp.substr(kiln_binary().size() + 1)),
                           "", &output),
            0)
      << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(moved, 4) + " at step 4");
  EXPECT_CONTAINS(output, "train.grad_accum 4 -> 2");
  const std::vector<TrainRecord> x = train_records(moved), y = train_records(straight);
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i].tokens, y[i].tokens) << "step " << x[i].step;
    const double a = x[i].loss.get<double>(), b = y[i].loss.get<double>();
    EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(b)) << "step " << x[i].step;
  }
}

// Pipeline x data parallel: 2 stages x 2 replicas (4 ranks; stage = rank / 2, replica =
// rank % 2) against 2 data-parallel ranks over the same data and global batch (2 x
// grad_accum 4 micro-batches). Bit for bit: replica r reads data rank r's micro-batches and
// its stages accumulate them as that rank does (the bitwise pipeline = one process tests
// above), so before the all-reduce replica r's stages hold, between them, rank r's
// gradient, and zeros elsewhere. The all-reduce over 4 ranks then adds a, 0, b, 0 in some
// order: any order gives a + b exactly (x + 0 = x, a + b = b + a), the 2 ranks' sum; the
// loss sums likewise (the main loss from the last stages only), and the target counts
// summed over all 4 are each replica's twice, divided exactly.
TEST_F(PipelineTrainer, TwoStagesByTwoReplicasTrainBitwiseAsTwoDataParallelRanks) {
  std::string output;
  const std::string ddp = dir_ + "/ddp";
  ASSERT_EQ(run_with_fault(data_parallel(ddp), "", &output), 0) << output;
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved", "zb_h1"}) {
    SCOPED_TRACE(schedule);
    const std::string out = dir_ + "/2x2-" + schedule;
    ASSERT_EQ(run_with_fault(pipeline(2, schedule, out, "", 2), "", &output), 0) << output;
    EXPECT_CONTAINS(output, "x 2 data-parallel replicas (stage = rank / 2, replica = rank % 2): this rank is replica 0");
    EXPECT_CONTAINS(output, "data: rank 0 of 2");
    // Rank 1: stage 0 of replica 1; rank 2: stage 1 of replica 0 (interleaved: also 2 and 3).
    EXPECT_CONTAINS(read_file(out + "/rank-1.log"), "this rank runs stage 0");
    EXPECT_CONTAINS(read_file(out + "/rank-1.log"), "this rank is replica 1");
    EXPECT_CONTAINS(read_file(out + "/rank-2.log"), "this rank runs stage 1");
    EXPECT_CONTAINS(read_file(out + "/rank-2.log"), "this rank is replica 0");
    expect_identical(out, ddp);
  }
}

// 2 stages x 3 replicas (6 ranks) against 3 data-parallel ranks (3 x grad_accum 4). Each
// replica's gradient is its data rank's, bit for bit, but the all-reduce over 6 ranks may add
// the three nonzero terms in another order than the 3 ranks' (a + b + c is not associative):
// close, and not bitwise (losses and gradient norms differ in their last digits).
TEST_F(PipelineTrainer, TwoStagesByThreeReplicasTrainAsThreeDataParallelRanks) {
  std::string output;
  const std::string ddp = dir_ + "/ddp3", grid = dir_ + "/2x3";
  ASSERT_EQ(run_with_fault(data_parallel(ddp, "", 3), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", grid, "", 3), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "x 3 data-parallel replicas (stage = rank / 3, replica = rank % 3): this rank is replica 0");
  EXPECT_CONTAINS(read_file(grid + "/rank-5.log"), "this rank runs stage 1");
  EXPECT_CONTAINS(read_file(grid + "/rank-5.log"), "this rank is replica 2");
  EXPECT_CONTAINS(read_file(grid + "/rank-5.log"), "data: rank 2 of 3");
  expect_close(grid, ddp);
}

// ZeRO over pipeline x data parallel: 2 stages x 2 replicas (4 ranks, 1F1B) with dist.zero =
// 1 and 2, against 2 data-parallel ranks without ZeRO over the same data and global batch.
// The optimizer state (and with 2 the gradients) is sharded over all 4 ranks, and the sum
// over them -- ZeRO-1's all-reduce, ZeRO-2's reduce-scatter into each rank's shard -- adds
// each gradient's a, 0, b, 0 in some order: a + b exactly, the 2 ranks' sum (as in
// TwoStagesByTwoReplicasTrainBitwiseAsTwoDataParallelRanks), and each rank updates its
// shard as every data-parallel rank updates the whole. So every step's loss, learning
// rate and tokens and every final weight bit for bit, and ZeRO-1's gradient norms too.
// ZeRO-2's norm is summed per shard and then over the 4 ranks (not the whole gradient's
// order): within 1e-13 relative (measured: 1.0e-14 at most). The
// same under ZeRO-2 with int8 AdamW moments (optim.adamw_state = int8) and with Muon, each
// against 2 data-parallel ranks with the same optimizer. A pipeline's gradients are summed
// in one reduction after the schedule, not in buckets during backward; dist.bucket_mb only
// cuts ZeRO's reduce-scatter and all-gather into rounds: small ones change no bit.
TEST_F(PipelineTrainer, ZeroOverTwoByTwoTrainsAsTwoDataParallelRanks) {
  std::string output;
  const std::string int8 = "--set optim.adamw_state=int8 ", muon = "--set optim.name=muon ";
  const std::string ddp = dir_ + "/ddp", ddp_int8 = dir_ + "/ddp-int8", ddp_muon = dir_ + "/ddp-muon";
  ASSERT_EQ(run_with_fault(data_parallel(ddp), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(data_parallel(ddp_int8, int8), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(data_parallel(ddp_muon, muon), "", &output), 0) << output;
  struct Case {
    const char* name;
    int zero;
    std::string extra;
    const std::string& reference;
  };
  const std::vector<Case> cases = {{"zero1", 1, "", ddp},
                                   {"zero2", 2, "", ddp},
                                   {"zero2-buckets", 2, "--set dist.bucket_mb=0.004 ", ddp},
                                   {"zero2-int8", 2, int8, ddp_int8},
                                   {"zero2-muon", 2, muon, ddp_muon}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string out = dir_ + "/2x2-" + c.name;
    ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", out, c.extra + fmt::format("--set dist.zero={} ", c.zero), 2), "",
                             &output),
              0)
        << output;
    EXPECT_CONTAINS(output, "x 2 data-parallel replicas (stage = rank / 2, replica = rank % 2): this rank is replica 0");
    EXPECT_CONTAINS(output, "in one reduction after backward");
    EXPECT_CONTAINS(read_file(out + "/rank-3.log"), fmt::format("ZeRO-{}: rank 3 updates ", c.zero));
    if (c.zero == 1) expect_identical(out, c.reference);
    else expect_same_but_the_norm(out, c.reference, 1e-13);
  }
}

// 4 stages x 2 replicas (8 ranks; stage = rank / 2, replica = rank % 2) against 2
// data-parallel ranks: each gradient's sum over 8 ranks adds a, b and six zeros, a + b
// exactly in any order, so bit for bit, as 2 x 2 (1F1B). And ZB-H1 (its backward split)
// with ZeRO-2 sharded over the 8 ranks: losses, learning rates, tokens and weights bit for
// bit, the norm (summed per shard, then over the ranks) within 1e-13 relative (measured:
// 1.1e-14 at most).
TEST_F(PipelineTrainer, FourStagesByTwoReplicasTrainAsTwoDataParallelRanks) {
  std::string output;
  const std::string ddp = dir_ + "/ddp", grid = dir_ + "/4x2", zero = dir_ + "/4x2-zero2";
  ASSERT_EQ(run_with_fault(data_parallel(ddp), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(pipeline(4, "1f1b", grid, "", 2), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "pipeline: 4 stages on 4 ranks (");
  EXPECT_CONTAINS(output, "x 2 data-parallel replicas (stage = rank / 2, replica = rank % 2): this rank is replica 0");
  // Rank 5: stage 2 of replica 1; rank 6: stage 3 of replica 0.
  EXPECT_CONTAINS(read_file(grid + "/rank-5.log"), "this rank runs stage 2");
  EXPECT_CONTAINS(read_file(grid + "/rank-5.log"), "this rank is replica 1");
  EXPECT_CONTAINS(read_file(grid + "/rank-5.log"), "data: rank 1 of 2");
  EXPECT_CONTAINS(read_file(grid + "/rank-6.log"), "this rank runs stage 3");
  EXPECT_CONTAINS(read_file(grid + "/rank-6.log"), "this rank is replica 0");
  expect_identical(grid, ddp);
  ASSERT_EQ(run_with_fault(pipeline(4, "zb_h1", zero, "--set dist.zero=2 ", 2), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "backward split: ");
  EXPECT_CONTAINS(read_file(zero + "/rank-7.log"), "ZeRO-2: rank 7 updates ");
  expect_same_but_the_norm(zero, ddp, 1e-13);
}

// MoE and QK-Clip under 2 x 2 against 2 data-parallel ranks: the expert loads summed and
// the logits' max taken over all 4 ranks (a stage's other layers add the neutral values)
// are the 2 ranks'.
TEST_F(PipelineTrainer, MoeAndQkClipOverTwoByTwoTrainBitwiseAsTwoDataParallelRanks) {
  std::string output;
  const std::string ddp = dir_ + "/ddp", grid = dir_ + "/2x2";
  ASSERT_EQ(run_with_fault(data_parallel(ddp, kSparse), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", grid, kSparse, 2), "", &output), 0) << output;
  expect_identical(grid, ddp);
  expect_same_moe_and_clip_logs(ddp, grid);
}

// A 2 x 2 checkpoint at another layout: 12 steps on 2 data-parallel ranks, against: 2 x 2
// killed at step 5 (checkpoint at 4); resumed as 2 data-parallel ranks (the same global
// batch), killed at step 9 (checkpoint at 8); resumed in one process (grad_accum 4 -> 8
// keeps the global batch) to the end. The 2-rank stretch is bitwise (the test above); the
// one-process steps sum the 8 micro-batches in another order: within 1e-5.
TEST_F(PipelineTrainer, ATwoByTwoCheckpointResumesAsDataParallelAndInOneProcess) {
  std::string output;
  const std::string twelve = "--set train.steps=12 ";
  const std::string straight = dir_ + "/straight", moved = dir_ + "/moved";
  ASSERT_EQ(run_with_fault(data_parallel(straight, twelve), "", &output), 0) << output;
  ASSERT_NE(run_with_fault(pipeline(2, "1f1b", moved, twelve, 2), "kill_at_step:5", &output), 0) << output;
  EXPECT_EQ(latest_of(moved), "step-00000004");
  ASSERT_NE(run_with_fault(data_parallel(moved, twelve + "--resume"), "kill_at_step:9", &output), 0) << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(moved, 4) + " at step 4");
  EXPECT_EQ(latest_of(moved), "step-00000008");
  ASSERT_EQ(run_with_fault(single(moved, twelve + "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "train.grad_accum 4 -> 8");
  const std::vector<TrainRecord> x = train_records(moved), y = train_records(straight);
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i].tokens, y[i].tokens) << "step " << x[i].step;
    const double a = x[i].loss.get<double>(), b = y[i].loss.get<double>();
    if (x[i].step <= 8) EXPECT_EQ(a, b) << "step " << x[i].step;
    else EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(b)) << "step " << x[i].step;
  }
}

// 3 ranks for 2 stages: refused before anything is read, naming the key.
// dist.pipeline_model = "stages": each rank builds only its stages' layers. With the clip
// off (the norm, summed over the ranks' parts, differs from one arena's in its last bits,
// and the clip's factor would carry that into the weights), every schedule trains as one
// process: losses and final weights bit for bit, the norm within 1e-12 relative. The
// ranks' parameter counts add up to the model's.
TEST_F(PipelineTrainer, ModelsBuiltPerStageTrainAsOneProcess) {
  std::string output;
  const std::string unclipped = "--set optim.grad_clip=0 ";
  const std::string one = dir_ + "/one";
  ASSERT_EQ(run_with_fault(single(one, unclipped), "", &output), 0) << output;
  const std::vector<std::pair<int, std::string>> runs = {{2, "1f1b"}, {3, "gpipe"}, {4, "interleaved"}, {2, "zb_h1"}};
  for (const auto& [ranks, schedule] : runs) {
    SCOPED_TRACE(fmt::format("{} ranks, {}", ranks, schedule));
    const std::string out = fmt::format("{}/stages-{}-{}", dir_, ranks, schedule);
    ASSERT_EQ(run_with_fault(pipeline(ranks, schedule, out, unclipped + "--set dist.pipeline_model=stages "), "",
                             &output),
              0)
        << output;
    int64_t whole = 0, sum = 0;
    for (int r = 0; r < ranks; ++r) {
      const std::string log = r == 0 ? output : read_file(fmt::format("{}/rank-{}.log", out, r));
      const size_t at = log.find("it builds only its stages' layers: ");
      ASSERT_NE(at, std::string::npos) << log;
      long long mine = 0, all = 0;
      ASSERT_EQ(std::sscanf(log.c_str() + at, "it builds only its stages' layers: %lld of the model's %lld", &mine, &all),
                2);
      EXPECT_LT(mine, all);
      whole = all;
      sum += mine;
    }
    EXPECT_EQ(sum, whole);
    expect_same_but_the_norm(out, one);
  }
}

// A tied head, MoE layers (sigmoid-bias router, aux loss) and QK-Clip under Muon, with
// validation and a sample every 3 steps: models built per stage against whole models in
// the same pipeline (2 stages, clip off as above). The table's two shares are swapped and
// added (a + b on both ranks, as the whole models' all-reduce adds them); each layer's
// router loads and logits act on its own rank, and rank 0's log gathers them; validation
// runs through the stages; rank 0 samples from a whole model put together from the stages'
// weights. Bit for bit but the norm, the validation losses within 1e-12 (the batches' sums
// add in another order), the samples' text the same.
TEST_F(PipelineTrainer, ModelsBuiltPerStageTrainAsWholeModelsWithATiedHeadAndMoe) {
  std::string output;
  const std::string extra = kSparse +
                            "--set model.tie_embeddings=true --set optim.grad_clip=0 --set data.val_fraction=0.1 "
                            "--set train.eval_batches=4 --set train.eval_every=3 --set train.sample_tokens=24 "
                            "--set train.sample_every=3 --set eval.texts=" + corpus_ + " --set eval.limit=2 "
                            "--set eval.every=3 ";
  const std::string whole = dir_ + "/whole", stages = dir_ + "/stages";
  ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", whole, extra), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", stages, extra + "--set dist.pipeline_model=stages "), "", &output), 0)
      << output;
  EXPECT_CONTAINS(output, "it builds only its stages' layers: ");
  expect_same_but_the_norm(stages, whole);
  expect_same_moe_and_clip_logs(whole, stages);  // rank 0's log holds stage 1's layers too
  const std::vector<nlohmann::json> a = metrics_of_kind(whole, "validation"), b = metrics_of_kind(stages, "validation");
  ASSERT_GE(a.size(), 2u);  // step 3, and the end of the run
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i]["loss"].get<double>(), y = b[i]["loss"].get<double>();
    EXPECT_TRUE(std::isfinite(x));
    EXPECT_LE(std::abs(x - y), 1e-12 * std::abs(x)) << "validation " << i << ": " << x << " vs " << y;
  }
  const std::vector<nlohmann::json> c = metrics_of_kind(whole, "sample"), d = metrics_of_kind(stages, "sample");
  ASSERT_GE(c.size(), 2u);  // step 3, and the end of the run
  ASSERT_EQ(c.size(), d.size());
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(d[i]["text"], c[i]["text"]) << "sample " << i;
  // The evaluation suite (a text's perplexity) on rank 0's whole model: the same numbers.
  const std::vector<nlohmann::json> e = metrics_of_kind(whole, "eval"), f = metrics_of_kind(stages, "eval");
  ASSERT_GE(e.size(), 2u);
  ASSERT_EQ(e.size(), f.size());
  for (size_t i = 0; i < e.size(); ++i) {
    nlohmann::json x = e[i], y = f[i];
    x.erase("seconds"), y.erase("seconds"), x.erase("elapsed_seconds"), y.erase("elapsed_seconds");
    EXPECT_EQ(y, x) << "evaluation " << i;
  }
}

// Models built per stage with data-parallel replicas: 2 stages x 2 replicas against 2
// data-parallel ranks over the same global batch, dense and with MoE layers and QK-Clip under
// Muon (clip off, as above). Each stage's gradients and step statistics are summed over its
// two replicas (a + b, the data-parallel ranks' sum), so bit for bit but the norm. Then a
// 2 x 2 checkpoint (replica 1's optimizer files empty) resumes on 2 data-parallel ranks,
// matching 12 uninterrupted steps of them the same way.
TEST_F(PipelineTrainer, ModelsBuiltPerStageWithReplicasTrainAsDataParallelRanks) {
  std::string output;
  const std::string unclipped = "--set optim.grad_clip=0 ", stages = "--set dist.pipeline_model=stages ";
  for (const std::string& extra : {std::string(), kSparse}) {
    SCOPED_TRACE(extra);
    const std::string ddp = dir_ + "/ddp", grid = dir_ + "/grid";
    std::filesystem::remove_all(ddp), std::filesystem::remove_all(grid);
    ASSERT_EQ(run_with_fault(data_parallel(ddp, unclipped + extra), "", &output), 0) << output;
    ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", grid, unclipped + extra + stages, 2), "", &output), 0) << output;
    EXPECT_CONTAINS(output, "it builds only its stages' layers: ");
    EXPECT_CONTAINS(output, "this rank is replica 0");
    expect_same_but_the_norm(grid, ddp);
  }
  const std::string twelve = unclipped + "--set train.steps=12 ";
  const std::string straight = dir_ + "/straight", moved = dir_ + "/moved";
  ASSERT_EQ(run_with_fault(data_parallel(straight, twelve), "", &output), 0) << output;
  ASSERT_NE(run_with_fault(pipeline(2, "1f1b", moved, twelve + stages, 2), "kill_at_step:5", &output), 0) << output;
  EXPECT_EQ(latest_of(moved), "step-00000004");
  ASSERT_EQ(run_with_fault(data_parallel(moved, twelve + "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(moved, 4) + " at step 4");
  expect_same_but_the_norm(moved, straight);
}

// ZeRO over models built per stage: 2 stages x 2 replicas, each stage's optimizer state
// (and with ZeRO-2 its gradients) sharded over its two replicas, against 2 data-parallel
// ranks without ZeRO (clip off, as above): ZeRO-1 and ZeRO-2 with AdamW, int8 AdamW moments
// and Muon, and ZeRO-2 in rounds of 0.004 MiB (dist.bucket_mb: the all-gather buffer that
// small). Each sum over the replicas adds two gradients (a + b: the same bits in either
// order, all-reduce or reduce-scatter) and each replica updates its shard as a data-parallel
// rank updates the whole, so bit for bit but the norm. A rank updates about half of its
// stage's parameters, and its stage's two shards cover them. A tied head with MoE layers and
// QK-Clip under Muon: ZeRO-2 against the same stage models without ZeRO (the table's shares
// swapped before the replicas' sum in both, then sharded differently in the first and the
// last stage's pair: the same updates). Then a checkpoint moves across layouts: 2 x 2 with
// ZeRO-2 killed at step 5 (checkpoint at 4: every rank's shard file), resumed as 2 x 2 with
// ZeRO-1 at another split under ZB-H1, killed at step 9, resumed on 2 data-parallel ranks
// to the end: the 12 uninterrupted data-parallel steps, bit for bit but the norm.
TEST_F(PipelineTrainer, ModelsBuiltPerStageShardTheirStateOverTheirReplicas) {
  std::string output;
  const std::string unclipped = "--set optim.grad_clip=0 ", stages = "--set dist.pipeline_model=stages ";
  const std::string int8 = "--set optim.adamw_state=int8 ", muon = "--set optim.name=muon ";
  struct Case {
    const char* name;
    int zero;
    std::string extra;
  };
  const std::vector<Case> cases = {{"zero1", 1, ""},
                                   {"zero2", 2, ""},
                                   {"zero2-rounds", 2, "--set dist.bucket_mb=0.004 "},
                                   {"zero2-int8", 2, int8},
                                   {"zero2-muon", 2, muon}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string ddp = dir_ + "/ddp-" + c.name, grid = dir_ + "/grid-" + c.name;
    ASSERT_EQ(run_with_fault(data_parallel(ddp, unclipped + c.extra), "", &output), 0) << output;
    ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", grid, unclipped + c.extra + stages +
                                                           fmt::format("--set dist.zero={} ", c.zero), 2),
                             "", &output),
              0)
        << output;
    expect_same_but_the_norm(grid, ddp);
    for (int stage = 0; stage < 2; ++stage) {  // ranks 2s and 2s + 1: the stage's two replicas
      int64_t updated = 0, held = 0;
      for (int replica = 0; replica < 2; ++replica) {
        const int rank = 2 * stage + replica;
        const std::string log = rank == 0 ? output : read_file(fmt::format("{}/rank-{}.log", grid, rank));
        const size_t built = log.find("it builds only its stages' layers: ");
        const size_t zero = log.find(fmt::format("ZeRO-{}: rank {} updates ", c.zero, rank));
        ASSERT_NE(built, std::string::npos) << log;
        ASSERT_NE(zero, std::string::npos) << log;
        long long mine = 0, whole = 0, updates = 0, of = 0;
        ASSERT_EQ(std::sscanf(log.c_str() + built, "it builds only its stages' layers: %lld of the model's %lld", &mine,
                              &whole),
                  2);
        ASSERT_EQ(std::sscanf(log.c_str() + zero + fmt::format("ZeRO-{}: rank {} updates ", c.zero, rank).size(),
                              "%lld of %lld parameters", &updates, &of),
                  2);
        EXPECT_CONTAINS(log, fmt::format("(its stage's, shard {} of 2 over the stage's replicas)", replica));
        if (c.extra.find("bucket_mb") != std::string::npos) EXPECT_CONTAINS(log, "all-gather buffer 0.0 MiB");
        EXPECT_EQ(of, mine);  // the shards span the stage's parameters, not the model's
        EXPECT_GT(updates, of / 4);
        EXPECT_LT(updates, 3 * of / 4);
        updated += updates;
        held = of;
      }
      EXPECT_EQ(updated, held) << "stage " << stage;
    }
  }
  const std::string tied = unclipped + kSparse + stages + "--set model.tie_embeddings=true ";
  const std::string unsharded = dir_ + "/tied", sharded = dir_ + "/tied-zero2";
  ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", unsharded, tied, 2), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", sharded, tied + "--set dist.zero=2 ", 2), "", &output), 0) << output;
  expect_same_but_the_norm(sharded, unsharded);
  expect_same_moe_and_clip_logs(unsharded, sharded);

  const std::string twelve = unclipped + "--set train.steps=12 ";
  const std::string straight = dir_ + "/straight", moved = dir_ + "/moved";
  ASSERT_EQ(run_with_fault(data_parallel(straight, twelve), "", &output), 0) << output;
  ASSERT_NE(run_with_fault(pipeline(2, "1f1b", moved, twelve + stages + "--set dist.zero=2 ", 2), "kill_at_step:5",
                           &output),
            0)
      << output;
  EXPECT_EQ(latest_of(moved), "step-00000004");
  ASSERT_NE(run_with_fault(pipeline(2, "zb_h1", moved,
                                    twelve + stages + "--set dist.zero=1 --set dist.pipeline_split=0,6 --resume", 2),
                           "kill_at_step:9", &output),
            0)
      << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(moved, 4) + " at step 4");
  EXPECT_EQ(latest_of(moved), "step-00000008");
  ASSERT_EQ(run_with_fault(data_parallel(moved, twelve + "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(moved, 8) + " at step 8");
  expect_same_but_the_norm(moved, straight);
}

// Checkpoints of models built per stage hold the whole model: 12 steps in one process
// against 2 stages cut at layer 3, killed at step 5 (checkpoint at 4); resumed as 2 stages
// cut at layer 6 under ZB-H1, killed at step 9; resumed in one process to the end: bit for
// bit but the norm (clip off, as above). With a tied head (its table and its state saved
// once, by the first stage's rank): one process killed at step 5, resumed as stage models,
// killed at step 9, resumed in one process: within rounding of 12 uninterrupted steps (a
// tied table's two shares add in another order than one process's). And stage models
// started from a saved model (train.init_from), or from its Hugging Face export, train as
// one process started from it.
TEST_F(PipelineTrainer, ModelsBuiltPerStageResumeAcrossSplitsAndIntoOneProcess) {
  std::string output;
  const std::string common = "--set train.steps=12 --set optim.grad_clip=0 ";
  const std::string stages = "--set dist.pipeline_model=stages ";
  const std::string straight = dir_ + "/straight", moved = dir_ + "/moved";
  ASSERT_EQ(run_with_fault(single(straight, common), "", &output), 0) << output;
  ASSERT_NE(run_with_fault(pipeline(2, "1f1b", moved, common + stages + "--set dist.pipeline_split=0,3"),
                           "kill_at_step:5", &output),
            0)
      << output;
  EXPECT_EQ(latest_of(moved), "step-00000004");
  ASSERT_NE(run_with_fault(pipeline(2, "zb_h1", moved, common + stages + "--set dist.pipeline_split=0,6 --resume"),
                           "kill_at_step:9", &output),
            0)
      << output;
  EXPECT_CONTAINS(output, "layers 0..5, 6..7; this rank runs stage 0; it builds only its stages' layers");
  EXPECT_EQ(latest_of(moved), "step-00000008");
  ASSERT_EQ(run_with_fault(single(moved, common + "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(moved, 8) + " at step 8");
  expect_same_but_the_norm(moved, straight);
  // A tied head: one process -> stage models -> one process.
  const std::string tied = common + "--set model.tie_embeddings=true ";
  const std::string tied_straight = dir_ + "/tied-straight", back = dir_ + "/back";
  ASSERT_EQ(run_with_fault(single(tied_straight, tied), "", &output), 0) << output;
  ASSERT_NE(run_with_fault(single(back, tied), "kill_at_step:5", &output), 0) << output;
  ASSERT_NE(run_with_fault(pipeline(2, "1f1b", back, tied + stages + "--resume"), "kill_at_step:9", &output), 0)
      << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(back, 4) + " at step 4");
  EXPECT_EQ(latest_of(back), "step-00000008");
  ASSERT_EQ(run_with_fault(single(back, tied + "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(back, 8) + " at step 8");
  expect_close(back, tied_straight);
  // train.init_from: the saved model of the first run, read by stage models as by one process.
  const std::string from = "--set train.steps=6 --set optim.grad_clip=0 --set train.init_from=" + straight + "/model ";
  const std::string one_from = dir_ + "/one-from", stages_from = dir_ + "/stages-from";
  ASSERT_EQ(run_with_fault(single(one_from, from), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(pipeline(2, "1f1b", stages_from, from + stages), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "init: weights from " + straight + "/model");
  expect_same_but_the_norm(stages_from, one_from);
  // And from Hugging Face folders (`kiln export hf`, float32: the same values): each stage's
  // rank reads its part and leaves the others' tensors. The untied model over 2 stages
  // against one process as above; the tied one over 3 (GPipe: a middle stage without the
  // table, the last stage's table read from embed_tokens) against the same stage models
  // started from its kiln model: bit for bit (a tied table's shares keep one process from
  // matching them bitwise, the test above).
  for (const auto& [source, ranks] : {std::pair{straight, 2}, std::pair{tied_straight, 3}}) {
    const std::string hf = source + "-hf";
    ASSERT_EQ(test::run_command(test::kiln_binary() + " export hf " + source + "/model " + hf, &output), 0) << output;
    const std::string six = std::string("--set train.steps=6 --set optim.grad_clip=0 ") +
                            (source == tied_straight ? "--set model.tie_embeddings=true " : "");
    const std::string reference = source + "-reference", stages_hf = source + "-stages-hf";
    const std::string from_model = six + "--set train.init_from=" + source + "/model ";
    if (source == straight) ASSERT_EQ(run_with_fault(single(reference, from_model), "", &output), 0) << output;
    else ASSERT_EQ(run_with_fault(pipeline(ranks, "gpipe", reference, from_model + stages), "", &output), 0) << output;
    ASSERT_EQ(run_with_fault(pipeline(ranks, "gpipe", stages_hf, six + "--set train.init_from=" + hf + " " + stages),
                             "", &output),
              0)
        << output;
    EXPECT_CONTAINS(output, "init: weights from " + hf + " (Hugging Face ");
    if (source == straight) expect_same_but_the_norm(stages_hf, reference);
    else expect_identical(stages_hf, reference);
  }
}

TEST_F(PipelineTrainer, AWorldNotAMultipleOfTheStagesIsRefused) {
  std::string output;
  EXPECT_NE(run_with_fault(launched(3, single(dir_ + "/three", "--set dist.pipeline_stages=2")), "", &output), 0);
  EXPECT_CONTAINS(output, "dist.pipeline_stages");
  EXPECT_CONTAINS(output, "a multiple of 2 ranks");
}

// kill -9 of rank `victim` of `world` mid-run: every other rank waits on a receive from it
// or on a collective with it, and ends with an error naming it within dist.timeout, saying
// which rank of the run it is itself.
void PipelineTrainer::expect_a_killed_rank_named(int world, int victim, const std::string& extra) {
  const std::string out = dir_ + fmt::format("/killed-{}", world);
  const std::string train = single(out, "--set train.steps=100000 --set dist.timeout=10 --set dist.pipeline_stages=2 "
                                        "--set checkpoint.every=0 " + extra);
  const int port = dist::free_loopback_port();
  std::vector<pid_t> ranks;
  for (int r = 0; r < world; ++r)
    ranks.push_back(spawn(fmt::format("env RANK={} WORLD_SIZE={} MASTER_PORT={} {}", r, world, port, train),
                          fmt::format("{}/rank{}-of-{}.out", dir_, r, world)));
  const auto wait_for = [](const std::string& file, const std::string& text, double seconds) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < deadline) {
      if (std::filesystem::exists(file) && read_file(file).find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  };
  ASSERT_TRUE(wait_for(fmt::format("{}/rank-{}.log", out, victim), "step     3/", 60))
      << read_file(fmt::format("{}/rank0-of-{}.out", dir_, world));
  kill(ranks[static_cast<size_t>(victim)], SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < world; ++r) {
    if (r == victim) continue;
    int status = -1;
    while (std::chrono::steady_clock::now() - start < std::chrono::seconds(40)) {
      int s = 0;
      if (waitpid(ranks[static_cast<size_t>(r)], &s, WNOHANG) == ranks[static_cast<size_t>(r)]) {
        status = WIFEXITED(s) ? WEXITSTATUS(s) : 128 + WTERMSIG(s);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (status == -1) kill(ranks[static_cast<size_t>(r)], SIGKILL), waitpid(ranks[static_cast<size_t>(r)], nullptr, 0);
    const std::string log = read_file(fmt::format("{}/rank{}-of-{}.out", dir_, r, world));
    SCOPED_TRACE(fmt::format("rank {}", r));
    EXPECT_EQ(status, 1) << log;
    EXPECT_LT(seconds, 25) << log;  // dist.timeout = 10, plus the diagnosis
    // A receive from the victim ("the receive 'pipeline rG0@0' (tag 1) from rank 1 failed
    // ...: the connection broke") or a collective naming it by pid, on the run's
    // communicators or a stage's replicas' (whose ranks are numbered from 0: the error says
    // which rank of the run this is).
    EXPECT_CONTAINS(log, fmt::format("kiln: error: [dist] rank {} of {}", r, world));
    EXPECT_CONTAINS(log, fmt::format("rank {}", victim));
    // No survivor is said to have died: each marks itself failed before it exits, a
    // transfer's failure too, whose error adds the run's dead ranks to its peer
    // (RankProgress::diagnose). (A survivor may be named as alive
    // outside the collectives: it has not reached this one.)
    for (int other = 0; other < world; ++other) {
      if (other == victim || other == r) continue;
      const size_t named = log.find(fmt::format("rank {} (pid", other));
      if (named == std::string::npos) continue;
      const std::string clause = log.substr(named, log.find(';', named) - named);
      EXPECT_EQ(clause.find("died or exited"), std::string::npos) << log;
    }
  }
  waitpid(ranks[static_cast<size_t>(victim)], nullptr, 0);
}

// Stage 1 of 2 killed; and the last stage's second replica of 2 x 2 models built per stage
// with ZeRO-2 over each stage's replicas.
TEST_F(PipelineTrainer, AKilledStageEndsTheOtherNamingIt) { expect_a_killed_rank_named(2, 1, ""); }

TEST_F(PipelineTrainer, AKilledReplicaOfAStageEndsTheOthersNamingIt) {
  expect_a_killed_rank_named(4, 3, "--set dist.pipeline_model=stages --set dist.zero=2 ");
}

// The keys' refusals, one line naming the key, before anything is read.
// A pipeline rank's activation frames: the most (micro-batch, stage) pairs it holds at once
// (GPipe: every micro-batch; 1F1B: stages - rank; interleaved: more), none without a
// pipeline or with recompute.
TEST(PipelineConfig, ActivationFramesAreTheRanksMostPairsInFlight) {
  Config c;
  c.model.layers = 8;
  c.train.grad_accum = 8;
  EXPECT_EQ(pipeline_activation_frames(c, 0), 0);
  c.dist.pipeline_stages = 4;
  c.dist.pipeline_schedule = "gpipe";
  EXPECT_EQ(pipeline_activation_frames(c, 0), 8);
  EXPECT_EQ(pipeline_activation_frames(c, 3), 8);
  c.dist.pipeline_schedule = "1f1b";
  for (int r = 0; r < 4; ++r) EXPECT_EQ(pipeline_activation_frames(c, r), 4 - r) << "rank " << r;
  // ZB-H1 holds each pair's frame until its W: 1F1B's rank-0 peak on every rank.
  c.dist.pipeline_schedule = "zb_h1";
  for (int r = 0; r < 4; ++r) EXPECT_EQ(pipeline_activation_frames(c, r), 4) << "rank " << r;
  c.dist.pipeline_schedule = "interleaved";
  c.dist.pipeline_virtual_stages = 2;
  EXPECT_GT(pipeline_activation_frames(c, 0), 4);
  EXPECT_LE(pipeline_activation_frames(c, 0), 16);
  c.dist.pipeline_activations = "recompute";
  EXPECT_EQ(pipeline_activation_frames(c, 0), 0);
}

// Each model stage's micro-batches in flight, for the split planner's memory: its rank's
// frames (interleaved: v stages a rank share its count), 1 each with recompute.
TEST(PipelineConfig, StagesKeepTheirRanksMicroBatchesInFlight) {
  Config c;
  c.model.layers = 8;
  c.train.grad_accum = 8;
  c.dist.pipeline_schedule = "1f1b";
  EXPECT_EQ(pipeline_stage_in_flight(c, 4), (std::vector<int>{4, 3, 2, 1}));
  c.dist.pipeline_schedule = "gpipe";
  EXPECT_EQ(pipeline_stage_in_flight(c, 2), (std::vector<int>{8, 8}));
  c.dist.pipeline_schedule = "interleaved";
  c.dist.pipeline_virtual_stages = 2;
  const std::vector<int> interleaved = pipeline_stage_in_flight(c, 4);  // 2 ranks x 2
  ASSERT_EQ(interleaved.size(), 4u);
  EXPECT_EQ(interleaved[0], interleaved[2]);
  EXPECT_EQ(interleaved[1], interleaved[3]);
  EXPECT_GT(interleaved[0], 2);
  c.dist.pipeline_activations = "recompute";
  EXPECT_EQ(pipeline_stage_in_flight(c, 4), (std::vector<int>{1, 1, 1, 1}));
}

TEST(PipelineConfig, BadKeysAreRefusedNamingTheKey) {
  const auto error = [](const Config& c, int world) -> std::string {
    try {
      check_pipeline_config(c, world, Device::cpu);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  Config base;
  base.model.layers = 4;
  base.model.tie_embeddings = false;
  base.train.grad_accum = 4;
  base.dist.pipeline_stages = 2;
  EXPECT_EQ(error(base, 2), "");
  const auto expect = [&](const std::function<void(Config&)>& change, int world, const std::string& key) {
    Config c = base;
    change(c);
    const std::string e = error(c, world);
    EXPECT_CONTAINS(e, key);
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  };
  expect([](Config&) {}, 1, "dist.pipeline_stages");  // one process
  expect([](Config&) {}, 3, "dist.pipeline_stages");  // not a multiple of the stages
  EXPECT_EQ(error(base, 4), "");                       // 2 stages x 2 replicas
  EXPECT_EQ(error(base, 6), "");                       // x 3
  expect([](Config& c) { c.dist.pipeline_stages = 5; }, 5, "dist.pipeline_stages");  // more stages than layers
  Config tied = base;  // a tied head is pipelined (its table's gradient summed by the step's all-reduce)
  tied.model.tie_embeddings = true;
  EXPECT_EQ(error(tied, 2), "");
  EXPECT_EQ(error(tied, 4), "");
  expect([](Config& c) { c.model.mtp.depth = 1; }, 2, "model.mtp.depth");
  expect([](Config& c) { c.model.moe.balance_scope = "step"; }, 2, "model.moe.balance_scope");
  expect([](Config& c) { c.dist.pipeline_virtual_stages = 2; }, 2, "dist.pipeline_virtual_stages");
  expect([](Config& c) { c.dist.pipeline_split = "0,9"; }, 2, "dist.pipeline_split");
  expect([](Config& c) { c.dist.pipeline_split = "0,1,2"; }, 2, "dist.pipeline_split");
  expect([](Config& c) { c.dist.pipeline_split = "0,x"; }, 2, "dist.pipeline_split");
  expect([](Config& c) {
    c.dist.pipeline_schedule = "interleaved";
    c.dist.pipeline_virtual_stages = 2;
    c.train.grad_accum = 3;
  }, 2, "train.grad_accum");
  expect([](Config& c) {
    c.dist.pipeline_schedule = "interleaved";
    c.dist.pipeline_virtual_stages = 4;  // 8 stages, 4 layers
  }, 2, "dist.pipeline_stages");
  // Off: its other keys must stay at their defaults.
  expect([](Config& c) {
    c.dist.pipeline_stages = 1;
    c.dist.pipeline_split = "0,2";
  }, 1, "dist.pipeline_split");
  expect([](Config& c) {
    c.dist.pipeline_stages = 1;
    c.dist.pipeline_costs = "measure";
  }, 1, "dist.pipeline_costs");
  expect([](Config& c) {
    c.dist.pipeline_stages = 1;
    c.dist.pipeline_activations = "recompute";
  }, 1, "dist.pipeline_activations");
  expect([](Config& c) {
    c.dist.pipeline_stages = 1;
    c.dist.pipeline_model = "stages";
  }, 1, "dist.pipeline_model");
  // Models built per stage: one pipeline, and what needs the whole model refused by key.
  Config stages = base;
  stages.dist.pipeline_model = "stages";
  stages.train.sample_tokens = 0;
  EXPECT_EQ(error(stages, 2), "");
  const auto expect_staged = [&](const std::function<void(Config&)>& change, int world, const std::string& key) {
    expect([&](Config& c) {
      c.dist.pipeline_model = "stages";
      c.train.sample_tokens = 0;
      change(c);
    }, world, key);
  };
  EXPECT_EQ(error(stages, 4), "");  // 2 stages x 2 replicas
  expect_staged([](Config& c) { c.dist.zero = 1; }, 2, "dist.zero");  // one replica: nothing to shard
  for (int zero : {1, 2}) {  // ZeRO over each stage's replicas
    Config sharded = stages;
    sharded.dist.zero = zero;
    EXPECT_EQ(error(sharded, 4), "");
  }

  for (int zero : {1, 2}) {  // ZeRO over the pipeline's ranks
    Config sharded = base;
    sharded.dist.zero = zero;
    EXPECT_EQ(error(sharded, 2), "");
    EXPECT_EQ(error(sharded, 4), "");
  }
  Config recompute = base;
  recompute.dist.pipeline_activations = "recompute";
  EXPECT_EQ(error(recompute, 2), "");
  Config measured = base;  // checked against estimated costs: measuring waits for the run
  measured.dist.pipeline_costs = "measure";
  EXPECT_EQ(error(measured, 2), "");
  Config gpu = base;
  EXPECT_THROW(check_pipeline_config(gpu, 2, Device::cuda), std::exception);
  try {
    check_pipeline_config(gpu, 2, Device::cuda);
  } catch (const std::exception& e) {
    EXPECT_CONTAINS(std::string(e.what()), "train.device");
  }
  // Valid: a given split, every schedule.
  for (const char* schedule : {"gpipe", "1f1b", "zb_h1"}) {
    Config c = base;
    c.dist.pipeline_schedule = schedule;
    c.dist.pipeline_split = "0,1";
    EXPECT_EQ(error(c, 2), "") << schedule;
  }
}
