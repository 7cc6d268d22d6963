// Shared by the export, GGUF and serve tests: small models with every weight random,
// saved as kiln model directories, and a loss on a fixed text.
#pragma once

#include "io/model_io.h"
#include "test_util.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <numeric>

namespace kiln::test {

inline ModelConfig tiny_config(bool qk_norm, bool tied, bool bias, int64_t hidden = 64) {
  ModelConfig c;
  c.vocab_size = 259;
  c.hidden = hidden;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.ffn_hidden = 96;
  c.max_seq_len = 64;
  c.qk_norm = qk_norm;
  c.tie_embeddings = tied;
  c.attention_bias = bias;
  c.rope_theta = 5000.0;
  c.norm_eps = 1e-5;
  return c;
}

inline void randomize_weights(Model& model, uint64_t seed) {
  int i = 0;
  for (const auto& p : model.parameters()) {
    const Tensor v = p->value();
    const bool gain = p->name().find("norm") != std::string::npos;
    OwnedTensor r = random_tensor(DType::f32, v.shape(), seed + static_cast<uint64_t>(i++), gain ? 0.2 : 0.3);
    for (int64_t j = 0; gain && j < v.numel(); ++j) r->data<float>()[j] += 1.0f;
    copy_tensor(*r, v);
  }
}

// A kiln model directory with random weights; returns its path.
inline std::string save_random_model(const ModelConfig& config, const std::string& dir, uint64_t seed = 3) {
  BuildOptions o;
  o.training = false;
  o.max_tokens = config.max_seq_len;
  Model model(config, o);
  model.allocate();
  randomize_weights(model, seed);
  Config full;
  full.model = config;
  io::save_model(model, full, dir);
  return dir;
}

// The model saved in `dir`, loaded for inference (no gradients; `max_tokens` per forward).
inline std::unique_ptr<Model> load_inference_model(const std::string& dir, int64_t max_tokens = 64) {
  BuildOptions o;
  o.training = false;
  o.max_tokens = max_tokens;
  return std::move(io::load_model(dir, o).model);
}

// `kiln export hf` and `kiln export gguf` of the model in `model_dir` both fail with one
// line that starts "kiln: error: [export] <key_and_value>: " and write nothing under `root`.
inline void expect_exports_refused(const std::string& model_dir, const std::string& root,
                                   const std::string& key_and_value) {
  for (const char* format : {"hf", "gguf"}) {
    SCOPED_TRACE(format);
    const std::string out = root + "/" + format;
    std::string output;
    EXPECT_NE(run_command(kiln_binary() + " export " + format + " " + model_dir + " " + out, &output), 0) << output;
    EXPECT_EQ(output.rfind("kiln: error: [export] " + key_and_value + ": ", 0), 0u) << output;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
    EXPECT_FALSE(std::filesystem::exists(out));
  }
}

// Mean next-byte cross-entropy of `text` (BOS + bytes + EOS) under the model in `dir`.
inline double text_loss(const std::string& dir, const std::string& text) {
  io::LoadedModel m = io::load_model(dir, [] {
    BuildOptions o;
    o.training = false;
    o.max_tokens = 64;
    o.loss_chunk_rows = 16;
    return o;
  }());
  HostBatch b;
  b.tokens.push_back(256);
  for (unsigned char c : text) b.tokens.push_back(c);
  b.targets.assign(b.tokens.begin() + 1, b.tokens.end());
  b.targets.push_back(257);
  b.positions.resize(b.tokens.size());
  std::iota(b.positions.begin(), b.positions.end(), 0);
  b.cu_seqlens = {0, static_cast<int32_t>(b.tokens.size())};
  b.max_seqlen = static_cast<int32_t>(b.tokens.size());
  b.target_count = static_cast<int64_t>(b.tokens.size());
  m.model->load_batch(b);
  const LossSums s = m.model->evaluate();
  return s.loss / static_cast<double>(s.count);
}

// Runs a Python oracle script from tests/python; returns its exit code, output in *out.
inline int run_python(const std::string& script_and_args, std::string* out) {
  return run_command(kiln_python() + " " + KILN_SOURCE_DIR "/tests/python/" + script_and_args, out);
}

}  // namespace kiln::test
