#include "train/synthetic_batch.h"

#include "core/rng.h"

#include <algorithm>

namespace kiln {

HostBatch synthetic_batch(const Config& c) {
  const int64_t t = c.train.micro_batch_tokens, seq = std::min(c.model.max_seq_len, t);
  HostBatch b;
  Rng rng(c.train.seed);
  for (int64_t i = 0; i < t; ++i) {
    b.tokens.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.model.vocab_size))));
    b.positions.push_back(static_cast<int32_t>(i % seq));
    if (i % seq == 0) b.cu_seqlens.push_back(static_cast<int32_t>(i));
  }
  b.cu_seqlens.push_back(static_cast<int32_t>(t));
  b.targets.assign(b.tokens.begin() + 1, b.tokens.end());
  b.targets.push_back(b.tokens.front());
  b.max_seqlen = static_cast<int32_t>(seq);
  b.target_count = t;
  b.document_tokens = t;
  return b;
}

}  // namespace kiln
