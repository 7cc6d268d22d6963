// `kiln export gguf`: a saved kiln model as a GGUF v3 file for llama.cpp, under its
// qwen3 / llama / qwen2 (qwen3moe, dots1, gemma2, gemma3) architectures (the same choice,
// and the same refusals, as the HF export: io/hf_config.h), with llama.cpp's metadata keys
// and tensor names:
//   token_embd, output_norm, output (untied only), blk.N.{attn_norm, attn_q, attn_k, attn_v,
//   attn_output, attn_q_norm, attn_k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down}[.bias]
// head_dim is written as attention.key_length / value_length. RoPE pairing: llama.cpp's
// "llama" applies RoPE to interleaved pairs (2i, 2i+1), so q/k rows are permuted within each
// head as convert_hf_to_gguf.py does; "qwen3"/"qwen2" use NEOX (rotate_half) pairs like kiln,
// so their weights go unchanged, except under partial rotary (model.rope.fraction < 1):
// llama.cpp rotates the first rope.dimension_count = R dims, pairs (j, j + R/2), kiln pairs
// (j, j + D/2) for j < R/2, so q/k rows, biases and norm gains are reordered per head.
// Gemma 2/3 (sandwich norms) go to llama.cpp's gemma2 / gemma3 (NEOX too), with the sandwich
// norms as post_attention_norm / post_ffw_norm and every *norm.weight stored as 1 + w
// (Gemma's gain; llama.cpp multiplies by the stored one), which load_gguf_weights undoes.
// Weight types: f32, bf16 or q8_0 for matrices (a matrix whose rows are not a multiple of 32
// stays f32 under q8_0); norms and biases always f32. The tokenizer is embedded as a "gpt2"
// vocabulary (tokens, token types, merges, bos/eos/pad ids).
#pragma once

#include "model/model.h"

#include <string>

namespace kiln::io {

struct GgufExportOptions {
  std::string type = "f32";  // f32 | bf16 | q8_0
};

struct GgufExportReport {
  std::string arch;
  int64_t tensors = 0;
  int64_t quantized = 0;   // matrices stored as bf16 / q8_0
  int64_t kept_f32 = 0;    // norms, biases, and matrices whose rows do not fit the blocks
  int64_t bytes = 0;       // tensor data
  int64_t training_only = 0;  // tensors left out: used in training only (multi-token prediction)
};

GgufExportReport export_gguf(const std::string& model_path, const std::string& out_path,
                             const GgufExportOptions& options);

// Reads the weights of a GGUF file that export_gguf wrote back into a built, allocated f32
// model of the same configuration: dequantized, q/k rows back in kiln's order. Every parameter
// must be present with its shape; an extra tensor is an error.
void load_gguf_weights(Model& model, const std::string& gguf_path);

}  // namespace kiln::io
