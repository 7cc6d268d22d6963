// TokenDataset and BatchStream: deterministic split, per-epoch shuffles, exact resume,
// buffer reuse, and the default corpus loaded with default settings.
#include "data/batch_stream.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "data_fixture.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

namespace kiln {
namespace {

using test::Ids;
using test::corpus_jsonl;
using test::documents_of;
using test::expect_same_batches;
using test::make_packer;
using test::synthetic_documents;

// The document sequences of a batch, as their token lists (BOS stripped), in order.
// Only valid when no document is split (every sequence starts with BOS).
std::vector<Ids> sequences_of(const HostBatch& b) {
  std::vector<Ids> out;
  for (int64_t s = 0; s < b.num_seqs(); ++s) {
    const int32_t begin = b.cu_seqlens[s], end = b.cu_seqlens[s + 1];
    if (b.tokens[begin] == ByteTokenizer::kPad) continue;
    EXPECT_EQ(b.tokens[begin], ByteTokenizer::kBos);
    EXPECT_EQ(b.targets[end - 1], ByteTokenizer::kEos);
    out.emplace_back(b.tokens.begin() + begin + 1, b.tokens.begin() + end);
  }
  return out;
}

std::vector<Ids> all_documents(const TokenizedSplit& split) {
  std::vector<Ids> out;
  for (int64_t i = 0; i < split.num_documents(); ++i) out.emplace_back(split.document(i).begin(), split.document(i).end());
  return out;
}

TEST(Dataset, SplitIsDeterministicDisjointAndByHash) {
  std::vector<Document> docs = synthetic_documents(400, 40, 5);
  docs.push_back(Document{400, docs[10].text});  // a duplicate must follow its twin
  const ByteTokenizer tok;
  const TokenDataset a(docs, 0.2, tok);
  const TokenDataset b(docs, 0.2, tok);
  const TokenizedSplit& train = a.split(Split::train);
  const TokenizedSplit& val = a.split(Split::validation);
  EXPECT_EQ(train.num_documents() + val.num_documents(), 401);
  EXPECT_GT(val.num_documents(), 40);  // ~20% of 401
  EXPECT_LT(val.num_documents(), 130);
  EXPECT_EQ(train.fingerprint(), b.split(Split::train).fingerprint());
  EXPECT_EQ(val.fingerprint(), b.split(Split::validation).fingerprint());
  EXPECT_NE(train.fingerprint(), val.fingerprint());

  std::set<uint64_t> train_ids, val_ids;
  for (int64_t i = 0; i < train.num_documents(); ++i) train_ids.insert(train.document_id(i));
  for (int64_t i = 0; i < val.num_documents(); ++i) val_ids.insert(val.document_id(i));
  EXPECT_EQ(train_ids.size() + val_ids.size(), 401u);  // disjoint and complete
  for (const Document& d : docs) {
    const bool in_val = val_ids.count(d.id) > 0;
    EXPECT_EQ(in_val, is_validation_document(d.text, 0.2)) << d.id;
    EXPECT_NE(in_val, train_ids.count(d.id) > 0) << d.id;
  }
  EXPECT_EQ(val_ids.count(10), val_ids.count(400));
  // Tokens are the tokenizer's, in file order within each split.
  for (int64_t i = 0; i < train.num_documents(); ++i) {
    const auto doc = train.document(i);
    EXPECT_EQ(Ids(doc.begin(), doc.end()), tok.encode(docs[train.document_id(i)].text));
    if (i > 0) {
      EXPECT_LT(train.document_id(i - 1), train.document_id(i));
    }
  }
  int64_t tokens = 0;
  for (const Document& d : docs) tokens += static_cast<int64_t>(d.text.size());
  EXPECT_EQ(a.num_tokens(Split::train) + a.num_tokens(Split::validation), tokens);
}

TEST(Dataset, HashIsFnv1a) {
  // Reference values of 64-bit FNV-1a.
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171f73967e8ull);
  EXPECT_FALSE(is_validation_document("anything", 0.0));
}

TEST(Dataset, EmptySplitsAreErrors) {
  const ByteTokenizer tok;
  std::vector<Document> one = {Document{0, "to be or not to be"}};
  ASSERT_FALSE(is_validation_document(one[0].text, 0.05));  // precondition of this test
  try {
    TokenDataset d(one, 0.05, tok, "'tiny.txt'");
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[data] 'tiny.txt': too few documents (1) for a validation split", 0), 0u)
        << e.what();
  }
  const TokenDataset no_val(one, 0.0, tok);
  EXPECT_EQ(no_val.num_documents(Split::validation), 0);
  EXPECT_TRUE(validation_batches(no_val, make_packer(64, 32), 8).empty());
  EXPECT_THROW(TokenDataset(one, 1.0, tok), Error);
}

TEST(Dataset, BuildsFromConfigFile) {
  const std::string dir = test::temp_dir("kiln-data");
  std::string jsonl;
  for (const Document& d : synthetic_documents(200, 30, 9)) jsonl += "{\"text\": \"" + d.text + "\"}\n";
  test::write_file(dir + "/c.jsonl", jsonl);
  DataConfig config;
  config.path = dir + "/c.jsonl";
  config.val_fraction = 0.1;
  const TokenDataset ds(config, ByteTokenizer{});
  EXPECT_EQ(ds.num_documents(Split::train) + ds.num_documents(Split::validation), 200);
  EXPECT_GT(ds.num_documents(Split::validation), 0);
  std::filesystem::remove_all(dir);
}

TEST(BatchStream, EachEpochIsADeterministicPermutation) {
  const TokenDataset ds(synthetic_documents(60, 30, 3), 0.0, ByteTokenizer{});
  const TokenizedSplit& train = ds.split(Split::train);
  const int64_t n = train.num_documents();
  // L = 64 > any document: nothing is split, so every sequence is one whole document.
  auto first_sequences = [&](uint64_t seed, int64_t count) {
    BatchStream stream(train, make_packer(128, 64), seed);
    std::vector<Ids> seqs;
    HostBatch batch;
    while (static_cast<int64_t>(seqs.size()) < count) {
      stream.next(batch);
      for (auto& s : sequences_of(batch)) seqs.push_back(std::move(s));
    }
    seqs.resize(static_cast<size_t>(count));
    return seqs;
  };
  const std::vector<Ids> run = first_sequences(42, 3 * n);
  std::vector<Ids> sorted_docs = all_documents(train);
  std::sort(sorted_docs.begin(), sorted_docs.end());
  std::vector<std::vector<Ids>> epochs;
  for (int64_t e = 0; e < 3; ++e) {
    epochs.emplace_back(run.begin() + e * n, run.begin() + (e + 1) * n);
    std::vector<Ids> sorted = epochs.back();
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, sorted_docs) << "epoch " << e << " is not a permutation of the documents";
  }
  EXPECT_NE(epochs[0], all_documents(train));  // shuffled, not file order
  EXPECT_NE(epochs[0], epochs[1]);             // reshuffled each epoch
  EXPECT_NE(epochs[1], epochs[2]);
  EXPECT_EQ(first_sequences(42, 3 * n), run);  // same seed, same stream
  EXPECT_NE(first_sequences(43, n), std::vector<Ids>(run.begin(), run.begin() + n));
}

