// Shared helpers of the data-pipeline tests (loader, stream, shard formats): synthetic
// corpora, a byte-level packer, and batch-by-batch comparison of two streams.
#pragma once

#include "core/rng.h"
#include "data/batch_stream.h"
#include "data/dataset.h"
#include "data/tokenizer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kiln::test {

using Ids = std::vector<int32_t>;

// `n` distinct documents of 1..max_len bytes ("doc<i>:" then random letters).
inline std::vector<Document> synthetic_documents(int n, int max_len, uint64_t seed) {
  Rng rng(seed);
  std::vector<Document> docs;
  for (int i = 0; i < n; ++i) {
    std::string text = "doc" + std::to_string(i) + ":";
    const auto len = static_cast<int>(1 + rng.below(static_cast<uint64_t>(max_len)));
    while (static_cast<int>(text.size()) < len) text.push_back(static_cast<char>('a' + rng.below(26)));
    docs.push_back(Document{static_cast<uint64_t>(i), text});
  }
  return docs;
}

// A JSONL corpus of `n` documents of 1..max_len bytes (some long enough to be split).
inline std::string corpus_jsonl(int n, int max_len, uint64_t seed) {
  Rng rng(seed);
  std::string out;
  for (int i = 0; i < n; ++i) {
    std::string text = "doc " + std::to_string(i) + ":";
    const auto len = 1 + rng.below(static_cast<uint64_t>(max_len));
    while (text.size() < len) text.push_back(static_cast<char>('a' + rng.below(26)));
    out += "{\"text\": \"" + text + "\"}\n";
  }
  return out;
}

// A packer of T-token batches of sequences up to L tokens with the byte tokenizer's ids.
inline Packer make_packer(int64_t T, int64_t L, LongDocPolicy policy = LongDocPolicy::split) {
  ByteTokenizer tok;
  return Packer(PackerOptions{T, L, policy, tok.bos_id(), tok.eos_id(), tok.pad_id()});
}

// The documents of a tokenized split, as token lists.
inline std::vector<Ids> documents_of(const TokenizedSplit& s) {
  std::vector<Ids> out;
  for (int64_t i = 0; i < s.num_documents(); ++i) out.emplace_back(s.document(i).begin(), s.document(i).end());
  return out;
}

// The next `count` batches of a and b are identical, field by field.
inline void expect_same_batches(BatchStream& a, BatchStream& b, int count) {
  HostBatch x, y;
  for (int i = 0; i < count; ++i) {
    a.next(x);
    b.next(y);
    ASSERT_EQ(x.tokens, y.tokens) << "batch " << i;
    ASSERT_EQ(x.targets, y.targets) << "batch " << i;
    ASSERT_EQ(x.positions, y.positions) << "batch " << i;
    ASSERT_EQ(x.cu_seqlens, y.cu_seqlens) << "batch " << i;
  }
}

}  // namespace kiln::test
