// Hugging Face export and import: the files are checked by the `safetensors` and
// `tokenizers` Python packages (tests/python/check_hf_export.py), import(export(model))
// reproduces every weight bit for bit (fp32) and the same loss, and models or files that no
// stock class represents are refused with an error naming the reason.
#include "export_fixture.h"
#include "io/gguf_export.h"
#include "io/hf_config.h"
#include "io/hf_export.h"
#include "io/hf_import.h"
#include "io/safetensors.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const char* kText = "Ünïcödé and ASCII: the quick brown fox. 日本語 🚀";

struct Case {
  const char* name;
  ModelConfig config;
  io::HfArch arch;
};

// A Qwen3-MoE: layer 0 dense (mlp_only_layers), layer 1 sparse with 4 experts, top 2.
ModelConfig qwen3_moe_config() {
  ModelConfig c = test::tiny_config(true, false, false);
  c.mlp = "moe";
  c.alt_mlp = "swiglu";
  c.alt_mlp_layers = "0";
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 32;
  return c;
}

// A Dots1 (dots.llm1): layer 0 dense (first_k_dense_replace), layer 1 sparse with
// sigmoid_bias routing over 2 groups, a shared expert of two experts' width, scaled weights.
ModelConfig dots1_config() {
  ModelConfig c = qwen3_moe_config();
  c.moe.router = "sigmoid_bias";
  c.moe.shared_hidden = 64;
  c.moe.routed_scaling = 2.5;
  c.moe.groups = 2;
  c.moe.top_groups = 1;
  return c;
}

// A model whose layers `full` see every key and the others the last `window` (16 here,
// shorter than the test text, so the windows bite).
ModelConfig windowed(ModelConfig c, const std::string& full) {
  c.sliding_window = 16;
  c.full_attention_layers = full;
  return c;
}

std::vector<Case> cases() {
  ModelConfig llama = test::tiny_config(false, false, false, 48);  // head_dim 16 != 48 / 4
  ModelConfig geglu = test::tiny_config(true, true, false);  // hidden_act gelu_pytorch_tanh, imported as geglu
  geglu.mlp = "geglu";
  return {{"qwen3", test::tiny_config(true, true, false), io::HfArch::qwen3},
          {"qwen3_geglu", geglu, io::HfArch::qwen3},
          {"llama", llama, io::HfArch::llama},
          {"qwen2", test::tiny_config(false, true, true), io::HfArch::qwen2},
          {"qwen3_moe", qwen3_moe_config(), io::HfArch::qwen3_moe},
          {"dots1", dots1_config(), io::HfArch::dots1},
          // Windowed layers: Qwen3's, Qwen2's and Dots1's layer_types, Qwen3-MoE's every layer.
          {"qwen3_window", windowed(test::tiny_config(true, true, false), "1"), io::HfArch::qwen3},
          {"qwen2_window", windowed(test::tiny_config(false, true, true), ""), io::HfArch::qwen2},
          {"qwen3_moe_window", windowed(qwen3_moe_config(), ""), io::HfArch::qwen3_moe},
          {"dots1_window", windowed(dots1_config(), "0"), io::HfArch::dots1}};
}

void expect_same_weights(const std::string& a_dir, const std::string& b_dir, bool bitwise) {
  const auto a = io::SafetensorsFile::open(a_dir + "/model.safetensors");
  const auto b = io::SafetensorsFile::open(b_dir + "/model.safetensors");
  ASSERT_EQ(a.names(), b.names());
  for (const std::string& name : a.names()) {
    const OwnedTensor x = io::read_tensor(a, name, DType::f32), y = io::read_tensor(b, name, DType::f32);
    ASSERT_EQ(x->numel(), y->numel()) << name;
    for (int64_t i = 0; i < x->numel(); ++i) {
      const float u = x->data<float>()[i], v = y->data<float>()[i];
      if (bitwise) {
        ASSERT_EQ(std::memcmp(&u, &v, 4), 0) << name << "[" << i << "]";
      } else {
        ASSERT_EQ(bf16_to_float(float_to_bf16(u)), v) << name << "[" << i << "]: not the bf16 rounding";
      }
    }
  }
}

