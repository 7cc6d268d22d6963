// Packer: exact layout of packed micro-batches on hand-built examples, and the
// long-document policies.
#include "data/batch_stream.h"
#include "data/packer.h"
#include "data/tokenizer.h"
#include "test_util.h"

#include <gtest/gtest.h>

namespace kiln {
namespace {

constexpr int32_t B = ByteTokenizer::kBos, E = ByteTokenizer::kEos, P = ByteTokenizer::kPad, X = kIgnoreTarget;

using Ids = std::vector<int32_t>;

Packer make_packer(int64_t T, int64_t L, LongDocPolicy policy = LongDocPolicy::split) {
  return Packer(PackerOptions{T, L, policy, B, E, P});
}

// Documents with ids 0, 1, ... unless given.
TokenizedSplit make_split(const std::vector<Ids>& docs, std::vector<uint64_t> ids = {}) {
  if (ids.empty()) {
    for (size_t i = 0; i < docs.size(); ++i) ids.push_back(i);
  }
  return TokenizedSplit::build(ids, docs);
}

// Invariants every batch must hold, whatever its contents.
void expect_well_formed(const HostBatch& b, int64_t T, int64_t L) {
  ASSERT_EQ(b.size(), T);
  ASSERT_EQ(static_cast<int64_t>(b.targets.size()), T);
  ASSERT_EQ(static_cast<int64_t>(b.positions.size()), T);
  ASSERT_GE(b.cu_seqlens.size(), 2u);
  EXPECT_EQ(b.cu_seqlens.front(), 0);
  EXPECT_EQ(b.cu_seqlens.back(), T);
  int64_t targets = 0, doc_tokens = 0;
  int32_t longest = 0;
  for (int64_t s = 0; s < b.num_seqs(); ++s) {
    const int32_t begin = b.cu_seqlens[s], end = b.cu_seqlens[s + 1];
    ASSERT_LT(begin, end);
    longest = std::max(longest, end - begin);
    for (int32_t i = begin; i < end; ++i) EXPECT_EQ(b.positions[i], i - begin);  // restart at 0
  }
  for (int64_t i = 0; i < T; ++i) {
    targets += b.targets[i] != kIgnoreTarget;
    doc_tokens += b.tokens[i] != P;
    EXPECT_EQ(b.tokens[i] == P, b.targets[i] == kIgnoreTarget);
  }
  EXPECT_EQ(b.max_seqlen, longest);
  EXPECT_LE(b.max_seqlen, L);
  EXPECT_EQ(b.target_count, targets);
  EXPECT_EQ(b.document_tokens, doc_tokens);
}

TEST(Packer, HandBuiltBatchesAreExact) {
  // T = 12, L = 8. A: 4 positions, B: 2, C: 7 -> C does not fit after A+B (6 + 7 > 12).
  const TokenizedSplit split = make_split({{10, 11, 12}, {20}, {30, 31, 32, 33, 34, 35}});
  const auto batches = validation_batches(split, make_packer(12, 8), 100);
  ASSERT_EQ(batches.size(), 2u);

  const HostBatch& b0 = batches[0];
  EXPECT_EQ(b0.tokens, (Ids{B, 10, 11, 12, B, 20, P, P, P, P, P, P}));
  EXPECT_EQ(b0.targets, (Ids{10, 11, 12, E, 20, E, X, X, X, X, X, X}));
  EXPECT_EQ(b0.positions, (Ids{0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(b0.cu_seqlens, (Ids{0, 4, 6, 12}));
  EXPECT_EQ(b0.max_seqlen, 6);  // the PAD tail is a sequence too
  EXPECT_EQ(b0.target_count, 6);
  EXPECT_EQ(b0.document_tokens, 6);
  expect_well_formed(b0, 12, 8);

  const HostBatch& b1 = batches[1];
  EXPECT_EQ(b1.tokens, (Ids{B, 30, 31, 32, 33, 34, 35, P, P, P, P, P}));
  EXPECT_EQ(b1.targets, (Ids{30, 31, 32, 33, 34, 35, E, X, X, X, X, X}));
  EXPECT_EQ(b1.positions, (Ids{0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4}));
  EXPECT_EQ(b1.cu_seqlens, (Ids{0, 7, 12}));
  EXPECT_EQ(b1.max_seqlen, 7);
  EXPECT_EQ(b1.target_count, 7);
  expect_well_formed(b1, 12, 8);
}

TEST(Packer, ExactFitHasNoPadSequence) {
  const auto batches = validation_batches(make_split({{1, 2}, {3, 4, 5}}), make_packer(7, 4), 10);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].tokens, (Ids{B, 1, 2, B, 3, 4, 5}));
  EXPECT_EQ(batches[0].targets, (Ids{1, 2, E, 3, 4, 5, E}));
  EXPECT_EQ(batches[0].cu_seqlens, (Ids{0, 3, 7}));
  EXPECT_EQ(batches[0].target_count, 7);
  EXPECT_EQ(batches[0].document_tokens, 7);
}

TEST(Packer, EmptyDocumentIsOnePosition) {
  const auto batches = validation_batches(make_split({{}, {7}}), make_packer(4, 4), 10);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].tokens, (Ids{B, B, 7, P}));
  EXPECT_EQ(batches[0].targets, (Ids{E, 7, E, X}));
  EXPECT_EQ(batches[0].cu_seqlens, (Ids{0, 1, 3, 4}));
}

TEST(Packer, LongPadTailIsCutIntoSegmentsOfAtMostL) {
  // Only the last validation batch can have a tail >= L; positions must stay < L.
  const auto batches = validation_batches(make_split({{5}}), make_packer(16, 4), 10);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].cu_seqlens, (Ids{0, 2, 6, 10, 14, 16}));
  EXPECT_EQ(batches[0].positions, (Ids{0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
  EXPECT_EQ(batches[0].max_seqlen, 4);
  EXPECT_EQ(batches[0].target_count, 2);
  expect_well_formed(batches[0], 16, 4);
}

TEST(Packer, SplitPolicyCutsIntoPiecesWithTrueNextTokens) {
  const Packer packer = make_packer(8, 4);
  // 6 tokens -> 7 positions -> pieces of 4 and 3.
  EXPECT_EQ(packer.num_pieces(6, 0), 2);
  EXPECT_EQ(packer.piece_positions(6, 0), 4);
  EXPECT_EQ(packer.piece_positions(6, 1), 3);
  EXPECT_EQ(packer.num_pieces(3, 0), 1);  // exactly L positions: not split
  EXPECT_EQ(packer.num_pieces(7, 0), 2);  // 8 positions: two full pieces
  EXPECT_EQ(packer.num_pieces(8, 0), 3);

  const auto batches = validation_batches(make_split({{1, 2, 3, 4, 5, 6}, {9, 9, 9}}), packer, 10);
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_EQ(batches[0].tokens, (Ids{B, 1, 2, 3, 4, 5, 6, P}));
  EXPECT_EQ(batches[0].targets, (Ids{1, 2, 3, 4, 5, 6, E, X}));  // piece 0 ends with target 4
  EXPECT_EQ(batches[0].positions, (Ids{0, 1, 2, 3, 0, 1, 2, 0}));
  EXPECT_EQ(batches[0].cu_seqlens, (Ids{0, 4, 7, 8}));
  EXPECT_EQ(batches[0].max_seqlen, 4);
  EXPECT_EQ(batches[1].tokens, (Ids{B, 9, 9, 9, P, P, P, P}));
  EXPECT_EQ(batches[1].cu_seqlens, (Ids{0, 4, 8}));
  for (const auto& b : batches) expect_well_formed(b, 8, 4);
}

// Cut `offset` positions in: a head piece of that many positions, then pieces of L; the
// inputs and targets of every offset read the whole sequence once, in order.
TEST(Packer, AnOffsetCutsAHeadPieceThenPiecesOfL) {
  const Packer packer = make_packer(16, 4);
  // 9 tokens -> 10 positions: offset 3 -> 3 + 4 + 3; offset 2 -> 2 + 4 + 4.
  EXPECT_EQ(packer.num_pieces(9, 0, 3), 3);
  EXPECT_EQ(packer.piece_positions(9, 0, 3), 3);
  EXPECT_EQ(packer.piece_positions(9, 1, 3), 4);
  EXPECT_EQ(packer.piece_positions(9, 2, 3), 3);
  EXPECT_EQ(packer.num_pieces(9, 0, 2), 3);
  EXPECT_EQ(packer.piece_positions(9, 2, 2), 4);
  EXPECT_EQ(packer.num_pieces(3, 0, 2), 1);  // not split: the offset does not apply
  EXPECT_EQ(packer.piece_positions(3, 0, 2), 4);
  const Ids doc = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  for (int64_t offset = 0; offset < 4; ++offset) {
    HostBatch b;
    packer.begin(b);
    const TokenSpan tokens(std::span<const int32_t>(doc.data(), doc.size()));
    for (int64_t piece = 0; piece < packer.num_pieces(9, 0, offset); ++piece) packer.append(b, tokens, piece, offset);
    EXPECT_EQ(b.tokens, (Ids{B, 1, 2, 3, 4, 5, 6, 7, 8, 9})) << offset;
    EXPECT_EQ(b.targets, (Ids{1, 2, 3, 4, 5, 6, 7, 8, 9, E})) << offset;
    if (offset > 0) EXPECT_EQ(b.cu_seqlens[1], offset);  // the head piece
    for (size_t s = 1; s < b.cu_seqlens.size(); ++s) EXPECT_LE(b.cu_seqlens[s] - b.cu_seqlens[s - 1], 4);
  }
  EXPECT_NE(test::error_of([&] { (void)packer.num_pieces(9, 0, 4); }).find("piece offset 4 is not in [0, 4)"),
            std::string::npos);
}

TEST(Packer, SplitPiecesMayLandInDifferentBatches) {
  // T = L = 4: a 9-token document (10 positions) spans three batches: 4 + 4 + 2.
  const auto batches = validation_batches(make_split({{1, 2, 3, 4, 5, 6, 7, 8, 9}}), make_packer(4, 4), 10);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[0].targets, (Ids{1, 2, 3, 4}));
  EXPECT_EQ(batches[1].tokens, (Ids{4, 5, 6, 7}));
  EXPECT_EQ(batches[1].targets, (Ids{5, 6, 7, 8}));
  EXPECT_EQ(batches[2].tokens, (Ids{8, 9, P, P}));
  EXPECT_EQ(batches[2].targets, (Ids{9, E, X, X}));
  EXPECT_EQ(batches[2].cu_seqlens, (Ids{0, 2, 4}));
}

TEST(Packer, DropPolicySkipsAndCounts) {
  const Packer packer = make_packer(8, 4, LongDocPolicy::drop);
  const TokenizedSplit split = make_split({{1, 2}, {1, 2, 3, 4, 5, 6}, {3}});
  EXPECT_EQ(count_dropped_documents(split, packer), 1);
  const auto batches = validation_batches(split, packer, 10);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].tokens, (Ids{B, 1, 2, B, 3, P, P, P}));
  BatchStream stream(split, packer, 1);
  EXPECT_EQ(stream.dropped_documents(), 1);

  // Everything dropped: a training stream would spin forever, so it refuses.
  const TokenizedSplit all_long = make_split({{1, 2, 3, 4, 5}});
  try {
    BatchStream bad(all_long, packer, 1);
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no document to train on"), std::string::npos) << e.what();
  }
}

