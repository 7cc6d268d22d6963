// Multi-token prediction ([model.mtp], model/multi_token_prediction.h): its inputs never
// cross a sequence, its gradient (both forms, every parameter) against fp64 finite
// differences of the weighted objective, the main loss and validation untouched by it, its
// losses reported per depth over their own targets, a killed run resuming bitwise, and the
// exports leaving its tensors out.
#include "config/mtp_weights.h"
#include "fault_test_util.h"
#include "grad_check.h"
#include "tiny_model.h"

#include <gtest/gtest.h>

namespace kiln {
namespace {

using namespace kiln::test;
namespace fs = std::filesystem;

ModelConfig mtp_config(const std::string& form, int64_t depth, bool tie) {
  ModelConfig c = tiny_config(true, tie);
  c.mtp.depth = depth;
  c.mtp.form = form;
  return c;
}

TEST(Mtp, StagedInputsStayInsideTheirSequence) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  const int64_t t = 24, depth = 2, rows = batch.size();
  std::vector<int32_t> in(static_cast<size_t>(MultiTokenPrediction::input_ints(t, depth)), 99);
  MultiTokenPrediction::stage_inputs(batch, t, depth, in.data());
  for (int64_t k = 1; k <= depth; ++k) {
    const int32_t* tokens = in.data() + 3 * (k - 1) * t;
    const int32_t* targets = tokens + t;
    const int32_t* from = targets + t;
    int64_t with_target = 0;
    for (size_t s = 0; s + 1 < batch.cu_seqlens.size(); ++s) {
      const int32_t begin = batch.cu_seqlens[s], end = batch.cu_seqlens[s + 1];
      for (int32_t i = begin; i < end; ++i) {
        const bool inside = i + k < end;
        EXPECT_EQ(tokens[i], batch.tokens[static_cast<size_t>(inside ? i + k : i)]) << "k " << k << " row " << i;
        EXPECT_EQ(targets[i], inside ? batch.targets[static_cast<size_t>(i + k)] : kIgnoreTarget) << "row " << i;
        EXPECT_EQ(from[i], i - k >= begin ? i - k : t) << "k " << k << " row " << i;
        with_target += targets[i] != kIgnoreTarget;
      }
    }
    for (int64_t i = rows; i < t; ++i) EXPECT_EQ(targets[i], kIgnoreTarget);
    // Three documents of 15 targets lose k targets each; the PAD tail had none.
    EXPECT_EQ(with_target, batch.target_count - 3 * k);
  }
}

TEST(Mtp, WeightsDefaultToEachFormsAndParseByKey) {
  ModelConfig m;
  m.mtp.depth = 2;
  MtpLossWeights w = mtp_loss_weights(m);
  EXPECT_EQ(w.main, 1.0);
  EXPECT_EQ(w.depths, (std::vector<double>{0.05, 0.05}));
  m.mtp.form = "parallel";
  w = mtp_loss_weights(m);
  EXPECT_DOUBLE_EQ(w.main, 1.0 / 3);
  EXPECT_EQ(w.depths.size(), 2u);
  m.mtp.weights = "0.3, 0.1";
  w = mtp_loss_weights(m);
  EXPECT_EQ(w.main, 1.0);
  EXPECT_EQ(w.depths, (std::vector<double>{0.3, 0.1}));
  m.mtp.weights = "0.3";
  EXPECT_CONTAINS(error_of([&] { mtp_loss_weights(m); }), "model.mtp.weights = '0.3' gives 1 weights");
  m.mtp.weights = "0.3,x";
  EXPECT_CONTAINS(error_of([&] { mtp_loss_weights(m); }), "'x' is not a non-negative number");
  m.mtp.depth = 0;
  EXPECT_CONTAINS(error_of([&] { mtp_loss_weights(m); }), "needs model.mtp.depth > 0");
}

// forward_backward's gradient of every parameter against finite differences of the
// objective it differentiates: sum over the losses of weight x sum / the main targets.
void check_mtp_gradient(const ModelConfig& config) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  Model m(config, tiny_build(24, 7));
  m.allocate();
  init_tiny_model(m, 11);
  m.load_batch(batch);
  const double scale = 1.0 / static_cast<double>(batch.target_count);
  const MtpLossWeights w = mtp_loss_weights(config);
  std::vector<int> slots;
  for (int64_t k = 1; k <= config.mtp.depth; ++k) slots.push_back(m.loss_terms().find(fmt::format("mtp.{}", k)));
  const auto objective = [&] {
    const LossSums s = m.evaluate_objective();
    double sum = w.main * s.loss;
    for (size_t k = 0; k < slots.size(); ++k) sum += w.depths[k] * s.slot[static_cast<size_t>(slots[k])];
    return sum * scale;
  };
  ScopedCpuThreads one_thread(1);
  m.zero_grads();
  const LossSums fb = m.forward_backward(scale);
  const LossSums ev = m.evaluate_objective();
  for (int slot : slots) {
    ASSERT_GE(slot, 0);
    EXPECT_NEAR(fb.slot[static_cast<size_t>(slot)], ev.slot[static_cast<size_t>(slot)], 1e-12);
    EXPECT_GT(ev.slot[static_cast<size_t>(slot)], 0.0);
  }
  expect_parameter_gradients_match(m, objective);
  int64_t mtp_params = 0;
  for (const auto& p : m.parameters()) mtp_params += p->training_only();
  EXPECT_GT(mtp_params, 0);
}

