// ZeRO's optimizer shard files (train/optimizer_shard_files.h) in one process: slices
// written at one set of cuts are read back at another (ZeRO at another world size) and
// whole (a run without ZeRO), element for element; files that do not fit together are
// refused naming the file or the tensor.
#include "test_util.h"
#include "train/optimizer_shard_files.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace kiln {
namespace {

using namespace kiln::test;

// Two state tensors, whole: "w.exp_avg" f32 [4, 10] holding 0.5 * i, "b.absmax" u8 [7] holding 3 * i.
struct WholeState {
  OwnedTensor w{DType::f32, Device::cpu, Shape{4, 10}};
  OwnedTensor b{DType::u8, Device::cpu, Shape{7}};
  WholeState() {
    for (int64_t i = 0; i < 40; ++i) w->data<float>()[i] = 0.5f * static_cast<float>(i);
    for (int64_t i = 0; i < 7; ++i) b->data<uint8_t>()[i] = static_cast<uint8_t>(3 * i);
  }
};

// The slices of `whole` at cuts `w_cuts` and `b_cuts` (rank r: [cuts[r], cuts[r + 1])),
// viewing its memory, as a ZeRO rank's state_tensors() gives them.
std::vector<OptimizerStateTensor> slices_of(const WholeState& whole, const std::vector<int64_t>& w_cuts,
                                            const std::vector<int64_t>& b_cuts, int rank) {
  std::vector<OptimizerStateTensor> out;
  const auto add = [&](const char* name, const Tensor& t, const std::vector<int64_t>& cuts) {
    const int64_t begin = cuts[static_cast<size_t>(rank)], count = cuts[static_cast<size_t>(rank) + 1] - begin;
    if (count == 0) return;  // a rank may hold none of a tensor
    const Tensor view(static_cast<unsigned char*>(t.raw()) + begin * static_cast<int64_t>(dtype_size(t.dtype())),
                      t.dtype(), Device::cpu, Shape{count});
    out.push_back({name, view, true, t.shape(), begin});
  };
  add("w.exp_avg", *whole.w, w_cuts);
  add("b.absmax", *whole.b, b_cuts);
  return out;
}

class OptimizerShardFiles : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = temp_dir("kiln_optimizer_shards"); }
  void TearDown() override {
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  // Writes `whole` as `world` shard files cut at the cuts given; returns their paths.
  std::vector<std::string> write(const WholeState& whole, const std::vector<int64_t>& w_cuts,
                                 const std::vector<int64_t>& b_cuts) {
    const int world = static_cast<int>(w_cuts.size()) - 1;
    std::vector<std::string> paths;
    for (int r = 0; r < world; ++r) {
      paths.push_back(dir_ + "/" + optimizer_shard_name(r, world));
      write_optimizer_shard(paths.back(), slices_of(whole, w_cuts, b_cuts, r), "adamw", 5, r, world);
    }
    return paths;
  }
  std::string dir_;
};

TEST_F(OptimizerShardFiles, NamesCountRanksFromZero) {
  EXPECT_EQ(optimizer_shard_name(1, 4), "optimizer.rank-00001-of-00004.safetensors");
}

TEST_F(OptimizerShardFiles, SlicesWrittenAtOneCutAreReadAtAnotherAndWhole) {
  const WholeState saved;
  // 3 ranks; rank 2 holds none of b.
  const std::vector<std::string> paths = write(saved, {0, 13, 27, 40}, {0, 4, 7, 7});
  // 2 ranks cutting elsewhere (w at 20, b at 2): each fills its slices of a fresh state.
  const WholeState fresh;
  std::memset(fresh.w->raw(), 0, fresh.w->nbytes());
  std::memset(fresh.b->raw(), 0, fresh.b->nbytes());
  for (int r = 0; r < 2; ++r) read_optimizer_shards(paths, slices_of(fresh, {0, 20, 40}, {0, 2, 7}, r), false);
  for (int64_t i = 0; i < 40; ++i) EXPECT_EQ(fresh.w->data<float>()[i], 0.5f * static_cast<float>(i)) << i;
  for (int64_t i = 0; i < 7; ++i) EXPECT_EQ(fresh.b->data<uint8_t>()[i], 3 * i) << i;
  // Whole, as a run without ZeRO holds them (its own shapes; no slice).
  const WholeState whole;
  std::memset(whole.w->raw(), 0, whole.w->nbytes());
  std::memset(whole.b->raw(), 0, whole.b->nbytes());
  read_optimizer_shards(paths, {{"w.exp_avg", *whole.w}, {"b.absmax", *whole.b}}, true);
  EXPECT_EQ(std::memcmp(whole.w->raw(), saved.w->raw(), saved.w->nbytes()), 0);
  EXPECT_EQ(std::memcmp(whole.b->raw(), saved.b->raw(), saved.b->nbytes()), 0);
}

TEST_F(OptimizerShardFiles, FilesThatDoNotFitTogetherAreRefusedByName) {
  const WholeState saved;
  const std::vector<std::string> paths = write(saved, {0, 13, 27, 40}, {0, 4, 7, 7});
  const WholeState whole;
  const std::vector<OptimizerStateTensor> both = {{"w.exp_avg", *whole.w}, {"b.absmax", *whole.b}};
  // Two of the three files: the second is rank 1 of 3, not of 2.
  EXPECT_EQ(error_of([&] { read_optimizer_shards({paths[0], paths[1]}, both, true); }),
            "[checkpoint] " + paths[0] + ": holds rank 0 of 3, expected rank 0 of 2");
  // A state tensor this run keeps at another shape.
  OwnedTensor wide(DType::f32, Device::cpu, Shape{5, 10});
  EXPECT_EQ(error_of([&] { read_optimizer_shards(paths, {{"w.exp_avg", *wide}}, false); }),
            "[checkpoint] " + paths[0] + ": optimizer state 'w.exp_avg' is f32 [4, 10], this run keeps it as f32 [5, 10]");
  // A tensor of the files this optimizer does not have, when it holds the whole state.
  EXPECT_EQ(error_of([&] { read_optimizer_shards(paths, {{"w.exp_avg", *whole.w}}, true); }),
            "[checkpoint] " + paths[0] + ": tensor 'b.absmax' does not belong to this optimizer");
  // One this optimizer has that no file holds.
  OwnedTensor other(DType::f32, Device::cpu, Shape{3});
  EXPECT_EQ(error_of([&] { read_optimizer_shards(paths, {{"c.exp_avg", *other}}, false); }),
            "[checkpoint] " + dir_ + ": no optimizer shard file holds optimizer state 'c.exp_avg'");
  // Files whose slices leave a hole (rank 1's part of w left out).
  std::filesystem::remove_all(dir_);
  std::filesystem::create_directories(dir_);
  const std::vector<std::string> holed = write(saved, {0, 13, 13, 40}, {0, 4, 7, 7});
  EXPECT_NO_THROW(read_optimizer_shards(holed, both, true));  // every element is some rank's
  write_optimizer_shard(holed[1], {}, "adamw", 5, 1, 3);  // rank 1 wrote nothing: b's [4, 7) is gone
  EXPECT_EQ(error_of([&] { read_optimizer_shards(holed, both, true); }),
            "[checkpoint] " + dir_ + ": the 3 optimizer shard files hold 4 of the 7 elements of optimizer state 'b.absmax' "
            "this rank needs");
}

}  // namespace
}  // namespace kiln
