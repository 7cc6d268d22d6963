// Gradient buckets (train/gradient_buckets.h): the plan covers the whole flat gradient
// from its end, in whole parameter ranges, each bucket ready at its last gradient's event;
// and on a real model, every bucket goes out while backward still runs, and already holds
// its final values when it is sent (a bucket sent early would differ from the gradient
// backward leaves).
#include "tiny_model.h"
#include "train/gradient_buckets.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <vector>

namespace kiln {
namespace {

using namespace kiln::test;

TEST(GradientBuckets, PlanCoversTheArenaFromItsEndInWholeRanges) {
  // Gaps are padding between tensors; events as backward finishes them.
  const std::vector<GradientRange> ranges = {{0, 10, 3}, {12, 20, 2}, {20, 50, 1}, {50, 52, 0}};
  const std::vector<GradientBucket> b = plan_gradient_buckets(ranges, 60, 15);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].begin, 20);  // [50, 52) alone is under 15: [20, 50) joins it
  EXPECT_EQ(b[0].end, 60);    // the padding after the last range too
  EXPECT_EQ(b[0].ready_after, 1);
  EXPECT_EQ(b[1].begin, 0);
  EXPECT_EQ(b[1].end, 20);
  EXPECT_EQ(b[1].ready_after, 3);
}

TEST(GradientBuckets, ARangeLargerThanABucketIsABucketOfItsOwn) {
  const std::vector<GradientRange> ranges = {{0, 4, 2}, {4, 104, 1}, {104, 108, 0}};
  const std::vector<GradientBucket> b = plan_gradient_buckets(ranges, 110, 8);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].begin, 4);  // [104, 110) then the 100-element range: one bucket
  EXPECT_EQ(b[0].end, 110);
  EXPECT_EQ(b[1].begin, 0);
  EXPECT_EQ(b[1].end, 4);
  // One bucket when it holds everything; none for an empty arena.
  EXPECT_EQ(plan_gradient_buckets(ranges, 110, 1000).size(), 1u);
  EXPECT_TRUE(plan_gradient_buckets({}, 0, 8).empty());
}

// A communicator of one rank that keeps a copy of what each reduction was given.
class RecordingCommunicator final : public dist::Communicator {
 public:
  struct Sent {
    const unsigned char* data;
    std::vector<unsigned char> bytes;
  };
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Device device() const override { return Device::cpu; }
  std::string_view backend() const override { return "recording"; }
  void all_reduce(void* data, int64_t count, DType dtype, dist::ReduceOp, std::string_view) override {
    const auto* p = static_cast<const unsigned char*>(data);
    {
      std::lock_guard<std::mutex> lock(mutex);
      sent.push_back({p, std::vector<unsigned char>(p, p + count * static_cast<int64_t>(dtype_size(dtype)))});
    }
    changed.notify_all();
  }
  void broadcast(void*, int64_t, int, std::string_view) override {}
  void all_gather(void*, int64_t, std::string_view) override {}  // one rank: its chunk is the whole
  void reduce_scatter(void*, int64_t, DType, dist::ReduceOp, std::string_view) override {}  // the same
  void send(const void*, int64_t, int, int, std::string_view) override { ADD_FAILURE() << "no peer to send to"; }
  void recv(void*, int64_t, int, int, std::string_view) override { ADD_FAILURE() << "no peer to receive from"; }
  // Waits (at most 20 s) until `n` reductions have been sent; false if they were not.
  bool wait_for(size_t n) {
    std::unique_lock<std::mutex> lock(mutex);
    return changed.wait_for(lock, std::chrono::seconds(20), [&] { return sent.size() >= n; });
  }
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Sent> sent;
};

TEST(GradientBuckets, EveryBucketIsSentWithItsFinalGradients) {
  for (bool tie : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "tied " << tie);
    Model model(tiny_config(true, tie), tiny_build(24, 7, 1e-3));
    model.allocate();
    init_tiny_model(model, 5);
    const Tensor grads = model.all_gradients();
    // Every trainable parameter has a range; blocks get events 1..L, the table the last.
    const std::vector<GradientRange> ranges = model.gradient_ranges();
    int64_t trainable = 0;
    for (const auto& p : model.parameters()) trainable += p->grad().defined();
    ASSERT_EQ(static_cast<int64_t>(ranges.size()), trainable);
    std::set<int> events;
    for (const GradientRange& r : ranges) events.insert(r.ready_after);
    EXPECT_EQ(*events.begin(), 0);
    EXPECT_EQ(*events.rbegin(), static_cast<int>(model.config().layers) + 1);

    RecordingCommunicator comm;
    const int64_t element = static_cast<int64_t>(dtype_size(grads.dtype()));
    BucketedGradientReduction reduction(comm, grads, plan_gradient_buckets(ranges, grads.numel(), 64));
    ASSERT_GT(reduction.buckets().size(), 3u);
    // Two micro-batches: only the last one's backward reduces (the first one's gradients
    // are not final).
    HostBatch batch = pack_docs(three_docs(), 4);
    model.zero_grads();
    model.load_batch(batch);
    model.forward_backward(1.0 / static_cast<double>(batch.target_count));
    // Backward waits at each event until the buckets ready by then have been sent: they go
    // out while backward still runs, not at its end.
    std::vector<int> told;
    std::vector<bool> sent_in_time;
    model.set_backward_progress([&](int event) {
      told.push_back(event);
      reduction.ready(event);
      size_t ready = 0;
      for (const GradientBucket& b : reduction.buckets()) ready += b.ready_after <= event;
      sent_in_time.push_back(comm.wait_for(ready));
    });
    reduction.start();
    model.load_batch(batch);
    model.forward_backward(1.0 / static_cast<double>(batch.target_count));
    model.set_backward_progress({});
    reduction.finish();

    const int layers = static_cast<int>(model.config().layers);
    std::vector<int> expected;
    for (int e = 0; e <= layers + 1; ++e) expected.push_back(e);
    EXPECT_EQ(told, expected);
    EXPECT_EQ(sent_in_time, std::vector<bool>(expected.size(), true));
    ASSERT_EQ(comm.sent.size(), reduction.buckets().size());
    const auto* base = static_cast<const unsigned char*>(grads.raw());
    int64_t covered = 0;
    for (const auto& s : comm.sent) {
      covered += static_cast<int64_t>(s.bytes.size());
      EXPECT_EQ(std::memcmp(s.data, s.bytes.data(), s.bytes.size()), 0)
          << "the bucket at element " << (s.data - base) / element << " was sent before backward finished it";
    }
    EXPECT_EQ(covered, grads.numel() * element);
  }
}

}  // namespace
}  // namespace kiln