TEST(Mtp, SequentialModulesMatchFiniteDifferences) {
  for (bool tie : {true, false}) {
    SCOPED_TRACE(fmt::format("tie {}", tie));
    check_mtp_gradient(mtp_config("sequential", 2, tie));
  }
}

TEST(Mtp, ParallelHeadsMatchFiniteDifferences) {
  check_mtp_gradient(mtp_config("parallel", 2, true));
}

// The heads read the backbone and leave it be: the same backbone weights (parameters are
// initialized by index, and the heads' come last) give the same validation loss, the same
// main loss in training, and other backbone gradients.
TEST(Mtp, TheMainLossAndValidationAreTheBackbonesAlone) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  const double scale = 1.0 / static_cast<double>(batch.target_count);
  Model plain(tiny_config(true, true), tiny_build(24, 7));
  Model with(mtp_config("sequential", 1, true), tiny_build(24, 7));
  for (Model* m : {&plain, &with}) {
    m->allocate();
    m->init_weights(5);
    m->load_batch(batch);
    m->zero_grads();
  }
  EXPECT_EQ(plain.evaluate().loss, with.evaluate().loss);
  const LossSums a = plain.forward_backward(scale), b = with.forward_backward(scale);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.count, b.count);
  const int slot = with.loss_terms().find("mtp.1");
  ASSERT_GE(slot, 0);
  // Reported over its own targets (three fewer: one per document).
  const double mean = with.loss_terms().value(slot, b.slot, b.count, 1);
  EXPECT_DOUBLE_EQ(mean, b.slot[static_cast<size_t>(slot)] / static_cast<double>(batch.target_count - 3));
  EXPECT_NE(values_of(plain.find_parameter("embed.weight")->grad()),
            values_of(with.find_parameter("embed.weight")->grad()));
}

class MtpRun : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = temp_dir("kiln-mtp"); }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  std::string dir_;
};

TEST_F(MtpRun, AKilledRunResumesBitwiseLogsEachDepthAndExportsWithoutTheHeads) {
  const std::string corpus = write_tiny_corpus(dir_, 40);
  const std::string straight = dir_ + "/straight", killed = dir_ + "/killed";
  const std::string mtp = "--set model.mtp.depth=2 ";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, straight, mtp), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "mtp.2");
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, mtp), "kill_at_step:7", &output), -SIGKILL) << output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, mtp + "--resume"), "", &output), 0) << output;
  const auto ra = train_records(straight), rb = train_records(killed);
  ASSERT_EQ(ra.size(), rb.size());
  for (size_t i = 0; i < ra.size(); ++i) EXPECT_EQ(ra[i], rb[i]) << "step " << ra[i].step;
  EXPECT_EQ(read_file(straight + "/model/model.safetensors"), read_file(killed + "/model/model.safetensors"));
  const auto steps = metrics_of_kind(straight, "train");
  ASSERT_FALSE(steps.empty());
  for (const char* key : {"mtp.1", "mtp.2"}) {
    ASSERT_TRUE(steps.back().contains(key)) << steps.back().dump();
    EXPECT_GT(steps.back()[key].get<double>(), 0.0);
  }
  ASSERT_EQ(run_command(kiln_binary() + " export hf " + straight + " " + dir_ + "/hf", &output), 0) << output;
  EXPECT_CONTAINS(output, "left out");
  const std::string weights = read_file(dir_ + "/hf/model.safetensors");
  EXPECT_EQ(weights.find("mtp."), std::string::npos);
  // DeepSeek-V3 would name module k layer L + k - 1: tiny_train has one layer (0).
  EXPECT_EQ(weights.find("model.layers.1."), std::string::npos);
}

}  // namespace
}  // namespace kiln
