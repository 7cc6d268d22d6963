// The loader: prefetching changes nothing but timing (same batches, and get_state is the
// consumer's position), resume is bitwise with prefetching and rank sharding, ranks get
// disjoint micro-batches whose union is the single-process stream.
#include "data/batch_stream.h"
#include "data/dataset.h"
#include "data/prefetch.h"
#include "data/tokenizer.h"
#include "data_fixture.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <thread>

namespace kiln {
namespace {

using test::make_packer;
using test::synthetic_documents;

LoaderOptions opts(int64_t rank, int64_t world, int64_t prefetch) { return LoaderOptions{rank, world, prefetch}; }

void expect_equal(const HostBatch& a, const HostBatch& b, const std::string& what) {
  ASSERT_EQ(a.tokens, b.tokens) << what;
  ASSERT_EQ(a.targets, b.targets) << what;
  ASSERT_EQ(a.positions, b.positions) << what;
  ASSERT_EQ(a.cu_seqlens, b.cu_seqlens) << what;
  ASSERT_EQ(a.max_seqlen, b.max_seqlen) << what;
  ASSERT_EQ(a.target_count, b.target_count) << what;
  ASSERT_EQ(a.document_tokens, b.document_tokens) << what;
}

// The first `n` batches of a stream, and the state before each.
struct Recorded {
  std::vector<HostBatch> batches;
  std::vector<StreamState> states;
};
Recorded take(BatchStream& s, int n) {
  Recorded r;
  for (int i = 0; i < n; ++i) {
    r.states.push_back(s.get_state());
    r.batches.emplace_back();
    s.next(r.batches.back());
  }
  return r;
}

class LoaderTest : public ::testing::Test {
 protected:
  // Documents up to 90 bytes with L = 16: many split pieces, resume inside documents.
  LoaderTest() : ds_(synthetic_documents(40, 90, 8), 0.0, ByteTokenizer{}), packer_(make_packer(48, 16)) {}
  TokenDataset ds_;
  Packer packer_;
};

TEST_F(LoaderTest, PrefetchingYieldsTheSynchronousBatchesAndConsumerStates) {
  BatchStream sync(ds_, Split::train, packer_, 7);
  const Recorded expected = take(sync, 80);
  for (const int64_t depth : {1, 3, 8}) {
    BatchStream pre(ds_, Split::train, packer_, 7, opts(0, 1, depth));
    HostBatch b;
    for (int i = 0; i < 80; ++i) {
      // The producer runs ahead; the state is still that of the batch the consumer gets next.
      if (i % 7 == 3) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      ASSERT_EQ(pre.get_state(), expected.states[static_cast<size_t>(i)]) << "depth " << depth << " batch " << i;
      pre.next(b);
      expect_equal(b, expected.batches[static_cast<size_t>(i)], "prefetched batch " + std::to_string(i));
    }
    EXPECT_EQ(pre.get_state(), sync.get_state());
  }
}

TEST_F(LoaderTest, ResumeWithPrefetchIsBitwise) {
  BatchStream reference(ds_, Split::train, packer_, 11);
  const Recorded all = take(reference, 60);
  int mid_document = 0;
  for (int k = 0; k < 52; k += 3) {
    // A run that prefetches, saves its state after k batches (mid-flight: the producer
    // is ahead), and a fresh process that restores it.
    BatchStream first(ds_, Split::train, packer_, 11, opts(0, 1, 4));
    HostBatch b;
    for (int i = 0; i < k; ++i) first.next(b);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // let it fill the queue
    const StreamState saved = first.get_state();
    ASSERT_EQ(saved, all.states[static_cast<size_t>(k)]) << k;
    mid_document += saved.next_piece > 0;
    BatchStream resumed(ds_, Split::train, packer_, 11, opts(0, 1, 4));
    resumed.set_state(saved);
    for (int i = k; i < k + 8; ++i) {
      resumed.next(b);
      expect_equal(b, all.batches[static_cast<size_t>(i)], "resumed at " + std::to_string(k));
    }
    // set_state on a running prefetcher discards what it had packed.
    first.set_state(all.states[2]);
    first.next(b);
    expect_equal(b, all.batches[2], "rewound");
  }
  EXPECT_GT(mid_document, 2);
  EXPECT_GE(all.states.back().epoch, 1u);
}

TEST_F(LoaderTest, RanksGetDisjointInterleavedBatchesAndShareTheirState) {
  BatchStream global(ds_, Split::train, packer_, 3);
  const Recorded all = take(global, 60);
  const int64_t world = 3;
  std::vector<BatchStream*> ranks;
  std::vector<std::unique_ptr<BatchStream>> owned;
  for (int64_t r = 0; r < world; ++r)
    owned.push_back(std::make_unique<BatchStream>(ds_, Split::train, packer_, 3, opts(r, world, r == 1 ? 2 : 0)));
  HostBatch b;
  for (int round = 0; round < 20; ++round) {
    for (int64_t r = 0; r < world; ++r) {
      // Every rank reports the same state: the start of this round in the global stream.
      ASSERT_EQ(owned[static_cast<size_t>(r)]->get_state(), all.states[static_cast<size_t>(round * world)]);
      owned[static_cast<size_t>(r)]->next(b);
      expect_equal(b, all.batches[static_cast<size_t>(round * world + r)],
                   "rank " + std::to_string(r) + " round " + std::to_string(round));
    }
  }
}

TEST_F(LoaderTest, ResumeWithRankShardingIsBitwiseAndWorksForAnotherWorldSize) {
  BatchStream global(ds_, Split::train, packer_, 5);
  const Recorded all = take(global, 80);
  // World 2, rank 1, prefetching: save after 7 batches (14 global), resume.
  BatchStream a(ds_, Split::train, packer_, 5, opts(1, 2, 3));
  HostBatch b;
  for (int i = 0; i < 7; ++i) a.next(b);
  const StreamState saved = a.get_state();
  EXPECT_EQ(saved, all.states[14]);
  BatchStream resumed(ds_, Split::train, packer_, 5, opts(1, 2, 3));
  resumed.set_state(saved);
  for (int i = 7; i < 15; ++i) {
    resumed.next(b);
    expect_equal(b, all.batches[static_cast<size_t>(2 * i + 1)], "rank 1 batch " + std::to_string(i));
  }
  // The same state restarts a world of 4 (elastic resume): rank 2 gets global 14 + 2, ...
  BatchStream four(ds_, Split::train, packer_, 5, opts(2, 4, 0));
  four.set_state(saved);
  for (int i = 0; i < 5; ++i) {
    four.next(b);
    expect_equal(b, all.batches[static_cast<size_t>(14 + 4 * i + 2)], "world 4");
  }
}

TEST(LoaderOptions, FromConfigOrTorchrunEnvironment) {
  DataConfig c;
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  LoaderOptions o = loader_options(c);
  EXPECT_EQ(o.rank, 0);
  EXPECT_EQ(o.world_size, 1);
  EXPECT_EQ(o.prefetch, 4);
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "8", 1);
  o = loader_options(c);
  EXPECT_EQ(o.rank, 3);
  EXPECT_EQ(o.world_size, 8);
  c.world_size = 2;  // the config wins
  c.rank = 1;
  o = loader_options(c);
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.world_size, 2);
  c.rank = 2;
  EXPECT_THROW(loader_options(c), Error);
  c = DataConfig{};
  setenv("RANK", "8", 1);
  EXPECT_THROW(loader_options(c), Error);
  setenv("RANK", "x", 1);
  try {
    loader_options(c);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "[dist] environment RANK='x' is not an integer in 0..65536");
  }
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
}

TEST(Prefetcher, BuffersRotateWithoutAllocatingAndErrorsArriveInOrder) {
  const int64_t depth = 3;
  int produced = 0;
  Prefetcher p(depth, [&](HostBatch& b) {
    if (produced == 20) throw Error("[data] producer failed");
    b.tokens.reserve(1024);
    b.tokens.assign(1, produced);
    ++produced;
    return StreamState{0, static_cast<uint64_t>(produced), 0, 0};
  });
  HostBatch b;
  std::set<const int32_t*> buffers;
  for (int i = 0; i < 20; ++i) {
    const StreamState s = p.next(b);
    EXPECT_EQ(b.tokens, std::vector<int32_t>{i});
    EXPECT_EQ(s.next_document, static_cast<uint64_t>(i + 1));
    buffers.insert(b.tokens.data());
  }
  EXPECT_LE(buffers.size(), static_cast<size_t>(depth + 1));  // the ring plus the consumer's
  EXPECT_THROW(p.next(b), Error);
}

}  // namespace
}  // namespace kiln
