// Weighted mixtures (data.sources): the schedule's exact proportions, reproducibility,
// exact resume (inside a document, with prefetching, at another world size, through the
// checkpoint's JSON), each source's own validation share, and the config's keys and
// named errors.
#include "config/config.h"
#include "config/config_fields.h"
#include "core/error.h"
#include "data/batch_stream.h"
#include "data/dataset.h"
#include "data/mixture.h"
#include "data/tokenizer.h"
#include "data_fixture.h"
#include "test_util.h"
#include "train/checkpoint_state.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <set>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using test::Ids;
using test::make_packer;

// Two sources in two formats: `a` text documents "A<i> ..." and `b` JSONL ones "B<i> ...".
struct MixtureFiles {
  std::string dir, a, b;
  explicit MixtureFiles(int a_docs = 60, int b_docs = 10, int words = 6) {
    dir = test::temp_dir("kiln-mixture");
    a = dir + "/a.txt";
    b = dir + "/b.jsonl";
    std::string text, jsonl;
    for (int i = 0; i < a_docs; ++i) text += "A" + std::to_string(i) + std::string(static_cast<size_t>(i * 7 % words + 1), 'a') + "\n\n";
    for (int i = 0; i < b_docs; ++i)
      jsonl += "{\"text\": \"B" + std::to_string(i) + std::string(static_cast<size_t>(i * 5 % words + 1), 'b') + "\"}\n";
    test::write_file(a, text);
    test::write_file(b, jsonl);
  }
  ~MixtureFiles() { fs::remove_all(dir); }
  DataConfig config(double wa, double wb, double val_fraction = 0.0) const {
    DataConfig c;
    c.path = "";
    c.val_fraction = val_fraction;
    c.sources = {DataSource{a, wa, "a"}, DataSource{b, wb, ""}};
    return c;
  }
};

// The documents of the stream's first batches, whole (no document is split: L is longer
// than any), as token lists without BOS, in the order drawn.
std::vector<Ids> drawn_documents(BatchStream& stream, size_t count) {
  std::vector<Ids> out;
  HostBatch b;
  while (out.size() < count) {
    stream.next(b);
    for (int64_t s = 0; s < b.num_seqs(); ++s) {
      const int32_t begin = b.cu_seqlens[s], end = b.cu_seqlens[s + 1];
      if (b.tokens[begin] == ByteTokenizer::kPad) continue;
      out.emplace_back(b.tokens.begin() + begin + 1, b.tokens.begin() + end);
    }
  }
  out.resize(count);
  return out;
}

TEST(MixtureSchedule, EveryPrefixIsWithinOneDocumentOfItsShareAndWindowsAreExact) {
  for (const std::vector<double>& weights :
       {std::vector<double>{4, 1}, std::vector<double>{3, 2, 1}, std::vector<double>{0.5, 0.3, 0.2},
        std::vector<double>{1, 1}, std::vector<double>{1, 100}}) {
    double total = 0;
    for (const double w : weights) total += w;
    std::vector<uint64_t> counts(weights.size(), 0);
    for (uint64_t k = 0; k < 2000; ++k) {
      ++counts[mixture_pick(weights, k, counts)];
      for (size_t s = 0; s < weights.size(); ++s) {
        const double share = static_cast<double>(k + 1) * weights[s] / total;
        EXPECT_LT(std::abs(static_cast<double>(counts[s]) - share), 1.0) << "draw " << k << " source " << s;
        // Integer weights: exact after every whole window of sum(weights) draws.
        if (weights[0] == std::floor(weights[0]) && (k + 1) % static_cast<uint64_t>(total) == 0)
          EXPECT_EQ(static_cast<double>(counts[s]), share) << "draw " << k << " source " << s;
      }
    }
  }
  // 4:1 is s0 s0 s1 s0 s0, repeated; passed-over sources are skipped.
  std::vector<uint64_t> counts(2, 0);
  std::string order;
  for (uint64_t k = 0; k < 10; ++k) {
    const size_t s = mixture_pick(std::vector<double>{4, 1}, k, counts);
    ++counts[s];
    order += static_cast<char>('0' + s);
  }
  EXPECT_EQ(order, "0010000100");
  const bool only_second[] = {false, true};
  EXPECT_EQ(mixture_pick(std::vector<double>{4, 1}, 0, std::vector<uint64_t>{0, 0}, only_second), 1u);
}

