// Golden model test: kiln's Qwen3-shaped model, given the weights and packed batch of
// tests/data/golden/*.safetensors, must reproduce the logits, loss and every parameter
// gradient that transformers' Qwen3ForCausalLM computed running each document alone
// (scripts/make_golden.py). fp32, relative error within 1e-4.
#include "io/hf_names.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>

namespace kiln {
namespace {

// max |a - b| / max |b|: error relative to the tensor's scale, so entries that are
// near zero by cancellation do not dominate.
double scaled_error(const float* a, const float* b, int64_t n) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_TRUE(std::isfinite(a[i])) << "non-finite value at " << i;
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

std::vector<int32_t> ints(const io::SafetensorsFile& file, const std::string& name) {
  const OwnedTensor t = io::read_tensor(file, name, DType::i32);
  return std::vector<int32_t>(t->data<int32_t>(), t->data<int32_t>() + t->numel());
}

ModelConfig config_from(const io::SafetensorsFile& file) {
  const auto hf = nlohmann::json::parse(file.metadata("config"));
  ModelConfig c;
  c.vocab_size = hf["vocab_size"];
  c.hidden = hf["hidden_size"];
  c.layers = hf["num_hidden_layers"];
  c.heads = hf["num_attention_heads"];
  c.kv_heads = hf["num_key_value_heads"];
  c.head_dim = hf["head_dim"];
  c.ffn_hidden = hf["intermediate_size"];
  c.max_seq_len = hf["max_position_embeddings"];
  c.norm_eps = hf["rms_norm_eps"];
  c.rope_theta = hf["rope_parameters"]["rope_theta"];
  c.tie_embeddings = hf["tie_word_embeddings"];
  c.qk_norm = true;
  return c;
}

// The packed batch: documents back to back, positions restarting, no PAD tail.
HostBatch batch_from(const io::SafetensorsFile& file) {
  HostBatch b;
  b.tokens = ints(file, "input_ids");
  b.targets = ints(file, "targets");
  b.cu_seqlens = ints(file, "cu_seqlens");
  b.positions.resize(b.tokens.size());
  for (size_t s = 0; s + 1 < b.cu_seqlens.size(); ++s) {
    for (int32_t i = b.cu_seqlens[s]; i < b.cu_seqlens[s + 1]; ++i) b.positions[static_cast<size_t>(i)] = i - b.cu_seqlens[s];
    b.max_seqlen = std::max(b.max_seqlen, b.cu_seqlens[s + 1] - b.cu_seqlens[s]);
  }
  for (int32_t t : b.targets) b.target_count += t >= 0;
  return b;
}

void check_golden(const std::string& file_name) {
  const auto file = io::SafetensorsFile::open(std::string(KILN_TEST_DATA_DIR) + "/golden/" + file_name);
  const ModelConfig config = config_from(file);
  const HostBatch batch = batch_from(file);
  BuildOptions options;
  options.max_tokens = batch.size();
  options.loss_chunk_rows = 16;  // several chunks, the last one partial
  Model model(config, options);
  model.allocate();
  for (const auto& p : model.parameters()) io::read_into(file, io::to_hf_name(p->name()), p->value());

  // Logits of every row.
  model.load_batch(batch);
  std::vector<float> logits;
  model.logits(0, batch.size(), logits);
  const OwnedTensor expected_logits = io::read_tensor(file, "logits", DType::f32);
  ASSERT_EQ(static_cast<int64_t>(logits.size()), expected_logits->numel());
  const double logits_error = scaled_error(logits.data(), expected_logits->data<float>(), expected_logits->numel());
  EXPECT_LT(logits_error, 1e-4) << "logits";

  // Loss and gradients: the loss is the mean over the batch's target tokens.
  model.zero_grads();
  const ops::LossSums sums = model.forward_backward(1.0 / static_cast<double>(batch.target_count), 0.0);
  const double loss = sums.loss / static_cast<double>(sums.count);
  const double expected_loss = io::read_tensor(file, "loss", DType::f32)->data<float>()[0];
  EXPECT_EQ(sums.count, batch.target_count);
  EXPECT_NEAR(loss, expected_loss, 1e-4 * std::fabs(expected_loss));

  int checked = 0;
  double worst_grad = 0;
  for (const auto& p : model.parameters()) {
    const std::string hf = io::to_hf_name(p->name());
    const OwnedTensor expected = io::read_tensor(file, "grad." + hf, DType::f32);
    const Tensor grad = p->grad();
    ASSERT_EQ(grad.numel(), expected->numel()) << hf;
    const double err = scaled_error(grad.data<float>(), expected->data<float>(), grad.numel());
    EXPECT_LT(err, 1e-4) << "gradient of " << p->name() << " (" << hf << ")";
    worst_grad = std::max(worst_grad, err);
    ++checked;
  }
  // Every parameter of the file was checked: none of kiln's is missing or extra.
  int file_params = 0;
  for (const std::string& name : file.names()) file_params += name.rfind("grad.", 0) == 0;
  EXPECT_EQ(checked, file_params);
  std::printf("%s: logits error %.2e, loss %.7f vs %.7f, worst gradient error %.2e over %d tensors\n",
              file_name.c_str(), logits_error, loss, expected_loss, worst_grad, checked);
}

TEST(Golden, Qwen3TiedEmbeddingsMatchTransformers) { check_golden("qwen3_tiny_tied.safetensors"); }
TEST(Golden, Qwen3UntiedEmbeddingsMatchTransformers) { check_golden("qwen3_tiny_untied.safetensors"); }

TEST(HfNames, RoundTripAndErrors) {
  for (const std::string name : {"embed.weight", "final_norm.weight", "lm_head.weight", "layers.0.attn.q_proj.weight",
                                 "layers.11.mlp.down_proj.weight", "layers.2.attn.k_norm.weight",
                                 "layers.3.mlp_norm.weight"})
    EXPECT_EQ(io::from_hf_name(io::to_hf_name(name)), name);
  EXPECT_EQ(io::to_hf_name("layers.7.attn_norm.weight"), "model.layers.7.input_layernorm.weight");
  EXPECT_THROW(io::to_hf_name("layers.x.attn.q_proj.weight"), Error);
  EXPECT_THROW(io::from_hf_name("model.layers.0.block_sparse_moe.gate.weight"), Error);
}

}  // namespace
}  // namespace kiln