TEST(Packer, ErrorPolicyNamesTheDocument) {
  const Packer packer = make_packer(8, 4, LongDocPolicy::error);
  const TokenizedSplit split = make_split({{1}, {1, 2, 3, 4}}, {3, 17});
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      if (attempt == 0) {
        validation_batches(split, packer, 10);
      } else {
        BatchStream stream(split, packer, 1);  // fails at construction, not mid-run
      }
      FAIL() << "expected kiln::Error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("[data] document 17 has 4 tokens (5 positions", 0), 0u) << msg;
      EXPECT_NE(msg.find("model.max_seq_len 4"), std::string::npos) << msg;
      EXPECT_NE(msg.find("data.long_doc"), std::string::npos) << msg;
    }
  }
  EXPECT_EQ(packer.num_pieces(3, 0), 1);  // within L: fine under "error"
}

TEST(Packer, OptionErrors) {
  try {
    make_packer(128, 256);
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[train.micro_batch_tokens] must be at least model.max_seq_len (256)", 0), 0u)
        << e.what();
  }
  EXPECT_EQ(parse_long_doc_policy("split"), LongDocPolicy::split);
  EXPECT_EQ(parse_long_doc_policy("drop"), LongDocPolicy::drop);
  EXPECT_EQ(parse_long_doc_policy("error"), LongDocPolicy::error);
  try {
    parse_long_doc_policy("truncate");
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "[data.long_doc] unknown policy 'truncate' (known: split, drop, error)");
  }
}

TEST(Packer, OptionsFromConfig) {
  Config config;
  config.train.micro_batch_tokens = 512;
  config.model.max_seq_len = 128;
  config.data.long_doc = "drop";
  const PackerOptions o = packer_options(config, ByteTokenizer{});
  EXPECT_EQ(o.micro_batch_tokens, 512);
  EXPECT_EQ(o.max_seq_len, 128);
  EXPECT_EQ(o.long_doc, LongDocPolicy::drop);
  EXPECT_EQ(o.bos_id, 256);
  EXPECT_EQ(o.eos_id, 257);
  EXPECT_EQ(o.pad_id, 258);
}

}  // namespace
}  // namespace kiln
