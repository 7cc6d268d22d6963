// Tiny models and hand-packed batches for the module, packing and recompute tests.
#pragma once

#include "core/rng.h"
#include "data/batch.h"
#include "model/model.h"

#include <algorithm>
#include <vector>

namespace kiln::test {

// Token ids of the tiny test vocabulary: 0..9 content, then BOS, EOS, PAD.
constexpr int32_t kTinyBos = 10, kTinyEos = 11, kTinyPad = 12;

// A small model whose every path matters: init_std 0.3 (not 0.02) so attention, SwiGLU and
// the norms work away from their linear regime and gradients are not tiny.
inline ModelConfig tiny_config(bool qk_norm, bool tie, int64_t vocab = 13) {
  ModelConfig c;
  c.name = "grad-tiny";
  c.vocab_size = vocab;
  c.hidden = 8;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 4;
  c.ffn_hidden = 12;
  c.max_seq_len = 16;
  c.qk_norm = qk_norm;
  c.tie_embeddings = tie;
  c.attention_bias = true;
  c.init_std = 0.3;
  return c;
}

inline BuildOptions tiny_build(int64_t max_tokens = 24, int64_t loss_chunk_rows = 7, double z_loss = 0) {
  BuildOptions o;
  o.dtype = DType::f64;
  o.device = Device::cpu;
  o.max_tokens = max_tokens;
  o.loss_chunk_rows = loss_chunk_rows;
  o.z_loss = z_loss;
  o.training = true;
  return o;
}

// init_weights, then norm gains moved away from 1 and biases away from 0, so that a
// gradient that ignores a gain or a bias cannot pass by accident.
inline void init_tiny_model(Model& m, uint64_t seed) {
  m.init_weights(seed);
  Rng rng(seed ^ 0x5eedull);
  for (const auto& p : m.parameters()) {
    if (p->shape().rank() != 1) continue;
    const bool gain = p->init().kind == InitKind::ones, constant = p->init().kind == InitKind::constant;
    double* v = p->value().data<double>();
    for (int64_t i = 0; i < p->value().numel(); ++i)
      v[i] = constant ? p->init().std * (1.0 + 0.2 * rng.normal())  // a DyT alpha: kept of its sign
                      : (gain ? 1.0 : 0.0) + (gain ? 0.3 : 0.2) * rng.normal();
  }
}

// One document's rows: tokens and the next-token targets (kIgnoreTarget where no loss).
struct Doc {
  std::vector<int32_t> tokens, targets;
};

// Packs whole documents as the packer does: positions restart at 0 in each, cu_seqlens
// marks each start, and an optional PAD tail forms its own sequence with ignored targets.
inline HostBatch pack_docs(const std::vector<Doc>& docs, int64_t pad_tail = 0) {
  HostBatch b;
  b.cu_seqlens.push_back(0);
  auto add = [&](const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets, bool is_doc) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      b.tokens.push_back(tokens[i]);
      b.targets.push_back(targets[i]);
      b.positions.push_back(static_cast<int32_t>(i));
      if (targets[i] != kIgnoreTarget) ++b.target_count;
      if (is_doc) ++b.document_tokens;
    }
    b.cu_seqlens.push_back(static_cast<int32_t>(b.tokens.size()));
    b.max_seqlen = std::max(b.max_seqlen, static_cast<int32_t>(tokens.size()));
  };
  for (const Doc& d : docs) add(d.tokens, d.targets, true);
  if (pad_tail > 0)
    add(std::vector<int32_t>(static_cast<size_t>(pad_tail), kTinyPad),
        std::vector<int32_t>(static_cast<size_t>(pad_tail), kIgnoreTarget), false);
  return b;
}

// Three documents of awkward lengths (5, 7, 4), one with an ignored target inside.
inline std::vector<Doc> three_docs() {
  return {
      {{kTinyBos, 3, 5, 7, 2}, {3, 5, 7, 2, kTinyEos}},
      {{kTinyBos, 1, 1, 9, 0, 4, 6}, {1, 1, 9, kIgnoreTarget, 4, 6, kTinyEos}},
      {{kTinyBos, 8, 2, 2}, {8, 2, 2, kTinyEos}},
  };
}

}  // namespace kiln::test
