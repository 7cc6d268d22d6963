#include "train/sharded_gradients.h"

#include "core/error.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace kiln {

namespace {

size_t page_size() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}
uintptr_t page_up(uintptr_t a) { return (a + page_size() - 1) / page_size() * page_size(); }
uintptr_t page_down(uintptr_t a) { return a / page_size() * page_size(); }

// Zeroes [lo, hi): the partial pages at its ends by writing zeros, the whole pages between
// by giving them back (private anonymous memory reads as zeros afterwards).
void zero_and_release(unsigned char* lo, unsigned char* hi) {
  if (lo >= hi) return;
  const auto a = page_up(reinterpret_cast<uintptr_t>(lo)), b = page_down(reinterpret_cast<uintptr_t>(hi));
  if (a >= b) {
    std::memset(lo, 0, static_cast<size_t>(hi - lo));
    return;
  }
  std::memset(lo, 0, a - reinterpret_cast<uintptr_t>(lo));
  std::memset(reinterpret_cast<unsigned char*>(b), 0, reinterpret_cast<uintptr_t>(hi) - b);
  KILN_CHECK(madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED) == 0, "dist.zero",
             "2: could not give back {} bytes of gradient pages (madvise)", b - a);
}

}  // namespace

ShardedGradients::ShardedGradients(dist::Communicator& comm, int rank, const ParameterShards& shards, Model& model,
                                   unsigned char* buffer, int64_t chunk, bool measure_resident)
    : shards_(shards), model_(model),
      rounds_(comm, rank, shards, model.all_gradients(), buffer, chunk),
      measure_resident_(measure_resident) {
  const Tensor grads = model.all_gradients();
  arena_ = static_cast<unsigned char*>(grads.raw());
  arena_bytes_ = static_cast<size_t>(grads.numel()) * dtype_size(grads.dtype());
  const size_t element = dtype_size(shards.dtype());
  for (const ParameterPiece& piece : shards.pieces(rank)) {
    const auto at = static_cast<size_t>(static_cast<unsigned char*>(piece.parameter->grad().raw()) - arena_) +
                    static_cast<size_t>(piece.begin) * element;
    own_.emplace_back(at, at + static_cast<size_t>(piece.count) * element);
  }
  std::sort(own_.begin(), own_.end());
  // The pages its shard overlaps: what it holds between steps, at the least.
  uintptr_t counted = 0;  // the end of the last page counted
  for (const auto& [lo, hi] : own_) {
    const uintptr_t first = std::max(page_down(reinterpret_cast<uintptr_t>(arena_ + lo)), counted);
    const uintptr_t last = page_up(reinterpret_cast<uintptr_t>(arena_ + hi));
    if (first < last) shard_pages_ += last - first;
    counted = std::max(counted, last);
  }
  note_resident();  // before the first step: the arena's pages untouched (core/arena.h: HostPages)
}

void ShardedGradients::plan_buckets(std::vector<GradientBucket> buckets) {
  thread_.reset();
  buckets_ = std::move(buckets);
  thread_ = std::make_unique<BucketThread>(buckets_, [this](size_t i) { reduce_scatter_bucket(i); });
}

void ShardedGradients::start() {
  wait();
  thread_->start();
  reduced_.assign(buckets_.size(), false);
  in_flight_ = true;
}

// One event's buckets in flight at most: backward computes the next block while the last
// block's buckets are reduce-scattered, but goes no further until they are, or it would hold
// every block's gradients the thread has not reached yet (the whole arena, measured at 4
// ranks on 2 cores: the reduce-scatters are slower than the blocks' backward).
void ShardedGradients::ready(int event) {
  if (const size_t handed = thread_->ready(event)) thread_->wait(handed);
}

void ShardedGradients::finish() { thread_->ready(std::numeric_limits<int>::max()); }

void ShardedGradients::wait() {
  if (!in_flight_) return;
  in_flight_ = false;
  thread_->wait();
  note_resident();
  release_outside_own(0, arena_bytes_, false);
}

void ShardedGradients::reduce_scatter_bucket(size_t i) {
  const size_t element = dtype_size(shards_.dtype());
  const size_t page = page_size();
  note_resident();
  const GradientBucket& b = buckets_[i];
  reduce_scatter_range(b.begin, b.end);
  reduced_[i] = true;
  // Its whole pages outside this rank's shard go back, with the pages it shares with
  // reduced neighbours (the plan runs down the arena: bucket i + 1 lies just below i); a
  // page it shares with a bucket not yet reduced stays until that one is. Backward no
  // longer writes any of them this micro-batch: they belong to reduced buckets.
  size_t lo = static_cast<size_t>(b.begin) * element, hi = static_cast<size_t>(b.end) * element;
  if (i + 1 < buckets_.size() && reduced_[i + 1])
    lo = std::max(static_cast<size_t>(buckets_[i + 1].begin) * element, lo >= page ? lo - page : 0);
  if (i > 0 && reduced_[i - 1]) hi = std::min(static_cast<size_t>(buckets_[i - 1].end) * element, hi + page);
  release_outside_own(lo, hi, true);
}

void ShardedGradients::reduce_scatter_all() {
  reduce_scatter_range(0, static_cast<int64_t>(arena_bytes_ / dtype_size(shards_.dtype())));
  note_resident();
  release_outside_own(0, arena_bytes_, false);
}

void ShardedGradients::zero() {
  wait();  // (done already: the step's synchronization waited)
  release_outside_own(0, arena_bytes_, false);
  for (const auto& [lo, hi] : own_) std::memset(arena_ + lo, 0, hi - lo);
}

// Every element outside this rank's shard in [lo, hi) is zero here (reduced and zeroed,
// or padding), so writing zeros over the partial pages at the gaps' edges changes nothing.
void ShardedGradients::release_outside_own(size_t lo, size_t hi, bool whole_pages_only) {
  const auto release = [&](size_t a, size_t b) {  // a gap between this rank's ranges
    a = std::max(a, lo);
    b = std::min(b, hi);
    if (a >= b) return;
    if (!whole_pages_only) return zero_and_release(arena_ + a, arena_ + b);
    const auto first = page_up(reinterpret_cast<uintptr_t>(arena_ + a));
    const auto last = page_down(reinterpret_cast<uintptr_t>(arena_ + b));
    if (first < last) zero_and_release(reinterpret_cast<unsigned char*>(first), reinterpret_cast<unsigned char*>(last));
  };
  size_t gap = 0;
  for (const auto& [begin, end] : own_) {
    release(gap, begin);
    gap = std::max(gap, end);
  }
  release(gap, arena_bytes_);
}

size_t ShardedGradients::resident_bytes() const {
  const uintptr_t lo = page_down(reinterpret_cast<uintptr_t>(arena_));
  const uintptr_t hi = page_up(reinterpret_cast<uintptr_t>(arena_ + arena_bytes_));
  std::vector<unsigned char> pages((hi - lo) / page_size());
  KILN_CHECK(mincore(reinterpret_cast<void*>(lo), hi - lo, pages.data()) == 0, "dist.zero",
             "2: could not count the gradient arena's resident pages (mincore)");
  const auto resident = static_cast<size_t>(std::count_if(pages.begin(), pages.end(), [](unsigned char p) { return p & 1; }));
  return resident * page_size();
}

void ShardedGradients::note_resident() {
  if (measure_resident_) peak_resident_ = std::max(peak_resident_, resident_bytes());
}

// On the host (train/gradient_reduce_scatter.h), the other ranks' parts then zero here.
void ShardedGradients::reduce_scatter_range(int64_t begin, int64_t end) { rounds_.run(model_.exec(), begin, end); }

}  // namespace kiln
