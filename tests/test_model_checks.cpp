// What `kiln sample`, `kiln export` (and serve, score, eval-quant: the same loader) check
// before they use a model: a checkpoint directory's manifest checksums, and weights that
// are finite and not all zero. They used to sample from or export a damaged checkpoint, NaN
// weights or a file of zeros without a word.
#include "export_fixture.h"
#include "fault_test_util.h"

#include <cmath>
#include <filesystem>
#include <limits>

namespace kiln {
namespace {

namespace fs = std::filesystem;

class ModelChecks : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::temp_dir("kiln-model-checks"); }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  // A model directory with random weights, edited by `change` before it is saved.
  std::string save_model(const std::string& name, const std::function<void(Model&)>& change) {
    const ModelConfig c = test::tiny_config(true, true, false);
    BuildOptions o;
    o.training = false;
    o.max_tokens = c.max_seq_len;
    Model model(c, o);
    model.allocate();
    test::randomize_weights(model, 4);
    change(model);
    Config full;
    full.model = c;
    io::save_model(model, full, dir_ + "/" + name);
    return dir_ + "/" + name;
  }
  // `kiln sample`, `kiln export hf` and `kiln export gguf` of `model`: each must fail with
  // one line containing `message`, and write nothing.
  void expect_refused_everywhere(const std::string& model, const std::string& message) {
    const std::string kiln = test::kiln_binary();
    for (const std::string& command : {kiln + " sample " + model + " -n 4", kiln + " export hf " + model + " " + dir_ +
                                                                              "/hf-out",
                                       kiln + " export gguf " + model + " " + dir_ + "/out.gguf"}) {
      SCOPED_TRACE(command);
      std::string output;
      EXPECT_EQ(test::run_command(command, &output), 1) << output;
      EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
      EXPECT_CONTAINS(output, message);
    }
    EXPECT_FALSE(fs::exists(dir_ + "/hf-out"));
    EXPECT_FALSE(fs::exists(dir_ + "/out.gguf"));
  }
  std::string dir_;
};

TEST_F(ModelChecks, ACheckpointLoadedAsAModelIsVerifiedAgainstItsManifest) {
  const std::string corpus = test::write_tiny_corpus(dir_, 40);
  std::string output;
  ASSERT_EQ(test::run_with_fault(test::tiny_train(corpus, dir_ + "/run", "--set train.steps=4"), "", &output), 0)
      << output;
  const std::string ckpt = test::checkpoint_path(dir_ + "/run", 4), weights = ckpt + "/model.safetensors";
  std::string bytes = test::read_file(weights);
  bytes[bytes.size() - 8] ^= 0x01;  // the low bit of a weight's mantissa: finite, plausible, wrong
  test::write_file(weights, bytes);
  expect_refused_everywhere(ckpt, "kiln: error: [checkpoint] " + weights + ": checksum mismatch");
  // The run directory resolves to the same checkpoint when there is no model/.
  fs::remove_all(dir_ + "/run/model");
  expect_refused_everywhere(dir_ + "/run", weights + ": checksum mismatch");

  // A checkpoint whose save never finished (state.json, no manifest) is not a model either.
  fs::remove(ckpt + "/manifest.json");
  expect_refused_everywhere(ckpt, "[checkpoint] " + ckpt + ": incomplete checkpoint (no manifest.json)");
}

TEST_F(ModelChecks, NonFiniteWeightsAreRefusedNamingTheTensor) {
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(bad);
    const std::string model = save_model(std::isnan(bad) ? "nan" : "inf", [&](Model& m) {
      const Tensor w = m.find_parameter("layers.1.mlp.down_proj.weight")->value();
      const float values[3] = {bad, 1.0f, bad};
      copy_tensor(Tensor(const_cast<float*>(values), DType::f32, Device::cpu, Shape{3}),
                  w.view(Shape{w.numel()}).rows(5, 8));
    });
    expect_refused_everywhere(model, "kiln: error: [load] " + model +
                                         "/model.safetensors: tensor 'layers.1.mlp.down_proj.weight' holds 2 "
                                         "non-finite values (NaN/Inf) of 6144");
  }
}

// All-zero weights (a file of zeros, a copy never written) are refused; one zero matrix
// among trained ones is a warning and the model is used.
TEST_F(ModelChecks, AllZeroWeightsAreRefusedAndAZeroMatrixIsAWarning) {
  const std::string zeros = save_model("zeros", [](Model& m) {
    for (const auto& p : m.parameters()) zero_tensor(p->value());
  });
  expect_refused_everywhere(zeros, "kiln: error: [load] " + zeros +
                                       "/model.safetensors: every weight matrix is zero: there is no trained model");

  const std::string one = save_model("one-zero", [](Model& m) { zero_tensor(m.find_parameter("layers.0.attn.o_proj.weight")->value()); });
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " sample " + one + " -p hi -n 4", &output), 0) << output;
  EXPECT_CONTAINS(output, "kiln: warning: [load] " + one + "/model.safetensors: weight matrix 'layers.0.attn.o_proj.weight' is all zeros");
}

}  // namespace
}  // namespace kiln