TEST(Mixture, TheStreamDrawsDocumentsFourToOneAndASmallSourceRestartsItsEpochs) {
  const MixtureFiles files(60, 10);
  const TokenDataset ds(files.config(4, 1), ByteTokenizer{});
  const TokenizedSplit& train = ds.split(Split::train);
  ASSERT_EQ(train.sources().size(), 2u);
  EXPECT_EQ(train.sources()[0].count, 60);
  EXPECT_EQ(train.sources()[1].count, 10);
  EXPECT_EQ(train.sources()[1].name, "b.jsonl");  // no name: the path's last part
  BatchStream stream(train, make_packer(256, 128), 7);
  const std::vector<Ids> docs = drawn_documents(stream, 500);
  int64_t a = 0, b = 0;
  std::vector<std::set<Ids>> b_epochs(1);
  for (size_t i = 0; i < docs.size(); ++i) {
    (docs[i][0] == 'A' ? a : b) += 1;
    if ((i + 1) % 5 == 0) {  // every window of 5 documents: exactly 4 from a, 1 from b
      EXPECT_EQ(a, 4 * static_cast<int64_t>(i + 1) / 5) << "after " << i + 1;
      EXPECT_EQ(b, static_cast<int64_t>(i + 1) / 5) << "after " << i + 1;
    }
    if (docs[i][0] == 'B') {
      if (b_epochs.back().size() == 10) b_epochs.emplace_back();
      EXPECT_TRUE(b_epochs.back().insert(docs[i]).second) << "a b document twice in one of its epochs";
    }
  }
  EXPECT_EQ(b, 100);  // b (10 documents) ran 10 epochs while a ran 400 / 60
  EXPECT_EQ(b_epochs.size(), 10u);
  EXPECT_GE(stream.epoch(), 9u);  // the most epochs any source completed
  // Reproducible from the seed; another seed another order.
  BatchStream again(train, make_packer(256, 128), 7);
  EXPECT_EQ(drawn_documents(again, 500), docs);
  BatchStream other(train, make_packer(256, 128), 8);
  EXPECT_NE(drawn_documents(other, 500), docs);
}

TEST(Mixture, StateRestoresTheExactSameBatchesAndSurvivesTheCheckpointJson) {
  const MixtureFiles files(30, 8, 60);  // documents up to ~64 bytes
  const TokenDataset ds(files.config(3, 2), ByteTokenizer{});
  const Packer packer = make_packer(48, 16);  // many split pieces: states inside a document
  BatchStream reference(ds, Split::train, packer, 11);
  HostBatch batch;
  int mid_document = 0;
  for (int step = 0; step < 80; ++step) {
    const StreamState saved = reference.get_state();
    ASSERT_EQ(saved.sources.size(), 2u);
    EXPECT_EQ(saved.sources[0].draws + saved.sources[1].draws, saved.next_document);
    mid_document += saved.next_piece > 0;
    CheckpointState checkpoint;
    checkpoint.stream = saved;
    const StreamState reread = state_from_json(state_to_json(checkpoint), "state.json").stream;
    EXPECT_EQ(reread, saved);
    std::vector<HostBatch> expected(5);
    for (auto& b : expected) reference.next(b);
    BatchStream resumed(ds, Split::train, packer, 11);  // a fresh process, in effect
    resumed.set_state(reread);
    EXPECT_EQ(resumed.get_state(), saved);
    for (const auto& e : expected) {
      resumed.next(batch);
      ASSERT_EQ(batch.tokens, e.tokens) << "step " << step;
      ASSERT_EQ(batch.targets, e.targets);
      ASSERT_EQ(batch.cu_seqlens, e.cu_seqlens);
    }
    EXPECT_EQ(resumed.get_state(), reference.get_state());
    reference.set_state(saved);
    reference.next(batch);
  }
  EXPECT_GT(mid_document, 5);
  EXPECT_GE(reference.get_state().sources[1].epoch, 1u);  // across a source's epoch boundary
  // Another seed or other weights make another stream: its state is refused.
  BatchStream other_seed(ds, Split::train, packer, 12);
  EXPECT_THROW(other_seed.set_state(reference.get_state()), Error);
  const TokenDataset reweighted(files.config(1, 1), ByteTokenizer{});
  BatchStream other_weights(reweighted, Split::train, packer, 11);
  EXPECT_THROW(other_weights.set_state(reference.get_state()), Error);
}