TEST(ExportHf, EachArchitecturePassesThePythonChecksAndRoundTripsBitwise) {
  const std::string root = test::temp_dir("kiln-export");
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::string model = test::save_random_model(c.config, root + "/" + c.name + "-model");
    const std::string out = root + "/" + c.name + "-hf";
    const io::HfExportReport report = io::export_hf(model, out, {});
    EXPECT_EQ(report.arch, c.arch);
    std::string output;
    EXPECT_EQ(test::run_python("check_hf_export.py " + out + " " + model + " float32", &output), 0) << output;
    std::printf("%s", output.c_str());

    const std::string back = root + "/" + c.name + "-back";
    const io::HfImportReport imported = io::import_hf(out, back);
    EXPECT_EQ(imported.arch, c.arch);
    EXPECT_TRUE(imported.byte_tokenizer);
    expect_same_weights(model, back, true);
    const double before = test::text_loss(model, kText), after = test::text_loss(back, kText);
    EXPECT_EQ(before, after) << "the same weights must give the same loss";
    const Config cfg = load_config(back + "/config.toml");
    EXPECT_EQ(cfg.model.qk_norm, c.config.qk_norm);
    EXPECT_EQ(cfg.model.head_dim, c.config.head_dim);
    EXPECT_EQ(cfg.model.rope_theta, c.config.rope_theta);
    EXPECT_EQ(cfg.model.norm_eps, c.config.norm_eps);
    EXPECT_EQ(cfg.model.tie_embeddings, c.config.tie_embeddings);
    EXPECT_EQ(cfg.model.attention_bias, c.config.attention_bias);
    EXPECT_EQ(cfg.model.sliding_window, c.config.sliding_window);
    EXPECT_EQ(cfg.model.full_attention_layers, c.config.full_attention_layers);
    EXPECT_EQ(cfg.model.mlp, c.config.mlp);
    EXPECT_EQ(cfg.model.alt_mlp_layers, c.config.alt_mlp_layers);
    EXPECT_EQ(cfg.model.moe.experts, c.config.moe.experts);
    EXPECT_EQ(cfg.model.moe.router, c.config.moe.router);
    EXPECT_EQ(cfg.model.moe.shared_hidden, c.config.moe.shared_hidden);
    EXPECT_EQ(cfg.model.moe.routed_scaling, c.config.moe.routed_scaling);
    EXPECT_EQ(cfg.model.moe.groups, c.config.moe.groups);
    EXPECT_EQ(cfg.model.moe.top_groups, c.config.moe.top_groups);
    EXPECT_EQ(cfg.model.moe.norm_topk_prob, c.config.moe.norm_topk_prob);
  }
  fs::remove_all(root);
}

TEST(ExportHf, ShardedBf16AndF16) {
  const std::string root = test::temp_dir("kiln-export-shards");
  const std::string model = test::save_random_model(test::tiny_config(true, false, false), root + "/model");
  io::HfExportOptions o;
  o.dtype = "bfloat16";
  o.max_shard_bytes = 40000;
  const auto report = io::export_hf(model, root + "/bf16", o);
  EXPECT_GT(std::count_if(report.files.begin(), report.files.end(),
                          [](const std::string& f) { return f.find("-of-") != std::string::npos; }),
            2);
  std::string output;
  EXPECT_EQ(test::run_python("check_hf_export.py " + root + "/bf16 " + model + " bfloat16", &output), 0) << output;
  std::printf("%s", output.c_str());
  // Importing the shards gives the bf16-rounded weights; the loss moves only slightly.
  io::import_hf(root + "/bf16", root + "/back");
  expect_same_weights(model, root + "/back", false);
  EXPECT_NEAR(test::text_loss(root + "/back", kText), test::text_loss(model, kText), 0.02);
  // Re-export unsharded into the same directory: no stale shard may remain.
  io::export_hf(model, root + "/bf16", {});
  for (const auto& e : fs::directory_iterator(root + "/bf16"))
    EXPECT_EQ(e.path().filename().string().find("-of-"), std::string::npos) << e.path();
  o.dtype = "float16";
  o.max_shard_bytes = int64_t(1) << 30;
  io::export_hf(model, root + "/f16", o);
  EXPECT_EQ(test::run_python("check_hf_export.py " + root + "/f16 " + model + " float16", &output), 0) << output;
  fs::remove_all(root);
}

