// Data parallelism on the GPU: the NCCL path (gradients, in buckets on a communication
// stream during backward or once after it, loss sums and step statistics, inside the
// captured graphs) at world size 1 gives the single-device step bit for bit, captured and
// op by op, with and without ZeRO-1; a late collective ends the process (the watchdog);
// with two GPUs or more, two ranks
// equal one process over the same global batch (the multi-GPU measurements are issue 24).
#include "core/cuda_context.h"
#include "dist/free_port.h"
#include "dist/nccl_communicator.h"
#include "dist/tcp_store.h"
#include "gpu/gpu_harness.h"
#include "test_util.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

namespace kiln {
namespace {

using namespace gpu_test;

class Distributed : public GpuTest {};

struct Record {
  double loss = 0, grad_norm = 0;
  bool operator==(const Record&) const = default;
};

std::vector<Record> records(const std::string& out_dir) {
  std::vector<Record> out;
  std::ifstream in(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train") out.push_back({j["loss"], j["grad_norm"]});
  }
  return out;
}

std::string train_command(const std::string& dir, const std::string& out, const std::string& extra) {
  return test::kiln_binary() + " train " + dir + "/empty.toml --set data.path=" + test::source_dir() +
         "/data/tinyshakespeare.txt --set train.device=cuda --set model.hidden=64 --set model.layers=2"
         " --set model.heads=4 --set model.kv_heads=2 --set model.head_dim=16 --set model.ffn_hidden=128"
         " --set model.max_seq_len=128 --set train.micro_batch_tokens=2048 --set train.steps=20 --set log.every=1"
         " --set train.eval_every=10 --set train.eval_batches=2 --set train.sample_every=0 --set train.sample_tokens=4"
         " --set checkpoint.every=0 --set optim.grad_clip=0.5 --set train.out_dir=" +
         out + " " + extra;
}

std::string launch(int nproc, const std::string& command) {
  return fmt::format("{} launch --nproc {} --grace 20 -- {}", test::kiln_binary(), nproc,
                     command.substr(test::kiln_binary().size() + 1));
}

TEST_F(Distributed, OneRankOverNcclIsTheSingleDeviceStepBitForBit) {
  const std::string dir = test::temp_dir("kiln-gpu-dist");
  test::write_file(dir + "/empty.toml", "");
  const std::string sparse =
      "--set model.mlp=moe --set model.moe.experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=64"
      " --set model.moe.router=sigmoid_bias --set model.moe.aux_loss=0.01 --set optim.qk_clip.enabled=true"
      " --set optim.qk_clip.tau=2 --set optim.name=muon";
  // ZeRO-1 at one rank: the shard is every parameter, but the update's all-gather and its
  // copies run (inside the captured update, or op by op) and must change nothing.
  const std::string zero = " --set dist.zero=1 --set dist.bucket_mb=0.01";
  // ZeRO-2 at one rank: the gradients are reduce-scattered (the shard is every gradient),
  // in buckets on the communication stream during the last backward or, with no buckets,
  // the whole arena on the model's stream after it; their copies through the buffer, NCCL's
  // one-rank reduce-scatter and the norm's sum over the ranks must change nothing.
  const std::string zero2 = " --set dist.zero=2 --set dist.bucket_mb=0.01";
  const std::string zero2_whole = " --set dist.zero=2 --set dist.bucket_mb=0";
  // Gradient buckets (dist.bucket_mb): tiny ones, many per step, reduced on the
  // communication stream during the last backward (inside its captured graph, or op by
  // op); and none, one reduction after backward. At one rank NCCL's sum is the identity.
  const std::string buckets = " --set dist.bucket_mb=0.01";
  for (const std::string& variant : {std::string("--set train.grad_accum=2"),
                                     "--set train.grad_accum=2" + buckets,
                                     "--set train.grad_accum=2 --set train.cuda_graphs=false" + buckets,
                                     "--set train.grad_accum=2 " + sparse + buckets,
                                     std::string("--set train.grad_accum=2 --set dist.bucket_mb=0"),
                                     std::string("--set train.grad_accum=2 --set train.cuda_graphs=false"),
                                     "--set train.grad_accum=2 " + sparse,
                                     "--set train.grad_accum=2" + zero,
                                     "--set train.grad_accum=2 --set train.cuda_graphs=false" + zero,
                                     "--set train.grad_accum=2 " + sparse + zero,
                                     "--set train.grad_accum=2" + zero2,
                                     "--set train.grad_accum=2 --set train.cuda_graphs=false" + zero2,
                                     "--set train.grad_accum=2 " + sparse + zero2,
                                     "--set train.grad_accum=2 --set train.cuda_graphs=false " + sparse + zero2,
                                     "--set train.grad_accum=2" + zero2_whole,
                                     "--set train.grad_accum=2 --set train.cuda_graphs=false" + zero2_whole,
                                     "--set train.grad_accum=2 " + sparse + zero2_whole}) {
    SCOPED_TRACE(variant);
    std::filesystem::remove_all(dir + "/alone");
    std::filesystem::remove_all(dir + "/ranked");
    std::string output;
    ASSERT_EQ(test::run_command(train_command(dir, dir + "/alone", variant), &output), 0) << output;
    ASSERT_EQ(test::run_command(launch(1, train_command(dir, dir + "/ranked", variant)), &output), 0) << output;
    EXPECT_NE(output.find("distributed: 1 ranks (torchrun launch, 1 per node), gradients over nccl"),
              std::string::npos)
        << output;
    const std::string reduction = variant.find("bucket_mb=0.01") != std::string::npos ? "in buckets of 0.01 MiB"
                                  : variant.find("bucket_mb=0") != std::string::npos  ? "in one reduction after"
                                                                                       : "in buckets of 25 MiB";
    EXPECT_NE(output.find(reduction), std::string::npos) << output;
    if (variant.find("dist.zero=2") != std::string::npos) {
      EXPECT_NE(output.find("; gradients reduce-scattered through it"), std::string::npos) << output;
    }
    const std::vector<Record> alone = records(dir + "/alone"), ranked = records(dir + "/ranked");
    ASSERT_EQ(alone.size(), 20u);
    EXPECT_EQ(ranked, alone);
    EXPECT_EQ(test::read_file(dir + "/ranked/model/model.safetensors"),
              test::read_file(dir + "/alone/model/model.safetensors"));
  }
  std::filesystem::remove_all(dir);
}

// NCCL's watchdog (dist/collective_watchdog.h): a collective that cannot finish within
// dist.timeout (its stream held up by a host function that sleeps far past the timeout, as
// a peer that never arrives holds it) ends the process with exit status 1, naming the rank
// and the collective, instead of leaving it blocked in its next synchronization.
TEST_F(Distributed, ALateNcclCollectiveEndsTheProcessNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: CUDA and NCCL do not survive fork
  EXPECT_EXIT(
      {
        dist::TcpStore store("127.0.0.1", dist::free_loopback_port(), true, std::chrono::seconds(20));
        const auto comm =
            dist::make_nccl_communicator(store, "nccl/id", 0, 1, process_exec(), std::chrono::milliseconds(1000));
        const cudaStream_t stream = cuda::stream(process_exec());
        cudaLaunchHostFunc(stream, [](void*) { std::this_thread::sleep_for(std::chrono::seconds(20)); }, nullptr);
        void* data = nullptr;
        cudaMalloc(&data, 64 * sizeof(float));
        comm->all_reduce(data, 64, DType::f32, dist::ReduceOp::sum, "stalled gradients");
        cudaStreamSynchronize(stream);  // blocks until the watchdog ends the process
        std::exit(0);
      },
      ::testing::ExitedWithCode(1),
      "rank 0 of 1: the NCCL collective 'stalled gradients' did not finish within dist.timeout = 1 s");
}

TEST_F(Distributed, TwoRanksOnTwoGpusTrainAsOneProcess) {
  int gpus = 0;
  cudaGetDeviceCount(&gpus);
  if (gpus < 2) GTEST_SKIP() << "one GPU here: the two-rank comparison needs two";
  const std::string dir = test::temp_dir("kiln-gpu-dist2");
  test::write_file(dir + "/empty.toml", "");
  std::string output;
  ASSERT_EQ(test::run_command(train_command(dir, dir + "/alone", "--set train.grad_accum=4"), &output), 0) << output;
  ASSERT_EQ(test::run_command(launch(2, train_command(dir, dir + "/ranked", "--set train.grad_accum=2")), &output), 0)
      << output;
  const std::vector<Record> alone = records(dir + "/alone"), ranked = records(dir + "/ranked");
  ASSERT_EQ(ranked.size(), alone.size());
  for (size_t i = 0; i < alone.size(); ++i) {
    EXPECT_NEAR(ranked[i].loss, alone[i].loss, 1e-5 * alone[i].loss) << "step " << i + 1;
    EXPECT_NEAR(ranked[i].grad_norm, alone[i].grad_norm, 1e-4 * alone[i].grad_norm) << "step " << i + 1;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