TEST(Mixture, ResumesWithPrefetchingAndAtAnotherWorldSize) {
  const MixtureFiles files(30, 8, 60);
  const TokenDataset ds(files.config(4, 1), ByteTokenizer{});
  const Packer packer = make_packer(48, 16);
  BatchStream global(ds, Split::train, packer, 5);
  std::vector<HostBatch> all(80);
  std::vector<StreamState> states;
  for (auto& b : all) {
    states.push_back(global.get_state());
    global.next(b);
  }
  // World 2, rank 1, prefetching 3: 7 batches (14 global), then a fresh world of 4.
  BatchStream two(ds, Split::train, packer, 5, LoaderOptions{1, 2, 3});
  HostBatch b;
  for (int i = 0; i < 7; ++i) {
    two.next(b);
    ASSERT_EQ(b.tokens, all[static_cast<size_t>(2 * i + 1)].tokens) << "rank 1 batch " << i;
  }
  const StreamState saved = two.get_state();
  EXPECT_EQ(saved, states[14]);
  BatchStream four(ds, Split::train, packer, 5, LoaderOptions{2, 4, 2});
  four.set_state(saved);
  for (int i = 0; i < 5; ++i) {
    four.next(b);
    ASSERT_EQ(b.tokens, all[static_cast<size_t>(14 + 4 * i + 2)].tokens) << "world 4 batch " << i;
  }
}

TEST(Mixture, EachSourceHoldsOutItsOwnShareAndValidationIsTheirUnion) {
  const MixtureFiles files(200, 100);
  const DataConfig config = files.config(4, 1, 0.2);
  const TokenDataset ds(config, ByteTokenizer{});
  std::multiset<Ids> expected_val, expected_train;
  for (const DataSource& s : config.sources) {
    DataConfig one = config;
    one.sources.clear();
    one.path = s.path;
    const TokenDataset part(one, ByteTokenizer{});
    for (const Ids& d : test::documents_of(part.split(Split::validation))) expected_val.insert(d);
    for (const Ids& d : test::documents_of(part.split(Split::train))) expected_train.insert(d);
  }
  const std::vector<Ids> val = test::documents_of(ds.split(Split::validation));
  EXPECT_EQ(std::multiset<Ids>(val.begin(), val.end()), expected_val);
  const std::vector<Ids> train = test::documents_of(ds.split(Split::train));
  EXPECT_EQ(std::multiset<Ids>(train.begin(), train.end()), expected_train);
  for (const Ids& d : val) EXPECT_TRUE(is_validation_document(std::string(d.begin(), d.end()), 0.2));
  // Validation batches: each source packed apart, the batches interleaved 4:1, so a cap
  // (train.eval_batches) still sees both sources; each batch's source is given.
  std::vector<int32_t> sources;
  const std::vector<HostBatch> batches = validation_batches(ds, make_packer(32, 16), 10, &sources);
  ASSERT_EQ(batches.size(), 10u);
  EXPECT_EQ(sources, (std::vector<int32_t>{0, 0, 1, 0, 0, 0, 0, 1, 0, 0}));
  for (size_t i = 0; i < batches.size(); ++i) {
    const HostBatch& b = batches[i];
    for (int64_t q = 0; q < b.num_seqs(); ++q) {
      const int32_t first = b.tokens[b.cu_seqlens[q]];
      if (first == ByteTokenizer::kPad) continue;
      const int32_t letter = first == ByteTokenizer::kBos ? b.tokens[b.cu_seqlens[q] + 1] : 'x';
      if (letter != 'x') EXPECT_EQ(letter, sources[i] == 0 ? 'A' : 'B') << "batch " << i;
    }
  }
  // Without a cap: every batch of every source, each tagged.
  const size_t all = validation_batches(ds, make_packer(32, 16), 1000, &sources).size();
  EXPECT_EQ(all, sources.size());
  EXPECT_GT(all, 10u);
}

TEST(Mixture, AFailingSourceIsNamed) {
  MixtureFiles files;
  DataConfig config = files.config(4, 1);
  config.sources[1].path = files.dir + "/missing.jsonl";
  try {
    const TokenDataset ds(config, ByteTokenizer{});
    FAIL() << "a missing source was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("(data.sources[1], 'missing.jsonl')"), std::string::npos) << e.what();
  }
}

