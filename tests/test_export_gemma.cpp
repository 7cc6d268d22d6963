// Gemma 2 and Gemma 3 (text) export and import: config.json's fields and the tensor names a
// stock Gemma2ForCausalLM / Gemma3ForCausalLM reads; the exported folder run by a numpy
// forward written from transformers' definitions (tests/python/check_gemma_export.py) gives
// kiln's logits; import(export(model)) reproduces every weight bit for bit and the loss; and
// what the Gemma classes cannot carry is refused by its key. The GGUF export as llama.cpp's
// gemma2 / gemma3: keys, tensors, gains stored as 1 + w, read back, and its refusals.
#include "export_fixture.h"
#include "full_forward.h"
#include "io/gguf_export.h"
#include "io/hf_config.h"
#include "io/hf_export.h"
#include "io/export_names.h"
#include "io/gguf_writer.h"
#include "io/hf_import.h"
#include "io/safetensors.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Gemma 2's shape: Gemma's norms sandwiched around the branches, GeGLU, the embedding x
// sqrt(hidden), softcaps small enough to bite, layers 0 and 2 sliding (16 keys, shorter than
// the 40 tokens run), layer 1 global.
ModelConfig gemma2_config() {
  ModelConfig c = test::tiny_config(false, true, false);
  c.layers = 3;
  c.norm = "gemma_rmsnorm";
  c.sandwich_norms = true;
  c.mlp = "geglu";
  c.embed_scale = std::sqrt(static_cast<double>(c.hidden));
  c.attention_softcap = 3.0;
  c.logit_softcap = 6.0;
  c.sliding_window = 16;
  c.full_attention_layers = "1";
  return c;
}

// Gemma 3's: Gemma's q/k norms, no softcaps, an untied head, local layers at their own base.
ModelConfig gemma3_config() {
  ModelConfig c = gemma2_config();
  c.qk_norm = true;
  c.qk_norm_type = "gemma_rmsnorm";
  c.attention_softcap = 0;
  c.logit_softcap = 0;
  c.tie_embeddings = false;
  c.rope_theta = 1e6;
  c.rope.local_theta = 50.0;  // far from 1e6: a wrong base per layer shows in the logits
  return c;
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f);
}

std::vector<int32_t> text_tokens(int64_t n) {
  std::vector<int32_t> t;
  const std::string text = "Gemma's sandwich norms: a norm after each branch, too.";
  t.push_back(256);
  for (int64_t i = 0; static_cast<int64_t>(t.size()) < n; ++i) t.push_back(static_cast<unsigned char>(text[i % text.size()]));
  return t;
}

// kiln's logits of `tokens` under the model in `dir`, into a file for the numpy oracle.
void write_kiln_logits(const std::string& dir, const std::vector<int32_t>& tokens, const std::string& path) {
  io::LoadedModel m = io::load_model(dir, [] {
    BuildOptions o;
    o.training = false;
    o.max_tokens = 64;
    o.loss_chunk_rows = 16;
    return o;
  }());
  const int64_t t = static_cast<int64_t>(tokens.size());
  const std::vector<float> logits = test::full_forward_logits(*m.model, tokens, 0, t);
  io::SafetensorsWriter w;
  w.add_raw("tokens", DType::i32, {t}, tokens.data(), tokens.size() * 4);
  w.add_raw("logits", DType::f32, {t, m.model->config().vocab_size}, logits.data(), logits.size() * 4);
  w.write(path);
}

void expect_same_weights(const std::string& a_dir, const std::string& b_dir) {
  const auto a = io::SafetensorsFile::open(a_dir + "/model.safetensors");
  const auto b = io::SafetensorsFile::open(b_dir + "/model.safetensors");
  ASSERT_EQ(a.names(), b.names());
  for (const std::string& name : a.names()) {
    const OwnedTensor x = io::read_tensor(a, name, DType::f32), y = io::read_tensor(b, name, DType::f32);
    ASSERT_EQ(x->numel(), y->numel()) << name;
    ASSERT_EQ(std::memcmp(x->raw(), y->raw(), static_cast<size_t>(x->numel()) * 4), 0) << name;
  }
}

struct GemmaCase {
  const char* name;
  ModelConfig config;
  io::HfArch arch;
};