TEST(BatchStream, EpochCounterAdvances) {
  const TokenDataset ds(synthetic_documents(10, 20, 4), 0.0, ByteTokenizer{});
  BatchStream stream(ds, Split::train, make_packer(64, 32), 1);
  HostBatch batch;
  EXPECT_EQ(stream.epoch(), 0u);
  for (int i = 0; i < 20; ++i) stream.next(batch);  // 10 short documents: several epochs
  EXPECT_GE(stream.epoch(), 1u);
  EXPECT_LT(stream.epoch_progress(), 1.0 + 1e-12);
}

TEST(BatchStream, StateRestoresTheExactSameBatches) {
  const TokenDataset ds(synthetic_documents(20, 90, 8), 0.0, ByteTokenizer{});
  const Packer packer = make_packer(48, 16);  // documents up to 90 bytes: many split pieces
  BatchStream reference(ds, Split::train, packer, 7);
  HostBatch batch;
  int mid_document_states = 0;
  for (int step = 0; step < 60; ++step) {
    const StreamState saved = reference.get_state();
    mid_document_states += saved.next_piece > 0;
    std::vector<HostBatch> expected(6);
    for (auto& b : expected) reference.next(b);

    BatchStream resumed(ds, Split::train, packer, 7);  // a fresh process, in effect
    resumed.set_state(saved);
    EXPECT_EQ(resumed.get_state(), saved);
    for (const auto& e : expected) {
      resumed.next(batch);
      ASSERT_EQ(batch.tokens, e.tokens) << "step " << step;
      ASSERT_EQ(batch.targets, e.targets);
      ASSERT_EQ(batch.positions, e.positions);
      ASSERT_EQ(batch.cu_seqlens, e.cu_seqlens);
      ASSERT_EQ(batch.max_seqlen, e.max_seqlen);
      ASSERT_EQ(batch.target_count, e.target_count);
    }
    EXPECT_EQ(resumed.get_state(), reference.get_state());
    // Rewind the reference to `saved` + 1 batch, so the loop walks through the stream.
    reference.set_state(saved);
    reference.next(batch);
  }
  EXPECT_GT(mid_document_states, 5);  // resume inside a split document was exercised
  EXPECT_GE(reference.epoch(), 1u);   // and across an epoch boundary
}

