// Text generation from a model: temperature and top-k sampling, one token at a time.
// (No KV cache yet: each step re-runs the context, capped at model.max_seq_len.)
#pragma once

#include "data/tokenizer.h"
#include "model/model.h"

#include <string>

namespace kiln {

struct SampleOptions {
  int64_t max_tokens = 200;
  double temperature = 0.8;  // 0 = greedy
  int64_t top_k = 40;        // 0 = whole vocabulary
  uint64_t seed = 0;
  bool stop_at_eos = true;
};

// Continues `prompt` (a new document: BOS first); returns the generated text only.
std::string generate(Model& model, const Tokenizer& tokenizer, const std::string& prompt,
                     const SampleOptions& options);

}  // namespace kiln