// ---- config ------------------------------------------------------------------------

std::string load_error(const std::string& toml, const std::vector<std::string>& overrides = {}) {
  const std::string dir = test::temp_dir("kiln-mixture-config");
  test::write_file(dir + "/run.toml", toml);
  std::string error;
  try {
    load_config(dir + "/run.toml", overrides);
  } catch (const Error& e) {
    error = e.what();
  }
  fs::remove_all(dir);
  return error;
}

const char* kTwoSources = R"([data]
val_fraction = 0.1

[[data.sources]]
path = "corpora/a.txt"
weight = 4
name = "edu"

[[data.sources]]
path = "/abs/b.jsonl"
weight = 1.5
)";

TEST(MixtureConfig, SourcesLoadRelativeToTheFileAndRoundTripThroughTheWrittenToml) {
  const std::string dir = test::temp_dir("kiln-mixture-config");
  test::write_file(dir + "/run.toml", kTwoSources);
  const Config c = load_config(dir + "/run.toml");
  EXPECT_EQ(c.data.path, "");  // the default gives way to the sources
  ASSERT_EQ(c.data.sources.size(), 2u);
  EXPECT_EQ(c.data.sources[0], (DataSource{dir + "/corpora/a.txt", 4.0, "edu"}));
  EXPECT_EQ(c.data.sources[1], (DataSource{"/abs/b.jsonl", 1.5, ""}));
  const std::string written = config_to_toml(c);
  EXPECT_NE(written.find("[[data.sources]]\npath = \"" + dir + "/corpora/a.txt\""), std::string::npos) << written;
  test::write_file(dir + "/resolved.toml", written);
  const Config back = load_config(dir + "/resolved.toml");
  EXPECT_TRUE(config_equal(back, c));
  EXPECT_EQ(config_to_toml(back), written);
  // No sources: a commented example, as configs/default.toml has it.
  EXPECT_NE(config_to_toml(Config{}).find("# [[data.sources]]"), std::string::npos);
  EXPECT_NE(test::read_file(KILN_SOURCE_DIR "/configs/default.toml").find("# [[data.sources]]"), std::string::npos);
  fs::remove_all(dir);
}

TEST(MixtureConfig, BadSourcesAreRefusedNamingTheKey) {
  const std::string two(kTwoSources);
  const auto replaced = [&](const std::string& from, const std::string& to) {
    std::string s = two;
    s.replace(s.find(from), from.size(), to);
    return s;
  };
  EXPECT_NE(load_error(replaced("weight = 1.5", "weight = -1")).find("data.sources[1].weight must be > 0, got -1"),
            std::string::npos);
  EXPECT_NE(load_error(replaced("weight = 1.5", "weight = 0")).find("data.sources[1].weight must be > 0, got 0"),
            std::string::npos);
  EXPECT_NE(load_error(replaced("weight = 1.5\n", "")).find("data.sources[1].weight is missing"), std::string::npos);
  EXPECT_NE(load_error(replaced("path = \"/abs/b.jsonl\"\n", "")).find("data.sources[1].path is missing"),
            std::string::npos);
  EXPECT_NE(load_error(replaced("path = \"/abs/b.jsonl\"", "path = \"\"")).find("data.sources[1].path must not be empty"),
            std::string::npos);
  EXPECT_NE(load_error(replaced("weight = 4", "wieght = 4")).find("unknown key 'data.sources[0].wieght'"),
            std::string::npos);
  EXPECT_NE(load_error(replaced("weight = 4", "weight = \"4\"")).find("'data.sources[0].weight' must be a number"),
            std::string::npos);
  const std::string both = "data.path ('";
  EXPECT_NE(load_error(replaced("val_fraction = 0.1", "path = \"x.txt\"")).find(both), std::string::npos);
  EXPECT_NE(load_error(two, {"data.path=x.txt"}).find("and data.sources are mutually exclusive"), std::string::npos);
  EXPECT_NE(load_error(two, {"data.val_path=v.txt"}).find("data.val_path ('"), std::string::npos);
  EXPECT_NE(load_error("[data]\nsources = 3\n").find("'data.sources' must be an array of tables"), std::string::npos);
  EXPECT_NE(load_error(two, {"data.sources=a"}).find("--set cannot give data.sources"), std::string::npos);
}

}  // namespace
}  // namespace kiln