// The starts of the pieces each long document is cut into, per epoch, read back from the
// stream: a document's pieces come one after another (across batches too), its first
// input is BOS and its last target EOS, and its inputs together are BOS + its tokens.
std::vector<std::map<int64_t, std::vector<int64_t>>> cuts_per_epoch(const TokenizedSplit& split, BatchStream& stream,
                                                                    int epochs) {
  std::vector<std::map<int64_t, std::vector<int64_t>>> cuts(static_cast<size_t>(epochs));
  Ids inputs;
  std::vector<int64_t> starts;
  HostBatch b;
  while (stream.get_state().epoch < static_cast<uint64_t>(epochs)) {
    const auto epoch = static_cast<size_t>(stream.get_state().epoch);
    stream.next(b);
    for (int64_t s = 0; s < b.num_seqs(); ++s) {
      const int32_t begin = b.cu_seqlens[s], end = b.cu_seqlens[s + 1];
      if (b.tokens[begin] == ByteTokenizer::kPad) continue;
      starts.push_back(static_cast<int64_t>(inputs.size()));
      inputs.insert(inputs.end(), b.tokens.begin() + begin, b.tokens.begin() + end);
      if (b.targets[end - 1] != ByteTokenizer::kEos) continue;  // the document goes on
      for (int64_t d = 0; d < split.num_documents(); ++d) {
        const TokenSpan t = split.document(d);
        if (inputs.size() != t.size() + 1 || !std::equal(t.begin(), t.end(), inputs.begin() + 1)) continue;
        if (starts.size() > 1) cuts[epoch][d] = starts;
        break;
      }
      inputs.clear();
      starts.clear();
    }
  }
  return cuts;
}

// data.long_doc_offset = per_epoch: epoch 0 cuts long documents at multiples of L, each
// later epoch at a fresh offset per document (differing between epochs), every piece at
// most L; the cuts come back exactly on resume; "zero" keeps multiples of L throughout.
TEST(BatchStream, LongDocumentsAreCutAtAFreshOffsetEachEpochAfterTheFirst) {
  const TokenDataset ds(synthetic_documents(12, 90, 3), 0.0, ByteTokenizer{});
  const TokenizedSplit& split = ds.split(Split::train);
  BatchStream stream(ds, Split::train, make_packer(48, 16), 7);
  const auto cuts = cuts_per_epoch(split, stream, 4);
  ASSERT_FALSE(cuts[0].empty());
  for (const auto& [doc, starts] : cuts[0])
    for (size_t i = 0; i < starts.size(); ++i) EXPECT_EQ(starts[i], 16 * static_cast<int64_t>(i)) << doc;
  int moved = 0, differing = 0;
  for (size_t e = 1; e < cuts.size(); ++e) {
    ASSERT_EQ(cuts[e].size(), cuts[0].size());
    for (const auto& [doc, starts] : cuts[e]) {
      ASSERT_GE(starts.size(), 2u);
      const int64_t offset = starts[1];  // the head piece's length, or L when not offset
      moved += offset != 16;
      for (size_t i = 2; i < starts.size(); ++i) EXPECT_EQ(starts[i] - starts[i - 1], 16) << doc;
      if (e >= 2) differing += cuts[e].at(doc) != cuts[e - 1].at(doc);
    }
  }
  const int long_docs = static_cast<int>(cuts[0].size());
  EXPECT_GT(moved, 3 * long_docs / 2);     // most of epochs 1-3's cuts moved (an offset of 0 is 1 in 16)
  EXPECT_GT(differing, long_docs);         // and they differ from epoch to epoch
  // Resumed in epoch 2, inside a document: the same batches.
  BatchStream reference(ds, Split::train, make_packer(48, 16), 7);
  HostBatch b;
  while (reference.get_state().epoch < 2 || reference.get_state().next_piece == 0) reference.next(b);
  BatchStream resumed(ds, Split::train, make_packer(48, 16), 7);
  resumed.set_state(reference.get_state());
  expect_same_batches(reference, resumed, 40);
  // "zero": multiples of L in every epoch.
  PackerOptions zero = make_packer(48, 16).options();
  zero.offset_per_epoch = false;
  BatchStream fixed(ds, Split::train, Packer(zero), 7);
  for (const auto& epoch : cuts_per_epoch(split, fixed, 3))
    for (const auto& [doc, starts] : epoch)
      for (size_t i = 0; i < starts.size(); ++i) EXPECT_EQ(starts[i], 16 * static_cast<int64_t>(i)) << doc;
  // The choice is part of the packing a saved position names.
  EXPECT_NE(test::error_of([&] { fixed.set_state(reference.get_state()); }).find("packing"), std::string::npos);
}