TEST(ExportGemma, ConfigNamesNumpyForwardAndBitwiseRoundTrip) {
  const std::string root = test::temp_dir("kiln-export-gemma");
  for (const GemmaCase& c : {GemmaCase{"gemma2", gemma2_config(), io::HfArch::gemma2},
                             GemmaCase{"gemma3", gemma3_config(), io::HfArch::gemma3}}) {
    SCOPED_TRACE(c.name);
    const bool three = c.arch == io::HfArch::gemma3;
    const std::string model = test::save_random_model(c.config, root + "/" + c.name + "-model");
    const std::string out = root + "/" + c.name + "-hf";
    EXPECT_EQ(io::export_hf(model, out, {}).arch, c.arch);

    const json cfg = read_json(out + "/config.json");
    EXPECT_EQ(cfg["architectures"], json::array({three ? "Gemma3ForCausalLM" : "Gemma2ForCausalLM"}));
    EXPECT_EQ(cfg["model_type"], three ? "gemma3_text" : "gemma2");
    EXPECT_EQ(cfg["hidden_activation"], "gelu_pytorch_tanh");
    EXPECT_EQ(cfg["query_pre_attn_scalar"], 16);
    EXPECT_EQ(cfg["head_dim"], 16);
    EXPECT_EQ(cfg["rms_norm_eps"], c.config.norm_eps);
    EXPECT_EQ(cfg["sliding_window"], 16);
    EXPECT_EQ(cfg["layer_types"], json::array({"sliding_attention", "full_attention", "sliding_attention"}));
    EXPECT_EQ(cfg["tie_word_embeddings"], c.config.tie_embeddings);
    EXPECT_FALSE(cfg.contains("use_sliding_window"));
    if (three) {
      EXPECT_TRUE(cfg["attn_logit_softcapping"].is_null());
      EXPECT_TRUE(cfg["final_logit_softcapping"].is_null());
      EXPECT_EQ(cfg["rope_theta"], 1e6);
      EXPECT_EQ(cfg["rope_local_base_freq"], 50.0);
      EXPECT_EQ(cfg["rope_parameters"]["full_attention"]["rope_theta"], 1e6);
      EXPECT_EQ(cfg["rope_parameters"]["sliding_attention"]["rope_theta"], 50.0);
    } else {
      EXPECT_EQ(cfg["attn_logit_softcapping"], 3.0);
      EXPECT_EQ(cfg["final_logit_softcapping"], 6.0);
      EXPECT_FALSE(cfg.contains("rope_local_base_freq"));
    }

    const auto st = io::SafetensorsFile::open(out + "/model.safetensors");
    std::vector<std::string> want = {"model.embed_tokens.weight", "model.norm.weight"};
    if (three) want.push_back("lm_head.weight");
    for (int l = 0; l < 3; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      for (const char* leaf : {"input_layernorm.weight", "post_attention_layernorm.weight",
                               "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
                               "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                               "mlp.down_proj.weight"})
        want.push_back(p + leaf);
      if (three) want.insert(want.end(), {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"});
    }
    std::sort(want.begin(), want.end());
    std::vector<std::string> names = st.names();
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, want);

    const std::string logits = root + "/" + c.name + "-logits.safetensors";
    write_kiln_logits(model, text_tokens(40), logits);
    std::string output;
    EXPECT_EQ(test::run_python("check_gemma_export.py " + out + " " + logits, &output), 0) << output;
    EXPECT_NE(output.find("gemma logits match numpy"), std::string::npos) << output;
    std::printf("%s", output.c_str());

    const std::string back = root + "/" + c.name + "-back";
    const io::HfImportReport imported = io::import_hf(out, back);
    EXPECT_EQ(imported.arch, c.arch);
    expect_same_weights(model, back);
    EXPECT_EQ(test::text_loss(model, "a Gemma round trip"), test::text_loss(back, "a Gemma round trip"));
    const ModelConfig m = load_config(back + "/config.toml").model;
    EXPECT_EQ(m.norm, "gemma_rmsnorm");
    EXPECT_TRUE(m.sandwich_norms);
    EXPECT_EQ(m.mlp, "geglu");
    EXPECT_EQ(m.embed_scale, c.config.embed_scale);
    EXPECT_EQ(m.qk_norm, three);
    EXPECT_EQ(m.attention_softcap, c.config.attention_softcap);
    EXPECT_EQ(m.logit_softcap, c.config.logit_softcap);
    EXPECT_EQ(m.sliding_window, 16);
    EXPECT_EQ(m.full_attention_layers, "1");
    EXPECT_EQ(m.rope_theta, c.config.rope_theta);
    EXPECT_EQ(m.rope.local_theta, c.config.rope.local_theta);
    EXPECT_EQ(m.tie_embeddings, c.config.tie_embeddings);
  }
  fs::remove_all(root);
}

// llama.cpp's gemma2 / gemma3 (src/models/gemma2.cpp, gemma3.cpp, llama-model.cpp's
// load_swa_pattern): the keys they read, the tensors they create, Gemma's gains stored as
// 1 + w (llama.cpp multiplies by the stored gain), and load_gguf_weights reading the file
// back: every weight bitwise except the gains, which come back as (w + 1) - 1 in fp32.
TEST(ExportGemma, GgufKeysTensorsGainsAndReadBack) {
  const std::string root = test::temp_dir("kiln-export-gemma-gguf");
  for (const GemmaCase& c : {GemmaCase{"gemma2", gemma2_config(), io::HfArch::gemma2},
                             GemmaCase{"gemma3", gemma3_config(), io::HfArch::gemma3}}) {
    SCOPED_TRACE(c.name);
    const bool three = c.arch == io::HfArch::gemma3;
    const std::string a = three ? "gemma3" : "gemma2";
    const std::string model = test::save_random_model(c.config, root + "/" + c.name + "-model");
    const std::string file = root + "/" + c.name + ".gguf";
    EXPECT_EQ(io::export_gguf(model, file, {}).arch, a);
    const io::GgufFile g = io::GgufFile::open(file);
    auto u32 = [&](const std::string& key) { return std::get<uint32_t>(g.get(a + "." + key)); };
    auto f32 = [&](const std::string& key) { return std::get<float>(g.get(a + "." + key)); };
    EXPECT_EQ(std::get<std::string>(g.get("general.architecture")), a);
    EXPECT_EQ(u32("block_count"), 3u);
    EXPECT_EQ(u32("embedding_length"), 64u);
    EXPECT_EQ(u32("feed_forward_length"), 96u);
    EXPECT_EQ(u32("attention.head_count"), 4u);
    EXPECT_EQ(u32("attention.head_count_kv"), 2u);
    EXPECT_EQ(u32("attention.key_length"), 16u);
    EXPECT_EQ(u32("rope.dimension_count"), 16u);
    EXPECT_EQ(f32("attention.layer_norm_rms_epsilon"), static_cast<float>(c.config.norm_eps));
    EXPECT_EQ(f32("rope.freq_base"), static_cast<float>(c.config.rope_theta));
    EXPECT_EQ(u32("attention.sliding_window"), 16u);
    EXPECT_EQ(std::get<std::vector<bool>>(g.get(a + ".attention.sliding_window_pattern")),
              (std::vector<bool>{true, false, true}));
    if (three) {
      EXPECT_EQ(f32("rope.freq_base_swa"), 50.0f);
      EXPECT_FALSE(g.contains("gemma3.attn_logit_softcapping"));
      EXPECT_FALSE(g.contains("gemma3.final_logit_softcapping"));  // llama.cpp's gemma3: no cap without it
    } else {
      EXPECT_EQ(f32("attn_logit_softcapping"), 3.0f);
      EXPECT_EQ(f32("final_logit_softcapping"), 6.0f);
      EXPECT_FALSE(g.contains("gemma2.rope.freq_base_swa"));  // llama.cpp's default: rope.freq_base
    }

    std::vector<std::string> want = {"token_embd.weight", "output_norm.weight"};
    if (three) want.push_back("output.weight");
    for (int l = 0; l < 3; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      for (const char* leaf : {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                               "attn_output.weight", "post_attention_norm.weight", "ffn_norm.weight",
                               "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "post_ffw_norm.weight"})
        want.push_back(p + leaf);
      if (three) want.insert(want.end(), {p + "attn_q_norm.weight", p + "attn_k_norm.weight"});
    }
    std::vector<std::string> names;
    for (const auto& t : g.tensors()) names.push_back(t.name);
    std::sort(want.begin(), want.end());
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, want);
    EXPECT_EQ(g.tensor("blk.0.attn_q.weight").shape, (std::vector<int64_t>{64, 64}));
    EXPECT_EQ(g.tensor("blk.0.attn_k.weight").shape, (std::vector<int64_t>{32, 64}));
    EXPECT_EQ(g.tensor("blk.0.ffn_down.weight").shape, (std::vector<int64_t>{64, 96}));
    if (three) EXPECT_EQ(g.tensor("blk.0.attn_q_norm.weight").shape, (std::vector<int64_t>{16}));

    // The file's gains are kiln's w + 1 (fp32), every other tensor kiln's values as they are
    // (NEOX rotation, as kiln's: no q/k reordering).
    std::unique_ptr<Model> original = test::load_inference_model(model), back = test::load_inference_model(model);
    int gains = 0, gains_rounded = 0;
    for (const auto& p : original->parameters()) {
      if (p->training_only()) continue;
      const std::string& name = io::gguf_name(*p);
      const bool gain = name.ends_with("norm.weight");
      const std::vector<float> stored = g.read_f32(name);
      const Tensor w = p->value();
      ASSERT_EQ(static_cast<int64_t>(stored.size()), w.numel()) << name;
      for (int64_t i = 0; i < w.numel(); ++i) {
        const float x = w.data<float>()[i];
        ASSERT_EQ(stored[static_cast<size_t>(i)], gain ? x + 1.0f : x) << name << " " << i;
      }
      gains += gain ? 1 : 0;
    }
    EXPECT_EQ(gains, three ? 3 * 6 + 1 : 3 * 4 + 1);
    io::load_gguf_weights(*back, file);
    for (const auto& p : original->parameters()) {
      if (p->training_only()) continue;
      const bool gain = io::gguf_name(*p).ends_with("norm.weight");
      const Tensor x = p->value(), y = back->find_parameter(p->name())->value();
      for (int64_t i = 0; i < x.numel(); ++i) {
        const float w = x.data<float>()[i];
        const float want_back = gain ? (w + 1.0f) - 1.0f : w;  // fp32, as the file holds it
        ASSERT_EQ(y.data<float>()[i], want_back) << p->name() << " " << i;
        gains_rounded += gain && want_back != w ? 1 : 0;
      }
    }
    // The random gains near 1 (test::randomize_weights) lose their last bit in w + 1 about
    // half the time: bitwise only where 1 + w is exact.
    EXPECT_GT(gains_rounded, 0);

    // gguf-py's reading of every type (tests/python/check_gguf.py: keys, names, shapes, types,
    // values, the gains as 1 + w).
    for (const std::string type : {"f32", "bf16", "q8_0"}) {
      const std::string typed = root + "/" + c.name + "-" + type + ".gguf";
      io::GgufExportOptions o;
      o.type = type;
      io::export_gguf(model, typed, o);
      std::string output;
      EXPECT_EQ(test::run_python("check_gguf.py " + typed + " " + model + " " + type, &output), 0) << type << output;
      EXPECT_NE(output.find("OK " + a + " keys"), std::string::npos) << output;
      std::printf("%s %s: %s", c.name, type.c_str(), output.c_str());
    }
  }
  fs::remove_all(root);
}

std::string export_error(const std::function<void(ModelConfig&)>& edit, bool gguf = false) {
  const std::string root = test::temp_dir("kiln-export-gemma-refuse");
  ModelConfig c = gemma3_config();
  edit(c);
  const std::string model = test::save_random_model(c, root + "/model");
  std::string error;
  try {
    if (gguf) io::export_gguf(model, root + "/m.gguf", {});
    else io::export_hf(model, root + "/hf", {});
  } catch (const Error& e) {
    error = e.what();
  }
  fs::remove_all(root);
  return error;
}

#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

// What neither Gemma class computes is refused by the key that asked for it.
TEST(ExportGemma, RefusesWhatTheGemmaClassesCannotCarry) {
  EXPECT_HAS(export_error([](ModelConfig& c) { c.norm = "rmsnorm", c.qk_norm_type = "rmsnorm"; }),
             "model.norm = 'rmsnorm'");
  EXPECT_HAS(export_error([](ModelConfig& c) { c.qk_norm_type = "rmsnorm"; }), "model.qk_norm_type = 'rmsnorm'");
  EXPECT_HAS(export_error([](ModelConfig& c) { c.embed_scale = 1.0; }), "model.embed_scale = 1");
  EXPECT_HAS(export_error([](ModelConfig& c) { c.attention_bias = true; }), "model.attention_bias = true");
  // transformers' Gemma 3 attends uncapped (found against transformers 5.17 on 2026-12-05).
  EXPECT_HAS(export_error([](ModelConfig& c) { c.attention_softcap = 5.0; }), "model.attention_softcap = 5");
  EXPECT_EQ(export_error([](ModelConfig& c) { c.logit_softcap = 5.0; }), "");
  EXPECT_HAS(export_error([](ModelConfig& c) { c.nope_layers = "1"; }), "model.nope_layers");
  EXPECT_HAS(export_error([](ModelConfig& c) { c.rope.local_theta = 0, c.rope.scaling = "linear", c.rope.factor = 2; }),
             "model.rope.local_theta = 0");
  // Gemma 2 (no q/k norms) has one RoPE base; with one it exports.
  EXPECT_HAS(export_error([](ModelConfig& c) { c.qk_norm = false; }), "model.rope.local_theta = 50");
  EXPECT_EQ(export_error([](ModelConfig& c) { c.qk_norm = false, c.rope.local_theta = 0; }), "");
  // Sandwich norms outside Gemma's families (a sparse model is Qwen3-MoE), and Gemma's norm
  // without them (Gemma 1, not written).
  EXPECT_HAS(export_error([](ModelConfig& c) {
               c.mlp = "moe", c.moe.experts = 4, c.moe.top_k = 2, c.moe.expert_hidden = 32, c.norm = "rmsnorm";
               c.qk_norm_type = "rmsnorm", c.embed_scale = 1, c.sliding_window = 0, c.full_attention_layers = "";
               c.rope.local_theta = 0;
             }),
             "model.sandwich_norms = true");
  EXPECT_HAS(export_error([](ModelConfig& c) {
               c.sandwich_norms = false, c.embed_scale = 1, c.rope.local_theta = 0, c.qk_norm_type = "rmsnorm";
             }),
             "model.norm = 'gemma_rmsnorm'");
}

// What llama.cpp's gemma2 / gemma3 cannot compute (or kiln has not checked there) is refused
// by its key; Gemma 2's edits start from Gemma 3's config as above.
TEST(ExportGemma, GgufRefusesWhatLlamaCppsGemmaCannotCompute) {
  auto gemma2 = [](const std::function<void(ModelConfig&)>& edit) {
    return [edit](ModelConfig& c) {
      c.qk_norm = false, c.rope.local_theta = 0, c.attention_softcap = 3, c.logit_softcap = 6, c.tie_embeddings = true;
      edit(c);
    };
  };
  constexpr bool gguf = true;
  EXPECT_EQ(export_error([](ModelConfig&) {}, gguf), "");
  EXPECT_EQ(export_error(gemma2([](ModelConfig&) {}), gguf), "");
  EXPECT_EQ(export_error(
                [](ModelConfig& c) {
                  c.logit_softcap = 5.0, c.sliding_window = 0, c.full_attention_layers = "", c.rope.local_theta = 0;
                },
                gguf),
            "");
  // Gemma 3 without a window has no sliding cache in llama.cpp; Gemma 2's always has one,
  // and llama.cpp aborts when no layer slides.
  EXPECT_HAS(export_error(gemma2([](ModelConfig& c) { c.sliding_window = 0, c.full_attention_layers = ""; }), gguf),
             "model.sliding_window = 0");
  EXPECT_HAS(export_error(gemma2([](ModelConfig& c) { c.full_attention_layers = "0,1,2"; }), gguf),
             "model.sliding_window = 16");
  EXPECT_HAS(export_error(gemma2([](ModelConfig& c) { c.attention_softcap = 0; }), gguf),
             "model.attention_softcap = 0");
  EXPECT_HAS(export_error(gemma2([](ModelConfig& c) { c.logit_softcap = 0; }), gguf), "model.logit_softcap = 0");
  EXPECT_HAS(export_error(gemma2([](ModelConfig& c) { c.tie_embeddings = false; }), gguf),
             "model.tie_embeddings = false");
  EXPECT_HAS(export_error([](ModelConfig& c) { c.attention_softcap = 5.0; }, gguf), "model.attention_softcap = 5");
  EXPECT_HAS(export_error([](ModelConfig& c) { c.mlp = "swiglu"; }, gguf), "model.mlp = 'swiglu'");
  EXPECT_HAS(export_error([](ModelConfig& c) { c.rope.scaling = "linear", c.rope.factor = 2; }, gguf),
             "model.rope.scaling = 'linear'");
  EXPECT_HAS(export_error([](ModelConfig& c) { c.rope.fraction = 0.5; }, gguf), "model.rope.fraction = 0.5");
  // At 62 layers (46 for Gemma 2) llama.cpp scales q by 1/sqrt(hidden / heads) = 1/sqrt(16).
  EXPECT_HAS(export_error([](ModelConfig& c) { c.layers = 62, c.head_dim = 32; }, gguf), "model.head_dim = 32");
  EXPECT_EQ(export_error([](ModelConfig& c) { c.layers = 62; }, gguf), "");
  EXPECT_HAS(export_error(gemma2([](ModelConfig& c) { c.layers = 46, c.head_dim = 8; }), gguf), "model.head_dim = 8");
}

}  // namespace
}  // namespace kiln
