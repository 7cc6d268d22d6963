// Data-parallel training with real processes on the CPU backend (Gloo): the ranks'
// step equals one process's over the same global batch, every launcher's environment
// starts a run, checkpoints resume at another world size, and a dead, stopped or
// misconfigured rank ends the run with a clear error rather than a hang.
#include "dist/free_port.h"
#include "fault_test_util.h"
#include "io/safetensors.h"

#include <fmt/format.h>

#include <chrono>
#include <fstream>
#include <cmath>
#include <map>
#include <sstream>
#include <thread>

using namespace kiln;
using namespace kiln::test;
using kiln::io::SafetensorsFile;
using kiln::io::read_tensor;

namespace {

// Every rank on one thread: two ranks share CI's two cores, and a bitwise-comparable run
// needs a fixed thread count.
const std::string kOneThread = "--set train.threads=1 ";

class Distributed : public TinyRunTest {
 protected:
  Distributed() : TinyRunTest("kiln_distributed", 300) {}
  // `kiln launch --nproc N -- train ...` for the tiny run, `grad_accum` micro-batches per rank.
  std::string launch(int nproc, const std::string& out, int grad_accum, const std::string& extra = "") const {
    const std::string train = tiny_train(corpus_, out, kOneThread + fmt::format("--set train.grad_accum={} ", grad_accum) + extra);
    return launched(nproc, train);
  }
  std::string single(const std::string& out, int grad_accum, const std::string& extra = "") const {
    return tiny_train(corpus_, out, kOneThread + fmt::format("--set train.grad_accum={} ", grad_accum) + extra);
  }
};

double relative(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

// The largest difference between two runs' final weights, relative to each tensor's largest value.
double weight_difference(const std::string& a_dir, const std::string& b_dir) {
  const SafetensorsFile a = SafetensorsFile::open(a_dir + "/model/model.safetensors");
  const SafetensorsFile b = SafetensorsFile::open(b_dir + "/model/model.safetensors");
  EXPECT_EQ(a.names(), b.names());
  double worst = 0;
  for (const std::string& name : a.names()) {
    const OwnedTensor x = read_tensor(a, name, DType::f32), y = read_tensor(b, name, DType::f32);
    const float* p = x.tensor.data<float>();
    const float* q = y.tensor.data<float>();
    double scale = 1e-30, diff = 0;
    for (int64_t i = 0; i < x.tensor.numel(); ++i) {
      scale = std::max(scale, static_cast<double>(std::abs(q[i])));
      diff = std::max(diff, static_cast<double>(std::abs(p[i] - q[i])));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

// Same steps, losses and gradient norms within `tolerance` (relative): the reduction
// order of the ranks' sum differs from one process's accumulation, so not bitwise.
void expect_same_training(const std::string& a, const std::string& b, double tolerance) {
  const std::vector<TrainRecord> x = train_records(a), y = train_records(b);
  ASSERT_EQ(x.size(), y.size());
  ASSERT_FALSE(x.empty());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i].step, y[i].step);
    EXPECT_EQ(x[i].tokens, y[i].tokens) << "step " << x[i].step;
    EXPECT_EQ(x[i].lr, y[i].lr) << "step " << x[i].step;
    EXPECT_LE(relative(x[i].loss.get<double>(), y[i].loss.get<double>()), tolerance) << "step " << x[i].step;
    EXPECT_LE(relative(x[i].grad_norm.get<double>(), y[i].grad_norm.get<double>()), tolerance) << "step " << x[i].step;
  }
}

}  // namespace

TEST_F(Distributed, TwoAndFourRanksTrainAsOneProcessOverTheSameGlobalBatch) {
  std::string output;
  const std::string one = dir_ + "/one", two = dir_ + "/two", four = dir_ + "/four";
  ASSERT_EQ(run_with_fault(single(one, 4), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(launch(2, two, 2), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "distributed: 2 ranks (torchrun launch, 2 per node), gradients over gloo");
  ASSERT_EQ(run_with_fault(launch(4, four, 1), "", &output), 0) << output;
  expect_same_training(two, one, 1e-5);
  expect_same_training(four, one, 1e-5);
  const double d2 = weight_difference(two, one), d4 = weight_difference(four, one);
  RecordProperty("weights_relative_difference_2", fmt::format("{:.3g}", d2));
  RecordProperty("weights_relative_difference_4", fmt::format("{:.3g}", d4));
  EXPECT_LT(d2, 1e-5);
  EXPECT_LT(d4, 1e-5);
  // Rank 0 alone writes the run's files; the others' console goes to their logs.
  EXPECT_TRUE(std::filesystem::exists(two + "/rank-1.log"));
  EXPECT_CONTAINS(read_file(two + "/rank-1.log"), "this is rank 1");
  EXPECT_FALSE(std::filesystem::exists(two + "/rank-0.log"));
  // One TensorBoard event file, rank 0's.
  int event_files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(four + "/tensorboard"))
    event_files += entry.path().filename().string().find(".tfevents.") != std::string::npos;
  EXPECT_EQ(event_files, 1);
}

// The step's balance loss (model.moe.balance_scope = "step"; docs/moe-routers.md): each
// rank's counting pass sees only its micro-batches, so the counts must be summed over the
// ranks before backward for 2 ranks to train as one process over the same global batch
// (the losses, norms, the logged moe_aux and the weights, to rounding).
std::vector<double> moe_aux_values(const std::string& out_dir) {
  std::vector<double> out;
  std::ifstream in(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train" && j.contains("moe_aux")) out.push_back(j["moe_aux"].get<double>());
  }
  return out;
}

TEST_F(Distributed, TheStepBalanceLossOverTwoRanksEqualsOneProcess) {
  const std::string sparse =
      "--set model.mlp=moe --set model.moe.experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32 "
      "--set model.moe.aux_loss=0.1 --set model.moe.balance_scope=step ";
  std::string output;
  const std::string one = dir_ + "/balance-one", two = dir_ + "/balance-two";
  ASSERT_EQ(run_with_fault(single(one, 4, sparse), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(launch(2, two, 2, sparse), "", &output), 0) << output;
  expect_same_training(two, one, 1e-5);
  EXPECT_LT(weight_difference(two, one), 1e-5);
  const std::vector<double> a = moe_aux_values(two), b = moe_aux_values(one);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LE(relative(a[i], b[i]), 1e-5) << "record " << i;
}

// Buckets reduced during backward (dist.bucket_mb, train/gradient_buckets.h) against one
// reduction after backward, over the same ranks. At 2 ranks each element's sum is a + b in
// either case, so the runs must agree bit for bit; at 4 Gloo's ring adds the ranks in an
// order that depends on where an element falls in the buffer it is given, so the buckets
// may round differently: within 1e-6.
TEST_F(Distributed, BucketsReducedDuringBackwardEqualOneReductionAfterIt) {
  std::string output;
  for (int nproc : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << nproc << " ranks");
    const std::string whole = fmt::format("{}/whole{}", dir_, nproc), bucketed = fmt::format("{}/bucketed{}", dir_, nproc);
    ASSERT_EQ(run_with_fault(launch(nproc, whole, 2, "--set dist.bucket_mb=0"), "", &output), 0) << output;
    // About 4 KiB per bucket: the tiny model's gradients in many buckets.
    ASSERT_EQ(run_with_fault(launch(nproc, bucketed, 2, "--set dist.bucket_mb=0.004"), "", &output), 0) << output;
    const double d = weight_difference(bucketed, whole);
    RecordProperty(fmt::format("bucketed_weights_relative_difference_{}", nproc), fmt::format("{:.3g}", d));
    if (nproc == 2) {
      EXPECT_EQ(d, 0.0);
      expect_same_training(bucketed, whole, 0.0);
    } else {
      EXPECT_LT(d, 1e-6);
      expect_same_training(bucketed, whole, 1e-6);
    }
  }
}

TEST_F(Distributed, ACheckpointResumesAtAnotherWorldSize) {
  // 12 steps in one process, against: 2 ranks killed at the start of step 5 (checkpoint
  // at 4), then 1 process killed at the start of step 9 (checkpoint at 8), then 4 ranks to
  // the end. The data position and the schedule continue exactly.
  std::string output;
  const std::string straight = dir_ + "/straight", moved = dir_ + "/moved";
  ASSERT_EQ(run_with_fault(single(straight, 4), "", &output), 0) << output;
  ASSERT_NE(run_with_fault(launch(2, moved, 2), "kill_at_step:5", &output), 0) << output;
  EXPECT_EQ(latest_of(moved), "step-00000004");
  ASSERT_EQ(run_with_fault(single(moved, 4, "--resume"), "kill_at_step:9", &output), -SIGKILL) << output;
  EXPECT_EQ(latest_of(moved), "step-00000008");
  ASSERT_EQ(run_with_fault(launch(4, moved, 1, "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(moved, 8) + " at step 8");
  expect_same_training(moved, straight, 1e-5);
  EXPECT_LT(weight_difference(moved, straight), 1e-5);
}

// ZeRO-1 (dist.zero = 1) against data parallelism over the same ranks and batch: the
// gradients are summed exactly as before and AdamW's update is elementwise, so updating
// each rank's shard and gathering the shards must give the same weights bit for bit, with
// fp32 and with int8 moments (whose blocks the shards never split).
// dist.bucket_mb = 0.004 (4 KiB) gathers the parameters in many rounds (and reduces the
// gradients in buckets, on both sides alike).
TEST_F(Distributed, ZeroOneTrainsBitwiseAsDataParallel) {
  std::string output;
  for (const auto& [state, bucket_mb] : {std::pair{"fp32", "0"}, {"int8", "0"}, {"fp32", "0.004"}}) {
    for (int nproc : {2, 4}) {
      SCOPED_TRACE(::testing::Message() << nproc << " ranks, " << state << " moments, buckets of " << bucket_mb << " MiB");
      const std::string extra = fmt::format("--set optim.adamw_state={} --set dist.bucket_mb={} ", state, bucket_mb);
      const std::string ddp = fmt::format("{}/ddp-{}-{}-{}", dir_, state, bucket_mb, nproc);
      const std::string zero = fmt::format("{}/zero-{}-{}-{}", dir_, state, bucket_mb, nproc);
      ASSERT_EQ(run_with_fault(launch(nproc, ddp, 1, extra), "", &output), 0) << output;
      ASSERT_EQ(run_with_fault(launch(nproc, zero, 1, extra + "--set dist.zero=1"), "", &output), 0) << output;
      EXPECT_EQ(weight_difference(zero, ddp), 0.0);
      expect_same_training(zero, ddp, 0.0);
      // Each rank's log names its share: about 1 / nproc of the parameters (cuts on 256-element blocks).
      for (int r = 1; r < nproc; ++r) {
        const std::string log = r == 0 ? output : read_file(fmt::format("{}/rank-{}.log", zero, r));  // 0: the console
        const std::string said = fmt::format("ZeRO-1: rank {} updates ", r);
        const size_t at = log.find(said);
        ASSERT_NE(at, std::string::npos) << log;
        std::istringstream share(log.substr(at + said.size()));
        int64_t mine = 0, total = 0;
        std::string of;
        share >> mine >> of >> total;
        EXPECT_LE(std::abs(mine - total / nproc), 257) << log;
      }
    }
  }
}

namespace {

std::string shard_file(const std::string& checkpoint, int rank, int world) {
  return fmt::format("{}/optimizer.rank-{:05}-of-{:05}.safetensors", checkpoint, rank, world);
}

// The optimizer state tensors of a checkpoint as raw bytes by name: a whole
// optimizer.safetensors read as it is, or a ZeRO run's shard files joined, each slice put
// at the offset its metadata gives (written by the test, not by kiln's reader).
std::map<std::string, std::string> optimizer_state_bytes(const std::string& checkpoint, int shards) {
  std::map<std::string, std::string> out;
  const auto bytes_of = [](const SafetensorsFile& file, const std::string& name) {
    const auto* data = static_cast<const char*>(file.data(name));
    return std::string(data, file.info(name).nbytes());
  };
  if (shards == 0) {
    const SafetensorsFile file = SafetensorsFile::open(checkpoint + "/optimizer.safetensors");
    for (const std::string& name : file.names()) out[name] = bytes_of(file, name);
    return out;
  }
  std::map<std::string, size_t> filled;
  for (int r = 0; r < shards; ++r) {
    const SafetensorsFile file = SafetensorsFile::open(shard_file(checkpoint, r, shards));
    const nlohmann::json slices = nlohmann::json::parse(file.metadata("slices"));
    for (const std::string& name : file.names()) {
      const size_t element = dtype_size(file.info(name).dtype);
      int64_t whole = 1;
      for (int64_t d : slices[name]["whole"].get<std::vector<int64_t>>()) whole *= d;
      std::string& joined = out[name];
      joined.resize(static_cast<size_t>(whole) * element);
      const std::string piece = bytes_of(file, name);
      joined.replace(slices[name]["offset"].get<size_t>() * element, piece.size(), piece);
      filled[name] += piece.size();
    }
  }
  for (const auto& [name, bytes] : out) EXPECT_EQ(filled[name], bytes.size()) << name << " is not covered exactly";
  return out;
}

}  // namespace

// A ZeRO run's checkpoint holds the optimizer state in one shard file per rank (each
// rank's slices), and resumes at any world size, with or without ZeRO. The same
// interrupted path -- 2 ranks (checkpoint at 4), then 1 process (at 8), then 3 ranks (at
// 12), then 2 ranks to the end -- with ZeRO and without it: so a single process reads 2
// ZeRO ranks' shards, ZeRO ranks read a whole file, and 2 ZeRO ranks read 3 ranks'
// shards. The shard files joined equal the whole file byte for byte per tensor, and the
// runs end with the same weights bit for bit (how close such a path comes to one process
// straight through is ACheckpointResumesAtAnotherWorldSize's; int8 moments round DDP's
// 1e-7 differences further apart). The path once more under ZeRO-2, its last leg under
// ZeRO-1 (so ZeRO-1 reads ZeRO-2's shards): within 1e-5 of DDP, the 3 ranks' reduce-scatter
// summing in another order.
TEST_F(Distributed, AZeroCheckpointResumesAtAnyWorldSize) {
  std::string output;
  const std::string int8 = "--set optim.adamw_state=int8 --set dist.bucket_mb=0 --set train.steps=16 ";
  for (const char* zero : {"0", "1", "2"}) {
    SCOPED_TRACE(::testing::Message() << "dist.zero=" << zero);
    const bool sharded = std::string(zero) != "0";
    const std::string run = fmt::format("{}/moved-zero{}", dir_, zero);
    const std::string extra = int8 + fmt::format("--set dist.zero={} ", zero);
    // ZeRO-2's last leg is ZeRO-1's: its shard files read by the other stage.
    const std::string last = std::string(zero) == "2" ? int8 + "--set dist.zero=1 " : extra;
    ASSERT_NE(run_with_fault(launch(2, run, 3, extra), "kill_at_step:5", &output), 0) << output;
    EXPECT_EQ(latest_of(run), "step-00000004");
    // A ZeRO save: one file per rank, and no whole file.
    const std::string at4 = checkpoint_path(run, 4);
    EXPECT_EQ(std::filesystem::exists(at4 + "/optimizer.safetensors"), !sharded);
    for (int r = 0; r < 2; ++r) EXPECT_EQ(std::filesystem::exists(shard_file(at4, r, 2)), sharded) << r;
    EXPECT_FALSE(std::filesystem::exists(shard_file(at4, 2, 2)));
    ASSERT_EQ(run_with_fault(single(run, 6, int8 + "--resume"), "kill_at_step:9", &output), -SIGKILL) << output;
    EXPECT_EQ(latest_of(run), "step-00000008");
    EXPECT_TRUE(std::filesystem::exists(checkpoint_path(run, 8) + "/optimizer.safetensors"));
    ASSERT_NE(run_with_fault(launch(3, run, 2, extra + "--resume"), "kill_at_step:13", &output), 0) << output;
    EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(run, 8) + " at step 8");
    EXPECT_EQ(latest_of(run), "step-00000012");
    for (int r = 0; r < 3; ++r) EXPECT_EQ(std::filesystem::exists(shard_file(checkpoint_path(run, 12), r, 3)), sharded);
    ASSERT_EQ(run_with_fault(launch(2, run, 3, last + "--resume"), "", &output), 0) << output;
    EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(run, 12) + " at step 12");
  }
  const std::string ddp = dir_ + "/moved-zero0", zero = dir_ + "/moved-zero1", zero2 = dir_ + "/moved-zero2";
  // ZeRO-2's 2 ranks sum as DDP's bit for bit (ZeroTwoTrainsAsDataParallel): so its shards
  // at step 4 too; at 3 ranks its reduce-scatter adds in another order.
  for (const auto& [step, ranks, run] : {std::tuple{4, 2, zero}, {12, 3, zero}, {4, 2, zero2}}) {
    SCOPED_TRACE(::testing::Message() << run << " step " << step);
    const auto whole = optimizer_state_bytes(checkpoint_path(ddp, step), 0);
    const auto joined = optimizer_state_bytes(checkpoint_path(run, step), ranks);
    ASSERT_FALSE(whole.empty());
    EXPECT_EQ(joined.size(), whole.size());
    for (const auto& [name, bytes] : whole) {
      ASSERT_TRUE(joined.count(name)) << name;
      EXPECT_TRUE(joined.at(name) == bytes) << name << " differs";
    }
  }
  EXPECT_EQ(weight_difference(zero, ddp), 0.0);
  expect_same_training(zero, ddp, 0.0);
  EXPECT_LT(weight_difference(zero2, ddp), 1e-5);
  expect_same_training(zero2, ddp, 1e-6);
}

// Muon under ZeRO: each matrix is given whole to one rank (train/parameter_shards.h),
// orthogonalized there and all-gathered; with MoE experts, the sigmoid_bias router's bias
// and QK-Clip, 2 and 4 ZeRO ranks equal DDP over the same ranks bit for bit.
TEST_F(Distributed, ZeroOneWithMuonMoeAndQkClipTrainsBitwiseAsDataParallel) {
  const std::string sparse =
      "--set model.mlp=moe --set model.moe.experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32 "
      "--set model.moe.router=sigmoid_bias --set model.moe.aux_loss=0.01 --set optim.name=muon "
      "--set optim.qk_clip.enabled=true --set optim.qk_clip.tau=1.5 --set dist.bucket_mb=0 ";
  std::string output;
  for (int nproc : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << nproc << " ranks");
    const std::string ddp = fmt::format("{}/muon-ddp-{}", dir_, nproc), zero = fmt::format("{}/muon-zero-{}", dir_, nproc);
    ASSERT_EQ(run_with_fault(launch(nproc, ddp, 1, sparse), "", &output), 0) << output;
    ASSERT_EQ(run_with_fault(launch(nproc, zero, 1, sparse + "--set dist.zero=1"), "", &output), 0) << output;
    EXPECT_EQ(weight_difference(zero, ddp), 0.0);
    expect_same_training(zero, ddp, 0.0);
  }
}

// ZeRO-2 (dist.zero = 2): the gradients reduce-scattered into their owners' shards, the
// norm summed from the shards' sums of squares. Against DDP over the same ranks and batch,
// AdamW (fp32 and int8 moments, one round and many 4 KiB rounds) and Muon with MoE and
// QK-Clip. At 2 ranks the summed gradients are DDP's bit for bit (a + b = b + a), so the
// final weights are too; the norm, whose f64 sum of squares the ranks add in parts, within
// 1e-13. At 4 ranks Gloo's reduce-scatter adds in another order than its all-reduce
// (halving-doubling against a ring): losses and norms within 1e-6, weights within 1e-5
// (the tolerance of DDP against one process, ACheckpointResumesAtAnotherWorldSize).
TEST_F(Distributed, ZeroTwoTrainsAsDataParallel) {
  const std::string muon =
      "--set model.mlp=moe --set model.moe.experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32 "
      "--set model.moe.router=sigmoid_bias --set model.moe.aux_loss=0.01 --set optim.name=muon "
      "--set optim.qk_clip.enabled=true --set optim.qk_clip.tau=1.5 --set dist.bucket_mb=0 ";
  std::string output;
  for (const auto& [name, extra] : {std::pair<std::string, std::string>{"fp32", "--set dist.bucket_mb=0 "},
                                    {"int8", "--set optim.adamw_state=int8 --set dist.bucket_mb=0 "},
                                    {"rounds", "--set dist.bucket_mb=0.004 "},
                                    {"muon", muon}}) {
    for (int nproc : {2, 4}) {
      SCOPED_TRACE(::testing::Message() << nproc << " ranks, " << name);
      const std::string ddp = fmt::format("{}/ddp-{}-{}", dir_, name, nproc);
      const std::string zero = fmt::format("{}/zero2-{}-{}", dir_, name, nproc);
      ASSERT_EQ(run_with_fault(launch(nproc, ddp, 1, extra), "", &output), 0) << output;
      ASSERT_EQ(run_with_fault(launch(nproc, zero, 1, extra + "--set dist.zero=2"), "", &output), 0) << output;
      if (nproc == 2) {  // a + b = b + a: the gradients are DDP's bit for bit, the norm's f64 sum nearly
        EXPECT_EQ(weight_difference(zero, ddp), 0.0);
        expect_same_training(zero, ddp, 1e-13);
      } else {
        // int8 moments round each block to 127 steps: a last-bit difference in a summed
        // gradient can move a moment by one step, and the weight by that step's share of
        // the update (measured 3.0e-3 relative on an AMD EPYC, 2026-12-06; under 1e-5 on
        // the machine this was written on). A wrong shard or order is off by O(1).
        EXPECT_LT(weight_difference(zero, ddp), name == "int8" ? 1e-2 : 1e-5);
        expect_same_training(zero, ddp, 1e-6);
      }
      EXPECT_CONTAINS(read_file(zero + "/rank-1.log"), "ZeRO-2: rank 1 ");
      // The resident pages are counted only when KILN_MEASURE_GRADIENT_MEMORY asks (below).
      EXPECT_EQ(read_file(zero + "/rank-1.log").find("held at most"), std::string::npos);
    }
  }
}

// ZeRO-2's guard: a non-finite gradient (inf_grad writes +Inf into the last parameter's
// gradient after the synchronization, on every rank: inside its owner's shard there, in a
// zeroed part elsewhere) makes every rank's summed norm infinite, so every rank skips the
// update, and the run goes on as DDP's with the same fault, bit for bit at 2 ranks.
TEST_F(Distributed, ZeroTwoSkipsANonFiniteGradientOnEveryRankAsDataParallel) {
  std::string output;
  const std::string ddp = dir_ + "/inf-ddp", zero = dir_ + "/inf-zero2";
  ASSERT_EQ(run_with_fault(launch(2, ddp, 1, "--set dist.bucket_mb=0 "), "inf_grad:5", &output), 0) << output;
  ASSERT_EQ(run_with_fault(launch(2, zero, 1, "--set dist.bucket_mb=0 --set dist.zero=2 "), "inf_grad:5", &output), 0)
      << output;
  const std::string skipped = "step 5: update skipped (non-finite gradient norm inf)";
  EXPECT_CONTAINS(output, skipped);                             // rank 0's console
  EXPECT_CONTAINS(read_file(zero + "/rank-1.log"), skipped);
  EXPECT_EQ(weight_difference(zero, ddp), 0.0);
  const std::vector<TrainRecord> x = train_records(zero), y = train_records(ddp);
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {  // the skipped step's norm is null (Inf) in both
    EXPECT_EQ(x[i].loss, y[i].loss) << "step " << x[i].step;
    EXPECT_EQ(x[i].grad_norm.is_null(), y[i].grad_norm.is_null()) << "step " << x[i].step;
    if (!y[i].grad_norm.is_null())
      EXPECT_LE(relative(x[i].grad_norm.get<double>(), y[i].grad_norm.get<double>()), 1e-13) << "step " << x[i].step;
  }
}

// ZeRO-2's memory (train/sharded_gradients.h): with buckets, each micro-batch's finished
// buckets are reduce-scattered during backward and the pages of other ranks' shards given
// back, so a rank holds its shard of the gradient arena (1 / W of it) plus what backward
// has written and not yet reduce-scattered, measured by mincore (KILN_MEASURE_GRADIENT_MEMORY=1
// asks for the count at every bucket and backward's end); and it still trains as DDP
// (2 micro-batches per step: the sums are added per micro-batch, not after them, so not bit
// for bit: the first step's norm within 1e-7, the weights after 12 steps within 2e-3).
TEST_F(Distributed, ZeroTwoHoldsItsShardOfTheGradientsAndTrainsAsDataParallel) {
  std::string output;
  for (int nproc : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << nproc << " ranks");
    const std::string ddp = fmt::format("{}/memory-ddp-{}", dir_, nproc);
    const std::string zero = fmt::format("{}/memory-zero2-{}", dir_, nproc);
    const std::string buckets = "--set model.layers=8 --set model.hidden=64 --set dist.bucket_mb=0.01 ";
    ASSERT_EQ(run_with_fault(launch(nproc, ddp, 2, buckets), "", &output), 0) << output;
    ASSERT_EQ(run_with_fault("KILN_MEASURE_GRADIENT_MEMORY=1 " + launch(nproc, zero, 2, buckets + "--set dist.zero=2"),
                             "", &output),
              0)
        << output;
    // 12 AdamW steps amplify the first step's last-bit differences (Adam divides tiny
    // gradients by their own size): measured 2.6e-5 at 2 ranks where this was written,
    // 4.5e-4 at 4 ranks on an AMD EPYC (2026-12-06). A wrong shard is off by O(1).
    EXPECT_LT(weight_difference(zero, ddp), 2e-3);
    expect_same_training(zero, ddp, 1e-5);
    // The first step starts from the same weights: only the order of the ranks' additions
    // differs (per micro-batch here), so its loss is the same and its norm nearly.
    const std::vector<TrainRecord> x = train_records(zero), y = train_records(ddp);
    EXPECT_EQ(x.at(0).loss, y.at(0).loss);
    EXPECT_LE(relative(x.at(0).grad_norm.get<double>(), y.at(0).grad_norm.get<double>()), 1e-7);
    for (int r = 0; r < nproc; ++r) {
      const std::string log = r == 0 ? output : read_file(fmt::format("{}/rank-{}.log", zero, r));  // 0: the console
      const std::string said = fmt::format("ZeRO-2: rank {} held at most ", r);
      const size_t at = log.find(said);
      ASSERT_NE(at, std::string::npos) << log;
      double held = 0, arena = 0, shard = 0;
      ASSERT_EQ(std::sscanf(log.c_str() + at + said.size(), "%lf MiB of its %lf MiB gradient arena in memory "
                            "(its shard's pages: %lf MiB)", &held, &arena, &shard), 3) << log;
      std::printf("%d ranks, rank %d: held at most %.3f of %.3f MiB, its shard's pages %.3f\n", nproc, r, held, arena,
                  shard);
      // The count starts before the first step: the arena's pages untouched until written
      // (core/arena.h: HostPages), or this rank would have held the whole arena once.
      // Its shard's pages are about 1 / W of the arena (measured 0.316 to 0.324 of 0.634 MiB
      // at 2 ranks, 0.160 to 0.164 at 4: small tensors of other shards share its edge pages)...
      EXPECT_LT(shard, 1.1 * arena / nproc) << "rank " << r;
      // ... and it holds them, plus what backward has written and not yet reduce-scattered:
      // buckets go out at backward's events, one per block, and are reduce-scattered on the
      // communication thread while backward computes the next block, so the gradients of two
      // blocks (about 75 KiB each here), and the tied table's (259 x 64 floats, written by the
      // head first, final only after the embedding). Measured 0.08 to 0.15 MiB above its
      // shard's pages at 2 and 4 ranks with the reduce-scatters on backward's thread, 0.15 to
      // 0.22 with them overlapped (a block more); DDP and ZeRO-1 hold the whole arena.
      EXPECT_LT(held - shard, 0.4 * arena) << "rank " << r;
      EXPECT_LT(held, 0.85 * arena) << "rank " << r;
      EXPECT_GT(held, 0.0);
    }
  }
}

// KILN_MEASURE_GRADIENT_MEMORY takes 0 or 1; anything else stops the run naming it.
TEST_F(Distributed, ABadGradientMemoryMeasureIsRefusedNamingTheVariable) {
  std::string output;
  const std::string run = dir_ + "/bad-measure";
  EXPECT_NE(run_with_fault("KILN_MEASURE_GRADIENT_MEMORY=yes " +
                               launch(2, run, 1, "--set dist.zero=2 --set dist.bucket_mb=0.01 --set train.steps=2"),
                           "", &output),
            0);
  EXPECT_CONTAINS(output, "[KILN_MEASURE_GRADIENT_MEMORY] 'yes' is not 0 or 1");
}

// ZeRO-2's overlap (train/sharded_gradients.h): each finished bucket is reduce-scattered on
// the communication thread while backward goes on; the next micro-batch's backward and the
// step's norm wait for them. One bucket per step (dist.bucket_mb = 25: ready only when
// backward ends, so nothing overlaps) is the reference. At 2 ranks each element's sum is
// a + b whichever the buckets, and every backward starts from the same arena (the owner's
// sums so far, zeros elsewhere), so small buckets (several per block) must give the
// reference's run bit for bit, with 1 and 3 micro-batches: a bucket sent before backward
// finished it, a backward not waiting for the last micro-batch's buckets (the tied table's
// gradient, the last bucket sent, is the first the next backward writes) or ranks sending
// buckets in different orders would change it. At 3 ranks too (measured): an element's sum
// is formed in its owner's chunk of the reduce-scatter's buffer, wherever the rounds put it.
// And, as every ZeRO-2 run with several micro-batches, within 1e-5 of DDP.
TEST_F(Distributed, ZeroTwoOverlapsItsBucketsWithBackwardAndKeepsTheirSums) {
  std::string output;
  const std::string model = "--set model.layers=4 ";
  for (int nproc : {2, 3}) {
    for (int micro_batches : {1, 3}) {
      SCOPED_TRACE(::testing::Message() << nproc << " ranks, " << micro_batches << " micro-batches");
      const std::string name = fmt::format("{}-{}", nproc, micro_batches);
      const std::string ddp = dir_ + "/overlap-ddp-" + name, one = dir_ + "/overlap-one-" + name;
      ASSERT_EQ(run_with_fault(launch(nproc, ddp, micro_batches, model + "--set dist.bucket_mb=0"), "", &output), 0)
          << output;
      ASSERT_EQ(run_with_fault(launch(nproc, one, micro_batches, model + "--set dist.zero=2 --set dist.bucket_mb=25"),
                               "", &output),
                0)
          << output;
      for (const char* bucket_mb : {"0.002", "0.01"}) {
        SCOPED_TRACE(::testing::Message() << bucket_mb << " MiB buckets");
        const std::string small = fmt::format("{}/overlap-{}-{}", dir_, bucket_mb, name);
        ASSERT_EQ(run_with_fault(launch(nproc, small, micro_batches,
                                        model + "--set dist.zero=2 --set dist.bucket_mb=" + bucket_mb),
                                 "", &output),
                  0)
            << output;
        const double d = weight_difference(small, one);
        std::printf("%d ranks, %d micro-batches, %s MiB buckets: weights %.3g from one bucket's, %.3g from DDP's\n",
                    nproc, micro_batches, bucket_mb, d, weight_difference(small, ddp));
        EXPECT_EQ(d, 0.0);
        expect_same_training(small, one, 0.0);
        EXPECT_LT(weight_difference(small, ddp), 1e-5);
        expect_same_training(small, ddp, 1e-5);
      }
    }
  }
}

TEST_F(Distributed, EveryLauncherConventionStartsTheSameRun) {
  // The ranks started by hand with Slurm's and Open MPI's variables, as srun and mpirun
  // set them; rank 0 serves the rendezvous on MASTER_PORT.
  std::string output;
  const std::string reference = dir_ + "/reference";
  ASSERT_EQ(run_with_fault(launch(2, reference, 1, "--set train.steps=3"), "", &output), 0) << output;
  const std::vector<std::pair<std::string, std::string>> conventions = {
      {"slurm", "SLURM_PROCID={0} SLURM_NTASKS=2 SLURM_LOCALID={0} SLURM_NTASKS_PER_NODE=2 SLURM_JOB_NODELIST=localhost"},
      {"openmpi", "OMPI_COMM_WORLD_RANK={0} OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK={0} "
                  "OMPI_COMM_WORLD_LOCAL_SIZE=2"}};
  const int base_port = 29700 + static_cast<int>(getpid() % 500) * 2;
  for (size_t c = 0; c < conventions.size(); ++c) {
    const auto& [name, vars] = conventions[c];
    const std::string out = dir_ + "/" + name;
    std::vector<pid_t> ranks;
    for (int r = 0; r < 2; ++r)
      ranks.push_back(spawn(fmt::format("env MASTER_PORT={} {} ", base_port + c, fmt::format(fmt::runtime(vars), r)) +
                                single(out, 1, "--set train.steps=3"),
                            fmt::format("{}/{}-{}.out", dir_, name, r)));
    for (pid_t pid : ranks) {
      int status = 0;
      waitpid(pid, &status, 0);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << name << ": " << read_file(dir_ + "/" + name + "-0.out");
    }
    EXPECT_CONTAINS(read_file(dir_ + "/" + name + "-0.out"), "distributed: 2 ranks (" + name + " launch");
    EXPECT_EQ(train_records(out), train_records(reference)) << name;  // bitwise: the same reduction
  }
}

namespace {

// Two ranks started by hand (torchrun's variables), so the test can signal one of them.
std::vector<pid_t> spawn_ranks(const std::string& dir, int port, const std::vector<std::string>& commands) {
  std::vector<pid_t> pids;
  for (size_t r = 0; r < commands.size(); ++r)
    pids.push_back(spawn(fmt::format("env RANK={} WORLD_SIZE={} MASTER_PORT={} {}", r, commands.size(), port,
                                     commands[r]),
                         fmt::format("{}/rank{}.out", dir, r)));
  return pids;
}

// The exit status (128 + signal when killed), waiting at most `seconds`; -1 on timeout
// (the process is then killed).
int wait_exit(pid_t pid, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

// Waits until `file` holds `text` (a rank reached a step), at most `seconds`.
bool wait_for_text(const std::string& file, const std::string& text, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (std::filesystem::exists(file) && read_file(file).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

int test_port(int offset) { return 30700 + static_cast<int>(getpid() % 400) * 4 + offset; }

}  // namespace

// kill -9 of one ZeRO rank while it writes its optimizer shard file (the second save, at
// step 8): rank 0 never writes the manifest, so step 4 stays the latest checkpoint, and 2
// ZeRO ranks resume from it to the end with the losses and weights of an uninterrupted
// run, bit for bit (the same ranks: the same reductions).
TEST_F(Distributed, ARankKilledDuringAShardedSaveLeavesThePreviousCheckpointLatest) {
  const std::string zero = "--set dist.zero=1 --set dist.bucket_mb=0 --set dist.timeout=20 ";
  std::string output;
  const std::string straight = dir_ + "/straight", out = dir_ + "/killed";
  ASSERT_EQ(run_with_fault(launch(2, straight, 2, zero), "", &output), 0) << output;
  const std::string train = single(out, 2, zero);
  const std::vector<pid_t> ranks = spawn_ranks(
      dir_, dist::free_loopback_port(), {train, "env KILN_FAULT_INJECT=checkpoint_write:shard@2 " + train});
  EXPECT_EQ(wait_exit(ranks[1], 120), 128 + SIGKILL) << read_file(out + "/rank-1.log");
  EXPECT_EQ(wait_exit(ranks[0], 60), 1) << read_file(dir_ + "/rank0.out");
  EXPECT_EQ(latest_of(out), "step-00000004");
  EXPECT_FALSE(std::filesystem::exists(checkpoint_path(out, 8)));
  ASSERT_EQ(run_with_fault(launch(2, out, 2, zero + "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(out, 4) + " at step 4");
  EXPECT_EQ(weight_difference(out, straight), 0.0);
  expect_same_training(out, straight, 0.0);
}

// A ZeRO checkpoint whose shard file is gone, or cut short, is refused in one line naming
// the file, at the same world size and at another.
TEST_F(Distributed, AMissingOrShortShardFileIsRefusedNamingIt) {
  const std::string zero = "--set dist.zero=1 --set dist.bucket_mb=0 ";
  std::string output;
  const std::string out = dir_ + "/sharded";
  ASSERT_EQ(run_with_fault(launch(2, out, 2, zero + "--set train.steps=4"), "", &output), 0) << output;
  const std::string shard = shard_file(checkpoint_path(out, 4), 1, 2);
  const std::string bytes = read_file(shard);
  ASSERT_GT(bytes.size(), 16u);
  std::filesystem::remove(shard);
  EXPECT_NE(run_with_fault(launch(2, out, 2, zero + "--resume --set train.steps=8"), "", &output), 0);
  EXPECT_CONTAINS(output, "kiln: error: [checkpoint] " + shard + ": missing\n");
  write_file(shard, bytes.substr(0, bytes.size() / 2));
  EXPECT_NE(run_with_fault(single(out, 4, "--resume --set train.steps=8"), "", &output), 0);
  EXPECT_CONTAINS(output, fmt::format("kiln: error: [checkpoint] {}: truncated ({} bytes, the manifest says {})\n",
                                      shard, bytes.size() / 2, bytes.size()));
}

TEST_F(Distributed, KillingOneRankEndsTheOthersWithAnErrorNamingTheCollective) {
  const std::string out = dir_ + "/killed";
  // Long enough that rank 1 is killed mid-run; dist.timeout bounds a hang, a closed
  // connection is seen at once.
  const std::string train = single(out, 1, "--set train.steps=100000 --set dist.timeout=20");
  const std::vector<pid_t> ranks = spawn_ranks(dir_, test_port(0), {train, train});
  ASSERT_TRUE(wait_for_text(out + "/rank-1.log", "step     3/", 60)) << read_file(dir_ + "/rank0.out");
  kill(ranks[1], SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  const int status = wait_exit(ranks[0], 40);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  wait_exit(ranks[1], 5);
  const std::string log = read_file(dir_ + "/rank0.out");
  EXPECT_EQ(status, 1) << log;
  EXPECT_LT(seconds, 30) << log;
  EXPECT_CONTAINS(log, "kiln: error: [dist] rank 0 of 2: the collective '");
  EXPECT_CONTAINS(log, fmt::format("rank 1 (pid {} on ", ranks[1]));
  EXPECT_CONTAINS(log, "died or exited: its connection to the store closed");
}

// Issue 38: the waiting ranks named the collective and dist.timeout, not the rank that
// hung. Rank 2 of 3 is stopped whole (SIGSTOP: its heartbeat stops too) mid-training;
// ranks 0 and 1 fail within dist.timeout plus the diagnosis, naming it by rank and pid.
TEST_F(Distributed, AStoppedRankIsNamedByTheRanksThatTimeOutWaitingForIt) {
  const std::string out = dir_ + "/frozen";
  const std::string train = single(out, 1, "--set train.steps=100000 --set dist.timeout=10");
  const std::vector<pid_t> ranks = spawn_ranks(dir_, test_port(3), {train, train, train});
  ASSERT_TRUE(wait_for_text(out + "/rank-2.log", "step     3/", 90)) << read_file(dir_ + "/rank0.out");
  kill(ranks[2], SIGSTOP);
  const auto start = std::chrono::steady_clock::now();
  const int status0 = wait_exit(ranks[0], 60), status1 = wait_exit(ranks[1], 60);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  wait_exit(ranks[2], 0);  // SIGKILL ends a stopped process too
  // Both name rank 2 and neither blames the other. The first waiter to time out closes its
  // Gloo connections: the other may fail just before its own timeout, and says after how long.
  const std::string named = fmt::format("rank 2 (pid {} on ", ranks[2]);
  std::string both;
  for (int r = 0; r < 2; ++r) {
    const std::string log = read_file(fmt::format("{}/rank{}.out", dir_, r));
    EXPECT_EQ(r == 0 ? status0 : status1, 1) << log;
    EXPECT_CONTAINS(log, fmt::format("kiln: error: [dist] rank {} of 3: the collective '", r));
    EXPECT_CONTAINS(log, "dist.timeout = 10 s");
    EXPECT_CONTAINS(log, ": " + named);
    EXPECT_CONTAINS(log, ") sent no heartbeat for ");
    EXPECT_CONTAINS(log, " s: stopped or hung (at its last heartbeat it had entered ");
    EXPECT_EQ(log.find(fmt::format("rank {} (pid", 1 - r)), std::string::npos) << log;
    both += log;
  }
  EXPECT_CONTAINS(both, "did not finish within dist.timeout = 10 s: " + named);
  EXPECT_LT(seconds, 10 + 15);  // rank 0 stays up to 5 s for rank 1 to read the store
}

// Rank 0 stopped: its process serves the store the records are in, so the others cannot
// read them; they say that rank 0 does not answer.
TEST_F(Distributed, AStoppedRankZeroIsNamedAsTheStoreThatDoesNotAnswer) {
  const std::string out = dir_ + "/frozen0";
  const std::string train = single(out, 1, "--set train.steps=100000 --set dist.timeout=6");
  const std::vector<pid_t> ranks = spawn_ranks(dir_, dist::free_loopback_port(), {train, train});
  ASSERT_TRUE(wait_for_text(out + "/rank-1.log", "step     3/", 90)) << read_file(dir_ + "/rank0.out");
  kill(ranks[0], SIGSTOP);
  const int status = wait_exit(ranks[1], 60);
  wait_exit(ranks[0], 0);
  const std::string log = read_file(dir_ + "/rank1.out");
  EXPECT_EQ(status, 1) << log;
  EXPECT_CONTAINS(log, fmt::format("did not finish within dist.timeout = 6 s: rank 0 (pid {} on ", ranks[0]));
  EXPECT_CONTAINS(log, "whose process serves the run's store, did not answer it within 3 s: stopped or hung");
}

// A rank alive but busy outside the collectives (here a 10-minute step) is named as such,
// not as stopped: its heartbeat goes on.
TEST_F(Distributed, ARankSlowOutsideTheCollectivesIsNamedAsAliveButNotThere) {
  const std::string out = dir_ + "/slow";
  const std::string train = single(out, 1, "--set train.steps=100000 --set dist.timeout=6");
  const std::vector<pid_t> ranks = spawn_ranks(dir_, dist::free_loopback_port(),
                                               {train, train, "env KILN_FAULT_INJECT=step_delay_ms:600000 " + train});
  const int status0 = wait_exit(ranks[0], 90), status1 = wait_exit(ranks[1], 30);
  wait_exit(ranks[2], 0);
  const std::string named = fmt::format("rank 2 (pid {} on ", ranks[2]);
  std::string both;
  for (int r = 0; r < 2; ++r) {
    const std::string log = read_file(fmt::format("{}/rank{}.out", dir_, r));
    EXPECT_EQ(r == 0 ? status0 : status1, 1) << log;
    EXPECT_CONTAINS(log, "dist.timeout = 6 s");
    EXPECT_CONTAINS(log, ": " + named);
    EXPECT_CONTAINS(log, ") but is alive (heartbeat ");
    EXPECT_EQ(log.find(fmt::format("rank {} (pid", 1 - r)), std::string::npos) << log;
    both += log;
  }
  EXPECT_CONTAINS(both, "did not finish within dist.timeout = 6 s: " + named);
}

TEST_F(Distributed, SigtermToOneRankCheckpointsEveryRankAtOneStepAndExitsZero) {
  const std::string out = dir_ + "/stopped";
  const std::string train = single(out, 1, "--set train.steps=100000 --set checkpoint.every=0");
  const std::vector<pid_t> ranks = spawn_ranks(dir_, test_port(1), {train, train});
  ASSERT_TRUE(wait_for_text(out + "/rank-1.log", "step     3/", 60)) << read_file(dir_ + "/rank0.out");
  kill(ranks[1], SIGTERM);
  EXPECT_EQ(wait_exit(ranks[0], 60), 0) << read_file(dir_ + "/rank0.out");
  EXPECT_EQ(wait_exit(ranks[1], 60), 0) << read_file(out + "/rank-1.log");
  const std::string log = read_file(dir_ + "/rank0.out");
  EXPECT_CONTAINS(log, "stopped by SIGTERM after step");
  // Rank 0 saved at the step both stopped after, and the run resumes from it in one process.
  const std::string latest = latest_of(out);
  EXPECT_CONTAINS(read_file(out + "/rank-1.log"), "stopped by SIGTERM after step " + std::to_string(std::stoll(latest.substr(5))));
  std::string output;
  const int64_t stopped = std::stoll(latest.substr(5));
  EXPECT_EQ(run_with_fault(single(out, 2, fmt::format("--resume --set train.steps={}", stopped + 2)), "", &output), 0)
      << output;
  EXPECT_CONTAINS(output, fmt::format("resumed from {}/checkpoints/{} at step {}", out, latest, stopped));
}

TEST_F(Distributed, ARankWithAnotherConfigIsRefusedAtStartNamingTheKey) {
  const std::string out = dir_ + "/mismatch";
  const std::vector<pid_t> ranks =
      spawn_ranks(dir_, test_port(2), {single(out, 1), single(out, 1, "--set optim.lr=2e-2")});
  EXPECT_EQ(wait_exit(ranks[0], 60), 1);
  EXPECT_EQ(wait_exit(ranks[1], 60), 1);
  EXPECT_CONTAINS(read_file(dir_ + "/rank1.out"),
                  "kiln: error: [dist] rank 1: its config differs from rank 0's: 'optim.lr = 0.02' here, "
                  "'optim.lr = 0.01' on rank 0");
  EXPECT_CONTAINS(read_file(dir_ + "/rank0.out"), "hold another config than rank 0 (the first, rank 1, says where)");
}

TEST_F(Distributed, SparseLayersAndQkClipActOnTheWholeStepOnEveryRank) {
  // The balancing bias follows the expert loads of all ranks' tokens, QK-Clip the largest
  // logit of any rank, and the per-micro-batch loss terms average over every rank's
  // micro-batches: two ranks equal one process, and the terms are reported alike.
  const std::string sparse =
      "--set model.mlp=moe --set model.moe.experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32 "
      "--set model.moe.router=sigmoid_bias --set model.moe.aux_loss=0.01 --set optim.name=muon "
      "--set optim.qk_clip.enabled=true --set optim.qk_clip.tau=1.5 ";
  std::string output;
  const std::string one = dir_ + "/one", two = dir_ + "/two";
  ASSERT_EQ(run_with_fault(single(one, 4, sparse), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(launch(2, two, 2, sparse), "", &output), 0) << output;
  expect_same_training(two, one, 1e-5);
  EXPECT_LT(weight_difference(two, one), 1e-5);
  const std::vector<nlohmann::json> a = metrics_of_kind(one, "train"), b = metrics_of_kind(two, "train");
  ASSERT_EQ(a.size(), b.size());
  for (const char* key : {"moe_aux", "moe.0.load_max", "attn.0.max_logit", "attn.0.clipped"}) {
    ASSERT_TRUE(a.back().contains(key)) << a.back().dump();
    EXPECT_LT(relative(b.back()[key].get<double>(), a.back()[key].get<double>()), 1e-5) << key;
  }
}

TEST_F(Distributed, SigtermToTheLauncherStopsEveryRankWithACheckpoint) {
  const std::string out = dir_ + "/launched";
  const pid_t launcher =
      spawn(launch(2, out, 1, "--set train.steps=100000 --set checkpoint.every=0"), dir_ + "/launch.out");
  ASSERT_TRUE(wait_for_text(out + "/rank-1.log", "step     3/", 60)) << read_file(dir_ + "/launch.out");
  kill(launcher, SIGTERM);
  EXPECT_EQ(wait_exit(launcher, 60), 0) << read_file(dir_ + "/launch.out");
  EXPECT_CONTAINS(read_file(dir_ + "/launch.out"), "stopped by SIGTERM after step");
  EXPECT_CONTAINS(read_file(out + "/rank-1.log"), "stopped by SIGTERM after step");
  EXPECT_TRUE(std::filesystem::exists(out + "/checkpoints/" + latest_of(out) + "/manifest.json"));
}

// Resuming at another process count with the same train.grad_accum used to change the
// global batch silently (1 process after 2 ranks: half the tokens per step, losses off by
// 7e-3). Now grad_accum is set so a step keeps the checkpoint's tokens, and the run says
// so; where no grad_accum can (1 process's 256 tokens over 2 ranks of 256), it is refused
// naming train.grad_accum and the numbers.
TEST_F(Distributed, ResumingAtAnotherProcessCountKeepsTheGlobalBatch) {
  std::string output;
  const std::string straight = dir_ + "/straight", moved = dir_ + "/moved";
  ASSERT_EQ(run_with_fault(single(straight, 2), "", &output), 0) << output;
  ASSERT_NE(run_with_fault(launch(2, moved, 1), "kill_at_step:5", &output), 0) << output;
  ASSERT_EQ(latest_of(moved), "step-00000004");
  ASSERT_EQ(run_with_fault(single(moved, 1, "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "resume: the checkpoint's run took 512 tokens per step (2 processes x grad_accum 1); on 1 "
                          "processes train.grad_accum 1 -> 2 keeps them");
  expect_same_training(moved, straight, 1e-5);
  EXPECT_LT(weight_difference(moved, straight), 1e-5);

  const std::string halved = dir_ + "/halved";
  ASSERT_EQ(run_with_fault(single(halved, 1), "kill_at_step:5", &output), -SIGKILL) << output;
  EXPECT_EQ(run_with_fault(launch(2, halved, 1, "--resume"), "", &output), 1) << output;
  EXPECT_CONTAINS(output, "kiln: error: [train.grad_accum] " + checkpoint_path(halved, 4) +
                              ": the checkpoint's run took 256 tokens per step (1 processes x grad_accum 1 x 256 "
                              "micro-batch tokens); 2 processes x 256 micro-batch tokens make no such step at any "
                              "train.grad_accum: resume on a process count that divides 1");
}
