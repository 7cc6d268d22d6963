// Golden model test: kiln's Qwen3-shaped model, given the weights and packed batch of
// tests/data/golden/*.safetensors, must reproduce the logits, loss and every parameter
// gradient that transformers' Qwen3ForCausalLM computed running each document alone
// (scripts/make_golden.py); and the sparse model those of Qwen3MoeForCausalLM with its
// load-balancing loss (scripts/make_golden_moe.py). fp32, relative error within 1e-4.
#include "io/export_names.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <map>

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

// The sparse model's config as kiln's importer reads the file's config.json (so the
// mapping of mlp_only_layers, the expert sizes and router_aux_loss_coef is under test too).
ModelConfig moe_config_from(const io::SafetensorsFile& file) {
  return io::hf_config_to_model(nlohmann::json::parse(file.metadata("config")), "golden config").model;
}

double scalar(const io::SafetensorsFile& file, const std::string& name) {
  return io::read_tensor(file, name, DType::f32)->data<float>()[0];
}

void check_golden(const std::string& file_name, bool moe = false) {
  const auto file = io::SafetensorsFile::open(std::string(KILN_TEST_DATA_DIR) + "/golden/" + file_name);
  const ModelConfig config = moe ? moe_config_from(file) : config_from(file);
  const HostBatch batch = batch_from(file);
  BuildOptions options;
  options.max_tokens = batch.size();
  options.loss_chunk_rows = 16;  // several chunks, the last one partial
  Model model(config, options);
  model.allocate();
  for (const auto& p : model.parameters()) io::read_into(file, io::hf_name(*p), p->value());

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
  const LossSums sums = model.forward_backward(1.0 / static_cast<double>(batch.target_count));
  const double loss = sums.loss / static_cast<double>(sums.count);
  const double expected_loss = scalar(file, "loss");
  EXPECT_EQ(sums.count, batch.target_count);
  EXPECT_NEAR(loss, expected_loss, 1e-4 * std::fabs(expected_loss));
  if (moe) {
    // transformers' balance loss of one sparse layer is top_k x kiln's Switch form (it
    // divides the choices by T, kiln by T k); the gradients are of the whole objective.
    const int aux = model.loss_terms().find("moe_aux");
    ASSERT_GE(aux, 0) << "the file's router_aux_loss_coef must switch kiln's balance loss on";
    const double kiln_aux = sums.slot[static_cast<size_t>(aux)];
    const double expected_aux = scalar(file, "aux_loss");
    EXPECT_NEAR(kiln_aux * static_cast<double>(config.moe.top_k), expected_aux, 1e-4 * expected_aux);
    EXPECT_DOUBLE_EQ(config.moe.aux_loss, std::stod(file.metadata("kiln_aux_loss")));
    const double total = loss + config.moe.aux_loss * kiln_aux, expected_total = scalar(file, "total_loss");
    EXPECT_NEAR(total, expected_total, 1e-4 * expected_total);
    std::printf("%s: aux loss %.7f (x top_k) vs %.7f, total %.7f vs %.7f\n", file_name.c_str(),
                kiln_aux * static_cast<double>(config.moe.top_k), expected_aux, total, expected_total);
  }

  int checked = 0;
  double worst_grad = 0;
  for (const auto& p : model.parameters()) {
    const std::string hf = io::hf_name(*p);
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
// Layer 0 dense (mlp_only_layers), layer 1 sparse: 8 experts, top 2, norm_topk_prob; the
// router's gradient includes the balance loss's.
TEST(Golden, Qwen3MoeMatchesTransformers) { check_golden("qwen3_moe_tiny.safetensors", true); }

// The names the components give their parameters are the stock layouts' (transformers'
// Qwen2/Qwen3/Llama state dicts, llama.cpp's GGUF tensors): every parameter of a model with
// every optional tensor (untied head, q/k norms, q/k/v biases) against the table.
TEST(ExportNames, ComponentsNameTheirParametersAsTheStockLayouts) {
  ModelConfig config;
  config.layers = 2;
  config.tie_embeddings = false;
  config.attention_bias = true;
  BuildOptions options;
  options.training = false;
  options.max_tokens = 8;
  const Model model(config, options);
  const std::map<std::string, std::pair<std::string, std::string>> expected = {
      {"embed.weight", {"model.embed_tokens.weight", "token_embd.weight"}},
      {"final_norm.weight", {"model.norm.weight", "output_norm.weight"}},
      {"lm_head.weight", {"lm_head.weight", "output.weight"}},
  };
  const std::map<std::string, std::pair<std::string, std::string>> per_layer = {
      {"attn_norm.weight", {"input_layernorm.weight", "attn_norm.weight"}},
      {"mlp_norm.weight", {"post_attention_layernorm.weight", "ffn_norm.weight"}},
      {"attn.q_proj.weight", {"self_attn.q_proj.weight", "attn_q.weight"}},
      {"attn.k_proj.weight", {"self_attn.k_proj.weight", "attn_k.weight"}},
      {"attn.v_proj.weight", {"self_attn.v_proj.weight", "attn_v.weight"}},
      {"attn.o_proj.weight", {"self_attn.o_proj.weight", "attn_output.weight"}},
      {"attn.q_proj.bias", {"self_attn.q_proj.bias", "attn_q.bias"}},
      {"attn.k_proj.bias", {"self_attn.k_proj.bias", "attn_k.bias"}},
      {"attn.v_proj.bias", {"self_attn.v_proj.bias", "attn_v.bias"}},
      {"attn.q_norm.weight", {"self_attn.q_norm.weight", "attn_q_norm.weight"}},
      {"attn.k_norm.weight", {"self_attn.k_norm.weight", "attn_k_norm.weight"}},
      {"mlp.gate_proj.weight", {"mlp.gate_proj.weight", "ffn_gate.weight"}},
      {"mlp.up_proj.weight", {"mlp.up_proj.weight", "ffn_up.weight"}},
      {"mlp.down_proj.weight", {"mlp.down_proj.weight", "ffn_down.weight"}},
  };
  size_t checked = 0;
  for (const auto& p : model.parameters()) {
    const ParamName& n = p->names();
    std::pair<std::string, std::string> want;
    if (auto it = expected.find(n.kiln); it != expected.end()) {
      want = it->second;
    } else {
      ASSERT_EQ(n.kiln.rfind("layers.", 0), 0u) << n.kiln;
      const size_t dot = n.kiln.find('.', 7);
      const std::string index = n.kiln.substr(7, dot - 7), leaf = n.kiln.substr(dot + 1);
      ASSERT_TRUE(per_layer.count(leaf)) << n.kiln;
      want = {"model.layers." + index + "." + per_layer.at(leaf).first, "blk." + index + "." + per_layer.at(leaf).second};
    }
    EXPECT_EQ(n.hf, want.first) << n.kiln;
    EXPECT_EQ(n.gguf, want.second) << n.kiln;
    // The tensors whose rows follow a head's dims, which the GGUF exporter reorders where
    // llama.cpp pairs RoPE's dims otherwise (llama: interleaved; partial rotary): q and k
    // weights, biases and norm gains; never v.
    const bool rope_rows = n.kiln.find("attn.q_") != std::string::npos || n.kiln.find("attn.k_") != std::string::npos;
    EXPECT_EQ(n.gguf_layout == GgufLayout::rope_rows, rope_rows) << n.kiln;
    ++checked;
  }
  EXPECT_EQ(checked, 3 + 2 * per_layer.size());
}

}  // namespace
}  // namespace kiln
