// GGUF export: files checked by the `gguf` Python package (tests/python/check_gguf.py):
// metadata, names, shapes, types, the embedded vocabulary, Q8_0 bytes equal to gguf-py's
// quantizer and kiln's dequantization equal to gguf-py's bit for bit, llama's q/k permutation.
// Plus kiln's own reader: f32 round trips bitwise, Q8_0 stays within half a step, and the
// quantization evaluation sees no change at f32 and a small one at Q8_0.
#include "data/bpe/bpe_trainer.h"
#include "data/bpe/pretokenizer.h"
#include "export_fixture.h"
#include "infer/quant_eval.h"
#include "io/gguf_export.h"
#include "io/gguf_writer.h"
#include "io/quant_q8_0.h"
#include "io/safetensors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <filesystem>
#include <fstream>

namespace kiln {
namespace {

namespace fs = std::filesystem;

// Writes kiln's reading (dequantization) of every tensor of a GGUF file, by GGUF name.
void write_kiln_dequant(const std::string& gguf, const std::string& out) {
  const io::GgufFile file = io::GgufFile::open(gguf);
  io::SafetensorsWriter w;
  for (const auto& t : file.tensors()) {
    std::vector<float> x = file.read_f32(t.name);
    w.add_raw(t.name, DType::f32, {static_cast<int64_t>(x.size())}, x.data(), x.size() * 4);
  }
  w.write(out);
}

TEST(Q8_0, BlocksScalesAndRounding) {
  std::vector<float> x(64);
  for (int i = 0; i < 32; ++i) x[static_cast<size_t>(i)] = 0.0f;  // an all-zero block
  for (int i = 32; i < 64; ++i) x[static_cast<size_t>(i)] = static_cast<float>(i - 40) * 0.37f;
  const auto q = io::quantize_q8_0(x.data(), 64);
  ASSERT_EQ(q.size(), 2 * io::kQ8_0BlockBytes);
  std::vector<float> y(64);
  io::dequantize_q8_0(q.data(), 64, y.data());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(y[static_cast<size_t>(i)], 0.0f);
  const float d = f16_to_float(static_cast<uint16_t>(q[34] | (q[35] << 8)));
  EXPECT_NEAR(d, 23 * 0.37f / 127, 1e-4);  // max |x| / 127 as fp16
  for (int i = 32; i < 64; ++i) EXPECT_LE(std::fabs(y[static_cast<size_t>(i)] - x[static_cast<size_t>(i)]), 0.5f * d * 1.01f);
  EXPECT_EQ(static_cast<int8_t>(q[34 + 2 + 31]), 127);  // the largest value maps to 127
  EXPECT_THROW(io::quantize_q8_0(x.data(), 40), Error);
}

struct GgufCase {
  const char* name;
  const char* arch;
  ModelConfig config;
};

// Each case exported at every type, checked by tests/python/check_gguf.py and read back.
void export_check_and_read_back(const std::vector<GgufCase>& cases, const std::string& root) {
  for (const GgufCase& c : cases) {
    const std::string model = test::save_random_model(c.config, root + "/" + c.name);
    for (const std::string type : {"f32", "bf16", "q8_0"}) {
      SCOPED_TRACE(std::string(c.name) + " " + type);
      const std::string file = root + "/" + c.name + "-" + type + ".gguf";
      io::GgufExportOptions o;
      o.type = type;
      const io::GgufExportReport report = io::export_gguf(model, file, o);
      EXPECT_EQ(report.arch, c.arch);
      write_kiln_dequant(file, file + ".kiln.safetensors");
      std::string output;
      EXPECT_EQ(test::run_python("check_gguf.py " + file + " " + model + " " + type + " " + file + ".kiln.safetensors",
                                 &output),
                0)
          << output;
      std::printf("%s %s: %s", c.name, type.c_str(), output.c_str());

      // Read back into a model: f32 is bitwise (q/k reorderings undone), others close.
      std::unique_ptr<Model> original = test::load_inference_model(model), back = test::load_inference_model(model);
      io::load_gguf_weights(*back, file);
      for (const auto& p : original->parameters()) {
        const Tensor a = p->value(), b = back->find_parameter(p->name())->value();
        float worst = 0, scale = 0;
        for (int64_t i = 0; i < a.numel(); ++i) {
          worst = std::max(worst, std::fabs(a.data<float>()[i] - b.data<float>()[i]));
          scale = std::max(scale, std::fabs(a.data<float>()[i]));
        }
        if (type == "f32") EXPECT_EQ(worst, 0.0f) << p->name();
        else EXPECT_LE(worst, scale * (type == "bf16" ? 1.0f / 128 : 1.0f / 127)) << p->name();
      }
    }
  }
}

TEST(Gguf, ExportsPassThePythonChecksAndReadBack) {
  const std::string root = test::temp_dir("kiln-gguf");
  // llama: hidden 48, so matrices reading the hidden state stay f32 under q8_0 (48 % 32 != 0).
  export_check_and_read_back({{"qwen3", "qwen3", test::tiny_config(true, true, false)},
                              {"llama", "llama", test::tiny_config(false, false, false, 48)},
                              {"qwen2", "qwen2", test::tiny_config(false, true, true)}},
                             root);
  fs::remove_all(root);
}

// Partial rotary (model.rope.fraction) as llama.cpp's qwen3 and qwen2 compute it:
// rope.dimension_count = R, and q/k rows, biases and norm gains reordered so that its NEOX
// rotation of the first R dims is kiln's rotation of pairs (j, j + D/2), j < R/2 (check_gguf.py
// checks the order and, at f32, layer 0's attention scores from both layouts).
TEST(Gguf, PartialRotaryWritesTheRotatedDimsAndReordersQk) {
  const std::string root = test::temp_dir("kiln-gguf-partial");
  ModelConfig qwen3 = test::tiny_config(true, true, false), qwen2 = test::tiny_config(false, true, true);
  qwen3.rope.fraction = 0.25;
  qwen2.rope.fraction = 0.5;
  export_check_and_read_back({{"qwen3_partial", "qwen3", qwen3}, {"qwen2_partial", "qwen2", qwen2}}, root);
  fs::remove_all(root);
}

// A sigmoid_bias model exports as llama.cpp's dots1: the router's keys as its loader reads
// them (llama_model_dots1::load_arch_hparams and the generic expert group keys), the
// experts stacked, the bias as exp_probs_b, the shared expert as ffn_*_shexp, the dense
// first layer's MLP as ffn_*; read back bitwise.
TEST(Gguf, SigmoidBiasModelExportsAsDots1) {
  const std::string root = test::temp_dir("kiln-gguf-dots1");
  ModelConfig c = test::tiny_config(true, false, false);
  c.kv_heads = c.heads;  // llama.cpp's dots1 has no grouped-query attention
  c.mlp = "moe";
  c.alt_mlp = "swiglu";
  c.alt_mlp_layers = "0";
  c.moe.experts = 4;
  c.moe.expert_hidden = 32;
  c.moe.router = "sigmoid_bias";
  c.moe.shared_hidden = 64;
  c.moe.routed_scaling = 2.5;
  c.moe.groups = 2;
  c.moe.top_groups = 1;
  const std::string model = test::save_random_model(c, root + "/model");
  const std::string file = root + "/model.gguf";
  EXPECT_EQ(io::export_gguf(model, file, {}).arch, "dots1");
  const io::GgufFile g = io::GgufFile::open(file);
  auto u32 = [&](const std::string& key) { return std::get<uint32_t>(g.get("dots1." + key)); };
  EXPECT_EQ(u32("expert_count"), 4u);
  EXPECT_EQ(u32("expert_used_count"), 2u);
  EXPECT_EQ(u32("expert_feed_forward_length"), 32u);
  EXPECT_EQ(u32("expert_shared_count"), 2u);
  EXPECT_EQ(u32("expert_gating_func"), 2u);  // sigmoid
  EXPECT_EQ(u32("leading_dense_block_count"), 1u);
  EXPECT_EQ(u32("expert_group_count"), 2u);
  EXPECT_EQ(u32("expert_group_used_count"), 1u);
  EXPECT_EQ(u32("feed_forward_length"), 96u);
  EXPECT_EQ(std::get<float>(g.get("dots1.expert_weights_scale")), 2.5f);
  EXPECT_TRUE(std::get<bool>(g.get("dots1.expert_weights_norm")));
  const std::map<std::string, std::vector<int64_t>> shapes = {
      {"blk.0.ffn_gate.weight", {96, 64}},         {"blk.1.ffn_gate_inp.weight", {4, 64}},
      {"blk.1.exp_probs_b.bias", {4}},             {"blk.1.ffn_gate_exps.weight", {4, 32, 64}},
      {"blk.1.ffn_up_exps.weight", {4, 32, 64}},   {"blk.1.ffn_down_exps.weight", {4, 64, 32}},
      {"blk.1.ffn_gate_shexp.weight", {64, 64}},   {"blk.1.ffn_up_shexp.weight", {64, 64}},
      {"blk.1.ffn_down_shexp.weight", {64, 64}},   {"output.weight", {259, 64}}};
  for (const auto& [name, shape] : shapes) EXPECT_EQ(g.tensor(name).shape, shape) << name;
  std::unique_ptr<Model> original = test::load_inference_model(model), back = test::load_inference_model(model);
  io::load_gguf_weights(*back, file);
  for (const auto& p : original->parameters()) {
    const Tensor a = p->value(), b = back->find_parameter(p->name())->value();
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.numel()) * 4), 0) << p->name();
  }
  fs::remove_all(root);
}

