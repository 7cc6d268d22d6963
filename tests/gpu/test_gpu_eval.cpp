// [eval] on the GPU: a run trained on the device evaluates its own model every eval.every
// steps and at the end, on the device, batched through the KV-cache decoder; its last
// evaluation equals `kiln eval --device cuda` of the saved model, and `kiln eval --device
// cpu` (fp32) agrees with both within bf16's reach.
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace kiln {
namespace {

std::vector<nlohmann::json> eval_records(const std::string& out_dir) {
  std::vector<nlohmann::json> records;
  std::ifstream in(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == "eval") records.push_back(j);
  }
  return records;
}

nlohmann::json kiln_eval(const std::string& model, const std::string& device, const std::string& json_path,
                         const std::string& files) {
  std::string out;
  EXPECT_EQ(test::run_command(test::kiln_binary() + " eval " + model + " --device " + device + files + " --json " +
                                  json_path + " 2>&1",
                              &out),
            0)
      << out;
  return nlohmann::json::parse(test::read_file(json_path));
}

TEST(GpuEval, TrainingEvaluationsEqualKilnEvalOfTheSavedModel) {
  const std::string dir = test::temp_dir("kiln-gpu-eval"), out = dir + "/run";
  const std::string task = test::source_dir() + "/data/eval/shakespeare_cloze.jsonl";
  const std::string text = test::source_dir() + "/data/eval/shakespeare_held_out.txt";
  std::string log;
  const std::string train = test::kiln_binary() + " train " + test::source_dir() + "/configs/default.toml --set data.path=" +
                            test::source_dir() + "/data/tinyshakespeare.txt --set train.out_dir=" + out +
                            " --set train.device=cuda --set train.steps=40 --set checkpoint.every=0"
                            " --set train.sample_every=0 --set log.plot=false --set eval.every=20 --set eval.tasks=" +
                            task + " --set eval.texts=" + text + " 2>&1";
  ASSERT_EQ(test::run_command(train, &log), 0) << log;
  EXPECT_NE(log.find("evaluation at step 20"), std::string::npos) << log;
  const std::vector<nlohmann::json> records = eval_records(out);
  ASSERT_EQ(records.size(), 2u) << log;
  EXPECT_EQ(records[0]["step"], 20);
  EXPECT_EQ(records[1]["step"], 40);
  // The model learned between the two evaluations (the weights the evaluator reads moved).
  EXPECT_LT(records[1]["shakespeare_held_out/bits_per_byte"].get<double>(),
            records[0]["shakespeare_held_out/bits_per_byte"].get<double>());

  const std::string files = " --task " + task + " --text " + text;
  const nlohmann::json cuda = kiln_eval(out + "/model", "cuda", dir + "/cuda.json", files);
  const nlohmann::json cpu = kiln_eval(out + "/model", "cpu", dir + "/cpu.json", files);
  const nlohmann::json& last = records.back();
  const nlohmann::json &cuda_task = cuda["tasks"]["shakespeare_cloze"], &cpu_task = cpu["tasks"]["shakespeare_cloze"];
  const nlohmann::json &cuda_text = cuda["texts"]["shakespeare_held_out"], &cpu_text = cpu["texts"]["shakespeare_held_out"];
  // The same bf16 weights, the same decoder: the same numbers.
  EXPECT_DOUBLE_EQ(last["shakespeare_cloze/acc"].get<double>(), cuda_task["acc"].get<double>());
  EXPECT_DOUBLE_EQ(last["shakespeare_cloze/acc_norm"].get<double>(), cuda_task["acc_norm"].get<double>());
  EXPECT_NEAR(last["shakespeare_held_out/bits_per_byte"].get<double>(), cuda_text["bits_per_byte"].get<double>(), 1e-6);
  // fp32 on the CPU: within bf16's rounding of the weights and activations (measured
  // 4e-5 relative on a 300-step run); a near-tie may flip a choice or two of the 100.
  const double bpb = cpu_text["bits_per_byte"].get<double>();
  EXPECT_NEAR(cuda_text["bits_per_byte"].get<double>(), bpb, 1e-3 * bpb);
  EXPECT_NEAR(cuda_task["acc"].get<double>(), cpu_task["acc"].get<double>(), 0.021);
  EXPECT_NEAR(cuda_task["acc_norm"].get<double>(), cpu_task["acc_norm"].get<double>(), 0.021);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
