// The input of the whole-model GPU tests (a component's GPU model against the CPU's with
// the same weights): a packed batch of byte-level documents and the build options both
// models share.
#pragma once

#include "core/rng.h"
#include "data/batch.h"
#include "model/model.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace kiln::gpu_test {

// Documents of `lengths` tokens (BOS 256, then random bytes from `seed`; each token's
// target the next, the last one's EOS 257), then a PAD (258) tail of `pad` tokens
// without targets, packed into one batch.
inline HostBatch packed_documents(std::initializer_list<int64_t> lengths, int64_t pad, uint64_t seed) {
  constexpr int32_t kBos = 256, kEos = 257, kPad = 258;
  Rng rng(seed);
  HostBatch b;
  b.cu_seqlens.push_back(0);
  auto add = [&](int64_t length, bool padding) {
    const size_t first = b.tokens.size();
    for (int64_t i = 0; i < length; ++i) {
      b.tokens.push_back(padding ? kPad : i == 0 ? kBos : static_cast<int32_t>(rng.below(256)));
      b.positions.push_back(static_cast<int32_t>(i));
      if (!padding) ++b.document_tokens;
    }
    for (int64_t i = 0; i < length; ++i) {
      const int32_t target =
          padding ? kIgnoreTarget : i + 1 < length ? b.tokens[first + static_cast<size_t>(i) + 1] : kEos;
      b.targets.push_back(target);
      if (target != kIgnoreTarget) ++b.target_count;
    }
    b.cu_seqlens.push_back(static_cast<int32_t>(b.tokens.size()));
    b.max_seqlen = std::max(b.max_seqlen, static_cast<int32_t>(length));
  };
  for (const int64_t length : lengths) add(length, false);
  add(pad, true);
  return b;
}

// A model of `tokens` rows on `device` in `dtype`, its LM-head loss in chunks of 16 rows
// (so the tests cross chunk boundaries), recomputing `recompute` blocks' activations.
inline BuildOptions options_for(Device device, DType dtype, int64_t tokens, int64_t recompute = 0) {
  BuildOptions o;
  o.device = device;
  o.dtype = dtype;
  o.max_tokens = tokens;
  o.loss_chunk_rows = 16;
  o.recompute_blocks = recompute;
  return o;
}

}  // namespace kiln::gpu_test