// A trained BPE's GGUF names llama.cpp's pre-tokenizer for its split (llama.cpp splits by
// that name, not by the file's regex: "default" would tokenize differently), embeds its
// merges, and a pre-tokenizer llama.cpp has no name for is refused with the file named.
TEST(Gguf, TrainedBpeNamesItsPreTokenizer) {
  const std::string root = test::temp_dir("kiln-gguf-bpe");
  const std::string text = test::read_file(KILN_SOURCE_DIR "/data/tinyshakespeare.txt").substr(0, 200000);
  const std::vector<std::pair<std::string, std::string>> patterns = {
      {"gpt2", "gpt-2"}, {"llama3", "llama-bpe"}, {"qwen2", "qwen2"}};
  for (const auto& [pattern, llama_cpp_name] : patterns) {
    SCOPED_TRACE(pattern);
    bpe::BpeTrainerOptions options;
    options.vocab_size = 300;
    options.special_tokens = {"<|endoftext|>", "<|pad|>"};
    options.pattern = std::string(bpe::named_pattern(pattern));
    bpe::BpeTrainer trainer(options);
    trainer.add_text(text);
    const bpe::TrainedBpe trained = trainer.train();
    ModelConfig config = test::tiny_config(true, true, false);
    config.vocab_size = 300;
    const std::string model = test::save_random_model(config, root + "/" + pattern);
    bpe::write_tokenizer_files(trained, model, "<|endoftext|>", "<|endoftext|>", "<|pad|>", 64);
    const std::string file = root + "/" + pattern + ".gguf";
    io::GgufExportOptions o;
    o.type = "f32";
    io::export_gguf(model, file, o);
    const io::GgufFile gguf = io::GgufFile::open(file);
    EXPECT_EQ(std::get<std::string>(gguf.get("tokenizer.ggml.pre")), llama_cpp_name);
    EXPECT_EQ(std::get<std::vector<std::string>>(gguf.get("tokenizer.ggml.merges")).size(), trained.merges.size());
    EXPECT_EQ(std::get<std::vector<std::string>>(gguf.get("tokenizer.ggml.tokens")).size(), 300u);
  }
  // The same model with a split llama.cpp does not know: refused, naming the tokenizer file.
  const std::string model = root + "/qwen2", json_path = model + "/tokenizer.json";
  std::string json = test::read_file(json_path);
  const std::string qwen2(bpe::named_pattern("qwen2"));
  std::string escaped;  // the pattern as JSON spells it: backslashes doubled
  for (char c : qwen2) escaped += c == '\\' ? std::string("\\\\") : std::string(1, c);
  const size_t at = json.find(escaped);
  ASSERT_NE(at, std::string::npos);
  json.replace(at, escaped.size(), " ?\\\\p{L}+|\\\\s+");
  { std::ofstream(json_path, std::ios::binary) << json; }
  io::GgufExportOptions o;
  o.type = "f32";
  try {
    io::export_gguf(model, root + "/refused.gguf", o);
    ADD_FAILURE() << "an unknown split was exported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(json_path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("pre_tokenizer"), std::string::npos) << e.what();
  }
  fs::remove_all(root);
}

