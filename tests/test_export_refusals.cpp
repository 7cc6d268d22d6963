// Components that no stock Hugging Face class or llama.cpp graph computes -- Gemma's RMSNorm,
// DyT (as the block norms or the q/k norm), the ungated MLPs and a final norm of another kind
// than the blocks' -- are refused by
// `kiln export hf` and `kiln export gguf` alike: exit non-zero, one error line naming the
// config key and its value, and nothing written at the destination.
#include "export_fixture.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

namespace kiln {
namespace {

namespace fs = std::filesystem;

struct Refused {
  const char* name;  // the case, also its directory
  void (*apply)(ModelConfig&);
  const char* key_and_value;  // what the error line must name
};

const Refused kRefused[] = {
    {"dyt_norm", [](ModelConfig& c) { c.norm = "dyt"; }, "model.norm = 'dyt'"},
    {"gemma_norm", [](ModelConfig& c) { c.norm = "gemma_rmsnorm"; }, "model.norm = 'gemma_rmsnorm'"},
    {"dyt_qk_norm", [](ModelConfig& c) { c.qk_norm_type = "dyt"; }, "model.qk_norm_type = 'dyt'"},
    {"gemma_qk_norm", [](ModelConfig& c) { c.qk_norm_type = "gemma_rmsnorm"; },
     "model.qk_norm_type = 'gemma_rmsnorm'"},
    {"gelu_mlp", [](ModelConfig& c) { c.mlp = "gelu"; }, "model.mlp = 'gelu'"},
    {"relu2_mlp", [](ModelConfig& c) { c.mlp = "relu2"; }, "model.mlp = 'relu2'"},
    // An ungated MLP chosen per layer is refused under the key that chose it.
    {"relu2_alt_mlp",
     [](ModelConfig& c) {
       c.alt_mlp = "relu2";
       c.alt_mlp_layers = "1";
     },
     "model.alt_mlp = 'relu2'"},
    {"embed_scale", [](ModelConfig& c) { c.embed_scale = 8; }, "model.embed_scale = 8"},
    {"final_norm", [](ModelConfig& c) { c.final_norm = "layernorm"; }, "model.final_norm = 'layernorm'"},
    // GPT-OSS's sinks: no family kiln exports carries them.
    {"attention_sinks", [](ModelConfig& c) { c.attention_sinks = true; }, "model.attention_sinks = true"},
    // KDA: no stock family computes it; a hybrid is refused under the key of its KDA layers.
    {"kda", [](ModelConfig& c) { c.attention = "kda"; }, "model.attention = 'kda'"},
    {"kda_alt",
     [](ModelConfig& c) {
       c.alt_attention = "kda";
       c.alt_attention_layers = "1";
     },
     "model.alt_attention = 'kda'"},
    // NoPE MLA: no stock family kiln exports has it.
    {"mla", [](ModelConfig& c) { c.attention = "mla"; }, "model.attention = 'mla'"},
};

// Runs an export expected to be refused; checks the one line it prints names what it must.
void expect_refused(const std::string& command, const std::string& key_and_value) {
  std::string output;
  EXPECT_NE(test::run_command(command, &output), 0) << command << "\n" << output;
  EXPECT_EQ(output.rfind("kiln: error: [export] " + key_and_value + ": ", 0), 0u) << output;
  EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << "not one line:\n" << output;
}

TEST(ExportRefusals, UnexportableComponentsNameTheirKeyAndWriteNothing) {
  const std::string root = test::temp_dir("kiln-export-refusals");
  for (const Refused& r : kRefused) {
    SCOPED_TRACE(r.name);
    ModelConfig c = test::tiny_config(true, true, false);  // a Qwen3 but for the one change
    r.apply(c);
    const std::string model = test::save_random_model(c, root + "/" + r.name + "/model");
    const std::string hf_out = root + "/" + r.name + "/hf", gguf_out = root + "/" + r.name + "/model.gguf";
    expect_refused(test::kiln_binary() + " export hf " + model + " " + hf_out, r.key_and_value);
    expect_refused(test::kiln_binary() + " export gguf " + model + " " + gguf_out, r.key_and_value);
    EXPECT_FALSE(fs::exists(hf_out));
    EXPECT_FALSE(fs::exists(gguf_out));
  }
  fs::remove_all(root);
}

// What Hugging Face's Dots1 holds but llama.cpp's dots1 graph does not: no shared expert
// (it always reads one), a tied head (it reads a separate output matrix) and grouped-query
// attention (it reads k and v with as many heads as q). The HF export
// of the same model goes through; the GGUF one is refused in one line, writing nothing.
TEST(ExportRefusals, Dots1ModelsLlamaCppCannotReadAreRefusedForGgufOnly) {
  const std::string root = test::temp_dir("kiln-export-refusals-dots1");
  struct GgufOnly {
    const char* name;
    bool tied;
    int64_t shared_hidden, kv_heads;
    const char* key_and_value;
  };
  const GgufOnly kCases[] = {{"no_shared_expert", false, 0, 4, "model.moe.shared_hidden = 0"},
                             {"tied", true, 32, 4, "model.tie_embeddings = true"},
                             {"grouped_query", false, 32, 2, "model.kv_heads = 2"}};
  for (const GgufOnly& g : kCases) {
    SCOPED_TRACE(g.name);
    ModelConfig c = test::tiny_config(true, g.tied, false);
    c.kv_heads = g.kv_heads;
    c.mlp = "moe";
    c.alt_mlp = "swiglu";
    c.alt_mlp_layers = "0";
    c.moe.experts = 4;
    c.moe.expert_hidden = 32;
    c.moe.router = "sigmoid_bias";
    c.moe.shared_hidden = g.shared_hidden;
    const std::string model = test::save_random_model(c, root + "/" + g.name + "/model");
    const std::string hf_out = root + "/" + g.name + "/hf", gguf_out = root + "/" + g.name + "/model.gguf";
    std::string output;
    EXPECT_EQ(test::run_command(test::kiln_binary() + " export hf " + model + " " + hf_out, &output), 0) << output;
    EXPECT_TRUE(fs::exists(hf_out + "/config.json"));
    expect_refused(test::kiln_binary() + " export gguf " + model + " " + gguf_out, g.key_and_value);
    EXPECT_FALSE(fs::exists(gguf_out));
  }
  fs::remove_all(root);
}

// Partial rotary: the stock Llama/Qwen classes rotate the whole head (they ignore
// partial_rotary_factor), so the HF export is refused; llama.cpp's qwen3/qwen2 rotate the
// first rope.dimension_count dims (Gguf.PartialRotaryWritesTheRotatedDimsAndReordersQk), its
// llama refuses fewer than head_dim, so the GGUF export of a llama-shaped model is refused.
TEST(ExportRefusals, PartialRotaryIsRefusedForHfAndForGgufLlama) {
  const std::string root = test::temp_dir("kiln-export-refusals-partial-rotary");
  for (const bool qwen3 : {true, false}) {
    SCOPED_TRACE(qwen3 ? "qwen3" : "llama");
    ModelConfig c = test::tiny_config(qwen3, true, false);
    c.rope.fraction = 0.5;
    const std::string dir = root + (qwen3 ? "/qwen3" : "/llama");
    const std::string model = test::save_random_model(c, dir + "/model");
    expect_refused(test::kiln_binary() + " export hf " + model + " " + dir + "/hf", "model.rope.fraction = 0.5");
    EXPECT_FALSE(fs::exists(dir + "/hf"));
    const std::string gguf = test::kiln_binary() + " export gguf " + model + " " + dir + "/model.gguf";
    if (qwen3) {
      std::string output;
      EXPECT_EQ(test::run_command(gguf, &output), 0) << output;
      EXPECT_TRUE(fs::exists(dir + "/model.gguf"));
    } else {
      expect_refused(gguf, "model.rope.fraction = 0.5");
      EXPECT_FALSE(fs::exists(dir + "/model.gguf"));
    }
  }
  fs::remove_all(root);
}

// The unmodified model exports, so the refusals above come from the one change each made.
TEST(ExportRefusals, TheUnchangedModelExports) {
  const std::string root = test::temp_dir("kiln-export-refusals-control");
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), root + "/model");
  std::string output;
  EXPECT_EQ(test::run_command(test::kiln_binary() + " export hf " + model + " " + root + "/hf", &output), 0) << output;
  EXPECT_TRUE(fs::exists(root + "/hf/config.json"));
  EXPECT_EQ(test::run_command(test::kiln_binary() + " export gguf " + model + " " + root + "/model.gguf", &output), 0)
      << output;
  EXPECT_TRUE(fs::exists(root + "/model.gguf"));
  fs::remove_all(root);
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// Issue 38: the export ran, then failed its rename into place with "cannot rename ...:
// Success" (the error code was overwritten by the cleanup's).
TEST(ExportRefusals, AGgufOutputThatIsADirectoryIsRefusedFirst) {
  const std::string root = test::temp_dir("kiln-export-gguf-dir");
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), root + "/model");
  fs::create_directories(root + "/out.gguf");
  std::string output;
  EXPECT_EQ(test::run_command(test::kiln_binary() + " export gguf " + model + " " + root + "/out.gguf", &output), 1);
  EXPECT_EQ(output, "kiln: error: [export] " + root + "/out.gguf: is a directory; the output is a .gguf file\n");
  fs::remove_all(root);
}

}  // namespace
}  // namespace kiln