TEST(BatchStream, StateFromOtherDataOrSeedIsRejected) {
  const TokenDataset ds(synthetic_documents(20, 30, 1), 0.0, ByteTokenizer{});
  BatchStream a(ds, Split::train, make_packer(64, 32), 1);
  BatchStream other_seed(ds, Split::train, make_packer(64, 32), 2);
  BatchStream other_packing(ds, Split::train, make_packer(64, 16), 1);
  EXPECT_THROW(other_seed.set_state(a.get_state()), Error);
  EXPECT_THROW(other_packing.set_state(a.get_state()), Error);
  StreamState past = a.get_state();
  past.next_document = 21;
  EXPECT_THROW(a.set_state(past), Error);
}

TEST(BatchStream, ReusesBuffersAfterTheFirstBatch) {
  const TokenDataset ds(synthetic_documents(100, 200, 2), 0.0, ByteTokenizer{});
  BatchStream stream(ds, Split::train, make_packer(256, 64), 3);
  HostBatch batch;
  stream.next(batch);
  EXPECT_GE(batch.tokens.capacity(), 256u);
  EXPECT_GE(batch.cu_seqlens.capacity(), 257u);
  const int32_t* tokens = batch.tokens.data();
  const int32_t* targets = batch.targets.data();
  const int32_t* positions = batch.positions.data();
  const int32_t* cu = batch.cu_seqlens.data();
  for (int i = 0; i < 50; ++i) {
    stream.next(batch);
    ASSERT_EQ(batch.tokens.data(), tokens);
    ASSERT_EQ(batch.targets.data(), targets);
    ASSERT_EQ(batch.positions.data(), positions);
    ASSERT_EQ(batch.cu_seqlens.data(), cu);
    ASSERT_EQ(batch.size(), 256);
    ASSERT_EQ(batch.cu_seqlens.back(), 256);
  }
}

TEST(Validation, FixedFileOrderBatches) {
  const TokenDataset ds(synthetic_documents(300, 30, 6), 0.3, ByteTokenizer{});
  const TokenizedSplit& val = ds.split(Split::validation);
  const Packer packer = make_packer(64, 32);
  const auto all = validation_batches(ds, packer, 1'000'000);
  ASSERT_GT(all.size(), 3u);
  std::vector<Ids> seqs;
  for (const auto& b : all) {
    EXPECT_EQ(b.size(), 64);
    for (auto& s : sequences_of(b)) seqs.push_back(std::move(s));
  }
  EXPECT_EQ(seqs, all_documents(val));  // every document once, in file order
  const auto first3 = validation_batches(ds, packer, 3);
  ASSERT_EQ(first3.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(first3[i].tokens, all[i].tokens);
  EXPECT_EQ(validation_batches(ds, packer, 3)[2].targets, first3[2].targets);  // same every call
  EXPECT_TRUE(validation_batches(ds, packer, 0).empty());
}

TEST(DefaultCorpus, TinyShakespeareWithDefaults) {
  DataConfig config;  // defaults: "\n\n" separator, val_fraction 0.05, seed 1234
  config.path = std::string(KILN_SOURCE_DIR) + "/" + config.path;
  const auto tok = make_tokenizer("byte");
  const TokenDataset ds(config, *tok);
  const int64_t train = ds.num_documents(Split::train), val = ds.num_documents(Split::validation);
  EXPECT_EQ(train + val, 7222);  // speeches separated by blank lines
  EXPECT_GT(val, 7222 * 3 / 100);
  EXPECT_LT(val, 7222 * 7 / 100);
  EXPECT_EQ(ds.num_tokens(Split::train) + ds.num_tokens(Split::validation), 1100952);  // bytes minus separators
  for (const Split s : {Split::train, Split::validation}) {
    const TokenizedSplit& split = ds.split(s);
    for (int64_t i = 0; i < split.num_documents(); ++i) {
      for (const int32_t t : split.document(i)) ASSERT_TRUE(t >= 0 && t < 256) << split_name(s);
    }
  }

  Config run;  // default packing: T = 4096, L = 256, long_doc = split
  const Packer packer(packer_options(run, *tok));
  BatchStream stream(ds, Split::train, packer, config.seed);
  EXPECT_EQ(stream.dropped_documents(), 0);
  HostBatch batch;
  for (int i = 0; i < 20; ++i) {
    stream.next(batch);
    ASSERT_EQ(batch.size(), 4096);
    EXPECT_LE(batch.max_seqlen, 256);
    EXPECT_GT(batch.document_tokens, 4096 - 256);  // greedy packing wastes < L per batch
    for (const int32_t t : batch.tokens) ASSERT_LT(t, tok->vocab_size());
    for (const int32_t t : batch.targets) ASSERT_LT(t, tok->vocab_size());
  }
  const auto val_batches = validation_batches(ds, packer, run.train.eval_batches);
  EXPECT_EQ(static_cast<int64_t>(val_batches.size()), run.train.eval_batches);
}

}  // namespace
}  // namespace kiln