TEST(Gguf, QuantizationEvaluation) {
  const std::string root = test::temp_dir("kiln-gguf-eval");
  const std::string model = test::save_random_model(test::tiny_config(true, false, false), root + "/m");
  std::vector<std::vector<int32_t>> texts;
  for (int s = 0; s < 3; ++s) {
    std::vector<int32_t> t{256};
    Rng rng(static_cast<uint64_t>(s));
    for (int i = 0; i < 40; ++i) t.push_back(static_cast<int32_t>(rng.below(256)));
    texts.push_back(t);
  }
  std::unique_ptr<Model> ref = test::load_inference_model(model);
  for (const std::string type : {"f32", "q8_0"}) {
    io::GgufExportOptions o;
    o.type = type;
    io::export_gguf(model, root + "/m.gguf", o);
    std::unique_ptr<Model> q = test::load_inference_model(model);
    io::load_gguf_weights(*q, root + "/m.gguf");
    const QuantEvalResult r = evaluate_quantization(*ref, *q, texts);
    EXPECT_EQ(r.positions, 3 * 40);
    std::printf("%s: mean KL %.3e, top-1 %.4f, loss %.5f vs %.5f\n", type.c_str(), r.mean_kl, r.top1_agreement,
                r.ref_loss, r.quant_loss);
    if (type == "f32") {
      EXPECT_EQ(r.mean_kl, 0.0);
      EXPECT_EQ(r.top1_agreement, 1.0);
    } else {
      EXPECT_GT(r.mean_kl, 0.0);
      EXPECT_LT(r.mean_kl, 1e-2);
      EXPECT_GT(r.top1_agreement, 0.9);
    }
  }
  fs::remove_all(root);
}

TEST(Gguf, ReaderRejectsDamagedFiles) {
  const std::string root = test::temp_dir("kiln-gguf-bad");
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), root + "/m");
  io::export_gguf(model, root + "/m.gguf", {});
  std::string bytes = test::read_file(root + "/m.gguf");
  test::write_file(root + "/short.gguf", bytes.substr(0, bytes.size() / 2));
  EXPECT_THROW(io::GgufFile::open(root + "/short.gguf"), Error);
  test::write_file(root + "/magic.gguf", "GGML" + bytes.substr(4));
  EXPECT_THROW(io::GgufFile::open(root + "/magic.gguf"), Error);
  fs::remove_all(root);
}

TEST(Gguf, EvalQuantCommand) {
  const std::string root = test::temp_dir("kiln-eval-quant");
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), root + "/m");
  std::string out;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " eval-quant " + model + " --data " KILN_SOURCE_DIR
                                  "/data/tinyshakespeare.txt --max-positions 300 --threads 1",
                              &out),
            0)
      << out;
  EXPECT_NE(out.find("300 held-out positions"), std::string::npos) << out;
  EXPECT_NE(out.find("top-1 agreement"), std::string::npos) << out;
  fs::remove_all(root);
}

}  // namespace
}  // namespace kiln