TEST(ExportHf, RefusesWhatNoStockClassComputes) {
  // The components write the config.json of the family chosen for them, or refuse.
  auto refusal = [](ModelConfig m) {
    try {
      BuildOptions o;
      o.training = false;
      o.max_tokens = 4;
      const Model model(m, o);
      io::hf_config_json(model, io::choose_hf_arch(m), {}, "float32");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  ModelConfig m = test::tiny_config(true, true, false);
  m.position = "none";
  EXPECT_NE(refusal(m).find("model.position"), std::string::npos) << refusal(m);
  m = test::tiny_config(true, true, true);
  EXPECT_NE(refusal(m).find("model.attention_bias"), std::string::npos) << refusal(m);
  m = test::tiny_config(true, true, false);
  m.norm = "layernorm";
  EXPECT_NE(refusal(m).find("model.norm"), std::string::npos);
  m.norm = "rmsnorm";
  m.mlp = "gelu";
  EXPECT_NE(refusal(m).find("model.mlp"), std::string::npos);
  m = test::tiny_config(true, true, false);
  m.attention_softcap = 30;
  EXPECT_NE(refusal(m).find("model.attention_softcap = 30"), std::string::npos) << refusal(m);
  m = test::tiny_config(false, false, false);
  m.logit_softcap = 15;
  EXPECT_NE(refusal(m).find("model.logit_softcap = 15"), std::string::npos) << refusal(m);
  // Windows: Llama has none; Qwen3-MoE windows all layers or none.
  m = windowed(test::tiny_config(false, true, false), "");
  EXPECT_NE(refusal(m).find("model.sliding_window = 16: no sliding window in this architecture"), std::string::npos)
      << refusal(m);
  m = windowed(qwen3_moe_config(), "0");
  EXPECT_NE(refusal(m).find("model.full_attention_layers: the layers differ in 'use_sliding_window'"),
            std::string::npos)
      << refusal(m);
  // Per-layer patterns: a NoPE layer is refused; an alternative MLP that is the same
  // component writes the same fields, and is the plain model.
  m = test::tiny_config(true, true, false);
  m.nope_layers = "1";
  EXPECT_NE(refusal(m).find("model.nope_layers = layer 1"), std::string::npos) << refusal(m);
  m = test::tiny_config(true, true, false);
  m.alt_mlp = "swiglu";
  m.alt_mlp_layers = "0";
  EXPECT_EQ(refusal(m), "accepted");
  // Sparse models: Qwen3-MoE routes by softmax top-k and has no shared expert or scaling.
  m = qwen3_moe_config();
  EXPECT_EQ(refusal(m), "accepted");
  for (const char* router : {"sinkhorn", "relu"}) {
    m.moe.router = router;
    EXPECT_NE(refusal(m).find(std::string("model.moe.router = '") + router + "'"), std::string::npos) << refusal(m);
  }
  // expert_choice: refused for why it cannot be any stock model (it is not causal).
  m.moe.router = "expert_choice";
  EXPECT_NE(refusal(m).find("model.moe.router = 'expert_choice': each expert chooses among all of a micro-batch's "
                            "tokens, so a token's experts depend on later tokens"),
            std::string::npos)
      << refusal(m);
  m = qwen3_moe_config();
  m.moe.shared_hidden = 16;
  EXPECT_NE(refusal(m).find("model.moe.shared_hidden = 16: Qwen3-MoE has no shared expert"), std::string::npos)
      << refusal(m);
  m = qwen3_moe_config();
  m.moe.routed_scaling = 2;
  EXPECT_NE(refusal(m).find("model.moe.routed_scaling = 2"), std::string::npos) << refusal(m);
  // sigmoid_bias is Dots1's router; its shared expert is a whole number of experts wide, its
  // dense layers come first.
  m = qwen3_moe_config();
  m.moe.router = "sigmoid_bias";
  EXPECT_EQ(refusal(m), "accepted");
  EXPECT_EQ(io::choose_hf_arch(m), io::HfArch::dots1);
  m = dots1_config();
  m.moe.shared_hidden = 48;
  EXPECT_NE(refusal(m).find("model.moe.shared_hidden = 48: Dots1's shared expert is n_shared_experts x "
                            "moe_intermediate_size wide, a multiple of model.moe.expert_hidden = 32"),
            std::string::npos)
      << refusal(m);
  m = dots1_config();
  m.layers = 3;
  m.alt_mlp_layers = "0,2";
  EXPECT_NE(refusal(m).find("model.alt_mlp_layers = '0,2': layer 2 is dense after sparse layer 1"), std::string::npos)
      << refusal(m);
  m = dots1_config();
  m.attention_bias = true;
  EXPECT_NE(refusal(m).find("model.attention_bias = true"), std::string::npos) << refusal(m);

  // Through the CLI: one error line, nothing written.
  const std::string root = test::temp_dir("kiln-export-refuse");
  ModelConfig nope = test::tiny_config(true, true, false);
  nope.position = "none";
  const std::string model = test::save_random_model(nope, root + "/model");
  std::string output;
  EXPECT_NE(test::run_command(test::kiln_binary() + " export hf " + model + " " + root + "/out", &output), 0);
  EXPECT_NE(output.find("kiln: error: [export] model.position = 'none'"), std::string::npos) << output;
  EXPECT_FALSE(fs::exists(root + "/out"));
  fs::remove_all(root);
}

// Writes a model directory's files after editing config.json (and optionally adding a tensor).
void edit_export(const std::string& dir, const std::function<void(json&)>& edit) {
  json c = json::parse(std::ifstream(dir + "/config.json"));
  edit(c);
  std::ofstream(dir + "/config.json") << c.dump(2);
}

TEST(ImportHf, RefusesFeaturesKilnDoesNotCompute) {
  const std::string root = test::temp_dir("kiln-import-refuse");
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), root + "/model");
  auto import_error = [&](const std::function<void(json&)>& edit) {
    fs::remove_all(root + "/hf");
    io::export_hf(model, root + "/hf", {});
    edit_export(root + "/hf", edit);
    try {
      io::import_hf(root + "/hf", root + "/out");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(import_error([](json& c) { c["rope_parameters"] = {{"rope_type", "dynamic"}, {"factor", 4.0}}; })
                .find("rope_type = 'dynamic'"),
            std::string::npos);
  EXPECT_NE(import_error([](json& c) { c["rope_parameters"] = {{"rope_type", "llama3"}, {"factor", 4.0}}; })
                .find("original_max_position_embeddings"),
            std::string::npos);
  EXPECT_NE(import_error([](json& c) {
              c["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"mscale", 0.707}, {"mscale_all_dim", 0.707}};
            }).find("mscale"),
            std::string::npos);
  // partial_rotary_factor, top level (transformers 4.x) or in rope_parameters (5.x): the
  // stock classes rotate the whole head whatever it says, so it is refused, not guessed at.
  EXPECT_NE(import_error([](json& c) { c["partial_rotary_factor"] = 0.5; })
                .find("config.json: partial_rotary_factor = 0.5: the stock Llama/Qwen classes ignore it"),
            std::string::npos);
  EXPECT_NE(import_error([](json& c) { c["rope_parameters"]["partial_rotary_factor"] = 0.25; })
                .find("config.json: rope_parameters.partial_rotary_factor = 0.25: the stock"),
            std::string::npos);
  EXPECT_NE(import_error([](json& c) { c["layer_types"][0] = "chunked_attention"; })
                .find("config.json: layer_types[0] = 'chunked_attention': kiln computes full_attention and "
                      "sliding_attention layers"),
            std::string::npos);
  EXPECT_NE(import_error([](json& c) { c["layer_types"] = json::array({"full_attention"}); })
                .find("layer_types has 1 entries for 2 layers"),
            std::string::npos);
  EXPECT_NE(import_error([](json& c) { c["hidden_act"] = "gelu"; }).find("hidden_act"), std::string::npos);
  EXPECT_NE(import_error([](json& c) { c["model_type"] = "mistral"; }).find("mistral"), std::string::npos);
  EXPECT_NE(import_error([](json& c) { c["head_dim"] = 8; }).find("shape"), std::string::npos);
  EXPECT_NE(import_error([](json& c) { c["attention_bias"] = true; }).find("o_proj"), std::string::npos);
  // Fields are typed (before: 2.5 layers was read as 2 and imported; a string where a
  // number belongs was nlohmann's type_error, and rope_scaling.rope_type = 3 an internal error).
  EXPECT_NE(import_error([](json& c) { c["num_hidden_layers"] = 2.5; })
                .find("config.json: num_hidden_layers must be an integer, got number 2.5"),
            std::string::npos);
  EXPECT_NE(import_error([](json& c) { c["rope_scaling"] = {{"rope_type", 3}}; })
                .find("config.json: rope_scaling.rope_type must be a string, got number 3"),
            std::string::npos);
  EXPECT_NE(import_error([](json& c) { c["eos_token_id"] = json::array({"</s>"}); })
                .find("config.json: eos_token_id[0] must be an integer, got string \"</s>\""),
            std::string::npos);

  // An extra tensor is refused by name, a missing one too.
  io::export_hf(model, root + "/hf", {});
  edit_export(root + "/hf", [](json&) {});
  {
    const auto file = io::SafetensorsFile::open(root + "/hf/model.safetensors");
    io::SafetensorsWriter w;
    w.set_metadata("format", "pt");
    for (const std::string& n : file.names()) w.add(n, *io::read_tensor(file, n, DType::f32));
    w.add("model.layers.0.mlp.gate_proj.bias", *test::random_tensor(DType::f32, Shape{96}, 1));
    w.write(root + "/hf/model.safetensors");
  }
  try {
    io::import_hf(root + "/hf", root + "/out");
    ADD_FAILURE() << "extra tensor accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.mlp.gate_proj.bias"), std::string::npos) << e.what();
  }
  // Last: accepted, it writes the output the refusals above never reach.
  EXPECT_EQ(import_error([](json& c) { c["partial_rotary_factor"] = 1.0; }), "accepted");
  fs::remove_all(root);
}

// A config.json value nested 300000 arrays deep: the type error dump()ed it, and the
// recursion overflowed the stack (SIGSEGV of `kiln import hf`).
// config.json's windows read as transformers derives them: layer_types when given, else the
// layers from max_window_layers on; none without use_sliding_window. llama.cpp has none.
TEST(ImportHf, WindowsAsTransformersDerivesThem) {
  const std::string root = test::temp_dir("kiln-import-windows");
  const std::string model = test::save_random_model(windowed(test::tiny_config(true, true, false), "1"), root + "/model");
  auto imported = [&](const std::function<void(json&)>& edit) {
    fs::remove_all(root + "/hf");
    fs::remove_all(root + "/back");
    io::export_hf(model, root + "/hf", {});
    edit_export(root + "/hf", edit);
    io::import_hf(root + "/hf", root + "/back");
    return load_config(root + "/back/config.toml").model;
  };
  const ModelConfig by_max = imported([](json& c) {
    c.erase("layer_types");
    c["max_window_layers"] = 1;  // layer 1 on: windowed; layer 0 full
  });
  EXPECT_EQ(by_max.sliding_window, 16);
  EXPECT_EQ(by_max.full_attention_layers, "0");
  const ModelConfig flag_off = imported([](json& c) { c["use_sliding_window"] = false; });
  EXPECT_EQ(flag_off.sliding_window, 0);  // transformers drops sliding_window: full attention
  EXPECT_EQ(flag_off.full_attention_layers, "");
  try {
    io::export_gguf(model, root + "/model.gguf", {});
    ADD_FAILURE() << "a windowed model exported to GGUF";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.sliding_window = 16: llama.cpp's architecture has no sliding window"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(root);
}

TEST(ImportHf, DeeplyNestedConfigValuesAreRefusedInOneLine) {
  const std::string root = test::temp_dir("kiln-import-deep");
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), root + "/model");
  io::export_hf(model, root + "/hf", {});
  std::string text = test::read_file(root + "/hf/config.json");
  const size_t at = text.find("\"vocab_size\": 259");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, 17, "\"vocab_size\": " + std::string(300000, '[') + std::string(300000, ']'));
  test::write_file(root + "/hf/config.json", text);
  std::string output;
  EXPECT_EQ(test::run_command(test::kiln_binary() + " import hf " + root + "/hf " + root + "/out", &output), 1) << output;
  EXPECT_EQ(output, "kiln: error: [import] " + root + "/hf/config.json: vocab_size must be an integer, got an array\n");
  fs::remove_all(root);
}

}  // namespace
}  // namespace kiln
