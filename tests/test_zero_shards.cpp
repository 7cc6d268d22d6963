// ZeRO's shards (train/parameter_shards.h) and the optimizer state they leave each rank:
// every trainable element belongs to exactly one rank, a cut inside a tensor falls on an
// int8 block, the shards are balanced, and AdamW steps taken on every rank's shard (fp32
// and int8 moments) leave exactly the weights and, joined, the state of one whole update.
#include "ops/optim/adamw_lowmem_math.h"
#include "config/config.h"
#include "test_util.h"
#include "tiny_model.h"
#include "train/memory_check.h"
#include "train/optimizer_groups.h"
#include "train/parameter_shards.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <map>
#include <vector>

namespace kiln {
namespace {

using namespace kiln::test;

// f32 (int8 moments need fp32 parameters), and a vocabulary whose embedding and head are
// large enough for int8 moments (adamw_lowmem::kMinQuantizedNumel).
ModelConfig shard_config() { return tiny_config(true, false, 600); }
BuildOptions shard_build() {
  BuildOptions o = tiny_build(24, 7);
  o.dtype = DType::f32;
  return o;
}

std::vector<const Parameter*> trainable_of(const Model& model) {
  std::vector<const Parameter*> out;
  for (const auto& p : model.parameters())
    if (p->trainable()) out.push_back(p.get());
  return out;
}

TEST(ZeroShards, EveryElementIsOneRanksAndCutsFallOnBlocks) {
  Model model(shard_config(), shard_build());
  const std::vector<const Parameter*> trainable = trainable_of(model);
  int64_t total = 0;
  for (const Parameter* p : trainable) total += p->shape().numel();
  for (int world : {1, 2, 3, 4, 7}) {
    SCOPED_TRACE(::testing::Message() << world << " ranks");
    const ParameterShards shards(trainable, world, adamw_lowmem::kBlock);
    ASSERT_EQ(shards.total(), total);
    std::map<const Parameter*, std::vector<char>> owned;  // per element: how many ranks own it
    for (const Parameter* p : trainable) owned[p].assign(static_cast<size_t>(p->shape().numel()), 0);
    for (int r = 0; r < world; ++r) {
      int64_t size = 0;
      for (const ParameterPiece& piece : shards.pieces(r)) {
        ASSERT_GT(piece.count, 0);
        EXPECT_GE(piece.flat, shards.bound(r));
        EXPECT_LE(piece.flat + piece.count, shards.bound(r + 1));
        // A piece starts at its tensor's start or on a block, and ends at its end or on one.
        EXPECT_EQ(piece.begin % adamw_lowmem::kBlock, 0) << piece.parameter->name();
        const int64_t end = piece.begin + piece.count;
        EXPECT_TRUE(end == piece.parameter->shape().numel() || end % adamw_lowmem::kBlock == 0);
        for (int64_t i = piece.begin; i < end; ++i) ++owned[piece.parameter][static_cast<size_t>(i)];
        size += piece.count;
      }
      EXPECT_EQ(size, shards.bound(r + 1) - shards.bound(r));
      // Balanced: each shard within one block of an equal share.
      EXPECT_LE(std::abs(size - total / world), adamw_lowmem::kBlock + 1);
    }
    for (const auto& [p, counts] : owned)
      for (char c : counts) ASSERT_EQ(c, 1) << p->name();
  }
}

// A tensor kept whole (Muon's matrices) is one rank's, and the cuts still balance the
// shards within half the largest such tensor.
TEST(ZeroShards, TensorsKeptWholeAreNeverCut) {
  Model model(shard_config(), shard_build());
  OptimConfig optim;
  optim.name = "muon";
  for (int world : {2, 3, 5}) {
    SCOPED_TRACE(::testing::Message() << world << " ranks");
    const ParameterShards shards = make_parameter_shards(optim, model.parameters(), 1.0, world);
    int64_t largest_whole = 0, whole_pieces = 0;
    for (const auto& p : model.parameters())
      if (p->trainable() && p->role() == ParamRole::matrix) largest_whole = std::max(largest_whole, p->shape().numel());
    for (int r = 0; r < world; ++r) {
      for (const ParameterPiece& piece : shards.pieces(r))
        if (piece.parameter->role() == ParamRole::matrix) {
          EXPECT_EQ(piece.count, piece.parameter->shape().numel()) << piece.parameter->name();
          ++whole_pieces;
        }
      const int64_t size = shards.bound(r + 1) - shards.bound(r);
      EXPECT_LE(std::abs(size - shards.total() / world), largest_whole / 2 + adamw_lowmem::kBlock + 1);
    }
    EXPECT_GT(whole_pieces, 0);
  }
}

// W ranks' sharded updates, simulated in one process over one model: each rank's
// optimizer updates its shard from the same gradients; the union of their results equals
// one whole optimizer's update, bit for bit, with fp32 and int8 moments and with Muon.
TEST(ZeroShards, ShardedUpdatesEqualOneWholeUpdate) {
  for (const char* state : {"fp32", "int8", "muon"}) {
    SCOPED_TRACE(state);
    OptimConfig optim;
    if (std::string(state) == "muon") optim.name = "muon";  // matrices whole per rank, AdamW for the rest
    else optim.adamw_state = state;
    Model whole_model(shard_config(), shard_build());
    Model sharded_model(shard_config(), shard_build());
    const int world = 3;
    const ParameterShards shards = make_parameter_shards(optim, sharded_model.parameters(), 1.0, world);
    auto whole = make_optimizer(whole_model.exec(), optim, whole_model.parameters(), 1.0);
    std::vector<std::unique_ptr<Optimizer>> ranks;
    for (int r = 0; r < world; ++r)
      ranks.push_back(make_optimizer(sharded_model.exec(), optim, sharded_model.parameters(), 1.0, &shards, r));
    Arena whole_state("whole state", Device::cpu), rank_state("rank state", Device::cpu);
    whole->plan(whole_state);
    for (auto& o : ranks) o->plan(rank_state);
    if (optim.name == "adamw")  // Muon's ranks each plan Newton-Schulz workspace too
      EXPECT_LT(rank_state.planned_bytes(), whole_state.planned_bytes() * 3 / 2);  // not 3 copies
    for (Model* m : {&whole_model, &sharded_model}) {
      m->allocate();
      m->init_weights(11);
    }
    whole_state.allocate();
    rank_state.allocate();
    const HostBatch batch = pack_docs(three_docs(), 4);
    for (int step = 0; step < 3; ++step) {
      for (Model* m : {&whole_model, &sharded_model}) {
        m->zero_grads();
        m->load_batch(batch);
        m->forward_backward(1.0 / static_cast<double>(batch.target_count));
      }
      whole->step(1e-2);
      for (auto& o : ranks) o->step(1e-2);  // each writes only its shard of the shared weights
    }
    for (size_t i = 0; i < whole_model.parameters().size(); ++i) {
      const Tensor a = whole_model.parameters()[i]->value(), b = sharded_model.parameters()[i]->value();
      ASSERT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << whole_model.parameters()[i]->name();
    }
    // The ranks' state slices, placed at their offsets, are the whole optimizer's state.
    std::map<std::string, Tensor> reference;
    for (const OptimizerStateTensor& t : whole->state_tensors()) reference[t.name] = t.tensor;
    std::map<std::string, int64_t> covered;
    for (auto& o : ranks)
      for (const OptimizerStateTensor& t : o->state_tensors()) {
        ASSERT_TRUE(t.sliced);
        ASSERT_TRUE(reference.count(t.name)) << t.name;
        const Tensor& full = reference[t.name];
        ASSERT_EQ(full.shape(), t.whole) << t.name;
        const size_t element = dtype_size(full.dtype());
        EXPECT_EQ(std::memcmp(static_cast<const unsigned char*>(full.raw()) + static_cast<size_t>(t.offset) * element,
                              t.tensor.raw(), t.tensor.nbytes()),
                  0)
            << t.name;
        covered[t.name] += t.tensor.numel();
      }
    ASSERT_EQ(covered.size(), reference.size());
    for (const auto& [name, t] : reference) EXPECT_EQ(covered[name], t.numel()) << name;
  }
}

// The trainer's memory check at W ranks (plan_rank_memory): ZeRO-1 counts its shard of the
// optimizer state and the gather's buffer, ZeRO-2 also its bound of the gradients (the
// largest shard plus what backward holds before its buckets go: train/memory_check.h), not
// the whole arena, which a ZeRO-2 rank never touches whole (core/arena.h: HostPages).
TEST(ZeroShards, TheMemoryCheckCountsARanksShareUnderZero) {
  const std::string path = test::source_dir() + "/configs/default.toml";
  const Config ddp = load_config(path, {"dist.bucket_mb=1"});
  const Config one = load_config(path, {"dist.bucket_mb=1", "dist.zero=1"});
  const Config two = load_config(path, {"dist.bucket_mb=1", "dist.zero=2"});
  const Config whole = load_config(path, {"dist.bucket_mb=0", "dist.zero=2"});
  const MemoryBudget full = plan_training_memory(ddp, Device::cpu);
  const ZeroBudget zero = plan_zero_memory(two, Device::cpu, 4);
  EXPECT_EQ(plan_rank_memory(ddp, Device::cpu, 4).total(), full.total());
  const MemoryBudget r1 = plan_rank_memory(one, Device::cpu, 4), r2 = plan_rank_memory(two, Device::cpu, 4);
  EXPECT_EQ(r1.gradients, full.gradients);
  EXPECT_EQ(r1.optimizer, zero.optimizer);
  EXPECT_EQ(r1.parameters, full.parameters + zero.gather_buffer);
  EXPECT_EQ(r2.gradients, zero.zero2_gradients);
  EXPECT_LT(r2.gradients, full.gradients);
  EXPECT_GT(r2.gradients, full.gradients / 4);
  EXPECT_EQ(r2.total(), r1.total() - (full.gradients - zero.zero2_gradients));
  // Without buckets the reduce-scatter runs after backward: the whole arena (its gradients,
  // without the arena's alignment padding).
  const size_t without = plan_rank_memory(whole, Device::cpu, 4).gradients;
  EXPECT_EQ(without, plan_zero_memory(whole, Device::cpu, 4).zero2_gradients);
  EXPECT_GT(without, full.gradients * 0.99);
  EXPECT_LE(without, full.gradients);
  // On the GPU ZeRO-2 keeps the whole arena allocated (train/data_parallel.h), with or
  // without buckets: the check counts all of it.
  const MemoryBudget gpu = plan_training_memory(ddp, Device::cuda);
  for (const Config* config : {&two, &whole}) {
    EXPECT_EQ(plan_zero_memory(*config, Device::cuda, 4).zero2_gradients, gpu.gradients);
    EXPECT_EQ(plan_rank_memory(*config, Device::cuda, 4).gradients, gpu.gradients);
  }
}

// A pipeline rank that builds only its stages' layers (dist.pipeline_model = "stages") is
// planned as that model: its parameters, gradients and optimizer state its stages', about
// half of the model's for half of the layers (a tied table on both ends); ZeRO shards them
// over the stage's replicas. A pipeline's ZeRO-2 holds the whole arena until its one
// reduction after the schedule, buckets or not.
TEST(ZeroShards, TheMemoryCheckPlansAStagesModelUnderAPipeline) {
  const std::string path = test::source_dir() + "/configs/default.toml";
  const std::vector<std::string> staged = {"dist.pipeline_stages=2", "dist.pipeline_model=stages", "dist.bucket_mb=1"};
  const auto with = [&](std::vector<std::string> keys) {
    keys.insert(keys.end(), staged.begin(), staged.end());
    return load_config(path, keys);
  };
  const Config plain = with({}), one = with({"dist.zero=1"}), two = with({"dist.zero=2"});
  ASSERT_EQ(plain.model.layers, 4);
  const StageLayers first = {{0, 2}}, last = {{2, 4}};
  const MemoryBudget whole = plan_training_memory(plain, Device::cpu);
  const MemoryBudget a = plan_training_memory(plain, Device::cpu, first), b = plan_training_memory(plain, Device::cpu, last);
  EXPECT_EQ(plan_rank_memory(plain, Device::cpu, 2, first).total(), a.total());
  for (const MemoryBudget* stage : {&a, &b}) {
    EXPECT_LT(stage->parameters, whole.parameters * 0.75);
    EXPECT_GT(stage->parameters, whole.parameters * 0.25);
    EXPECT_LT(stage->optimizer, whole.optimizer * 0.75);
  }
  // The two stages hold every parameter, the tied table twice.
  EXPECT_GE(a.parameters + b.parameters, whole.parameters);
  const ZeroBudget zero = plan_zero_memory(two, Device::cpu, 2, first);
  const MemoryBudget r1 = plan_rank_memory(one, Device::cpu, 2, first), r2 = plan_rank_memory(two, Device::cpu, 2, first);
  EXPECT_EQ(r1.optimizer, zero.optimizer);
  EXPECT_LT(r1.optimizer, a.optimizer * 0.6);
  EXPECT_GT(r1.optimizer, a.optimizer * 0.4);
  EXPECT_EQ(r1.parameters, a.parameters + zero.gather_buffer);
  EXPECT_GT(r2.gradients, a.gradients * 0.99);  // the whole arena until the schedule's end
  EXPECT_LE(r2.gradients, a.gradients);
}

}  // namespace
}  // namespace kiln
