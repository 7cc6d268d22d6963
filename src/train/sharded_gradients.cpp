#include "train/sharded_gradients.h"

#include "core/error.h"
#include "core/phase_scope.h"
#include "ops/elementwise/elementwise.h"

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

// A run of one parameter's gradient elements inside a rank's part of a reduced range.
struct Segment {
  unsigned char* data;
  int64_t count;
};

// Copies elements [lo, hi) of the concatenated segments into `window` or out of it.
void copy_segments(const std::vector<Segment>& segments, int64_t lo, int64_t hi, unsigned char* window,
                   bool into_window, size_t element) {
  int64_t at = 0;
  for (const Segment& s : segments) {
    const int64_t a = std::max(lo, at), b = std::min(hi, at + s.count);
    if (a < b) {
      unsigned char* gradient = s.data + static_cast<size_t>(a - at) * element;
      unsigned char* in_window = window + static_cast<size_t>(a - lo) * element;
      const size_t bytes = static_cast<size_t>(b - a) * element;
      if (into_window) std::memcpy(in_window, gradient, bytes);
      else std::memcpy(gradient, in_window, bytes);
    }
    at += s.count;
    if (at >= hi) break;
  }
}

}  // namespace

ShardedGradients::ShardedGradients(dist::Communicator& comm, int rank, const ParameterShards& shards, Model& model,
                                   unsigned char* buffer, int64_t chunk)
    : comm_(comm), rank_(rank), shards_(shards), model_(model), buffer_(buffer), chunk_(chunk) {
  const Tensor grads = model.all_gradients();
  arena_ = static_cast<unsigned char*>(grads.raw());
  arena_bytes_ = static_cast<size_t>(grads.numel()) * dtype_size(grads.dtype());
  const size_t element = dtype_size(shards.dtype());
  own_begin_ = arena_bytes_;
  for (const ParameterPiece& piece : shards.pieces(rank)) {
    const auto at = static_cast<size_t>(static_cast<unsigned char*>(piece.parameter->grad().raw()) - arena_) +
                    static_cast<size_t>(piece.begin) * element;
    own_begin_ = std::min(own_begin_, at);
    own_end_ = std::max(own_end_, at + static_cast<size_t>(piece.count) * element);
  }
  if (own_end_ == 0) own_begin_ = 0;
}

void ShardedGradients::plan_buckets(std::vector<GradientBucket> buckets) {
  buckets_ = std::move(buckets);
  launches_ = std::make_unique<BucketLaunches>(buckets_);
}

void ShardedGradients::start() { launches_->reset(); }

void ShardedGradients::ready(int event) {
  for (size_t i : launches_->take_ready(event)) {
    note_resident();
    const GradientBucket& b = buckets_[i];
    reduce_scatter_range(b.begin, b.end);
    const size_t element = dtype_size(shards_.dtype());
    // Its pages outside this rank's shard go back (a page it shares with a bucket not yet
    // reduced stays until finish()).
    unsigned char* lo = arena_ + static_cast<size_t>(b.begin) * element;
    unsigned char* hi = arena_ + static_cast<size_t>(b.end) * element;
    const auto page_lo = reinterpret_cast<unsigned char*>(page_up(reinterpret_cast<uintptr_t>(lo)));
    const auto page_hi = reinterpret_cast<unsigned char*>(page_down(reinterpret_cast<uintptr_t>(hi)));
    const auto own_lo = reinterpret_cast<unsigned char*>(page_down(reinterpret_cast<uintptr_t>(arena_ + own_begin_)));
    const auto own_hi = reinterpret_cast<unsigned char*>(page_up(reinterpret_cast<uintptr_t>(arena_ + own_end_)));
    if (own_begin_ >= own_end_) {
      zero_and_release(page_lo, std::max(page_lo, page_hi));
    } else {
      zero_and_release(page_lo, std::max(page_lo, std::min(page_hi, own_lo)));
      zero_and_release(std::min(page_hi, std::max(page_lo, own_hi)), page_hi);
    }
  }
}

void ShardedGradients::finish() {
  ready(std::numeric_limits<int>::max());
  note_resident();
  release_outside_own();
}

void ShardedGradients::reduce_scatter_all() {
  reduce_scatter_range(0, static_cast<int64_t>(arena_bytes_ / dtype_size(shards_.dtype())));
  note_resident();
  release_outside_own();
}

void ShardedGradients::zero() {
  release_outside_own();
  std::memset(arena_ + own_begin_, 0, own_end_ - own_begin_);
}

void ShardedGradients::scale(double factor) {
  KILN_PHASE("clip");
  for (const ParameterPiece& piece : shards_.pieces(rank_)) {
    const Tensor grad = piece.parameter->grad();
    ops::scale_inplace(model_.exec(), grad.view(Shape{grad.numel()}).rows(piece.begin, piece.begin + piece.count),
                       factor);
  }
}

// Every element outside this rank's shard is zero here (reduced and zeroed, or padding),
// so writing zeros over the partial pages at the shard's edges changes nothing.
void ShardedGradients::release_outside_own() {
  if (own_begin_ >= own_end_) {
    zero_and_release(arena_, arena_ + arena_bytes_);
    return;
  }
  zero_and_release(arena_, arena_ + own_begin_);
  zero_and_release(arena_ + own_end_, arena_ + arena_bytes_);
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

void ShardedGradients::note_resident() { peak_resident_ = std::max(peak_resident_, resident_bytes()); }

// In rounds of a chunk per rank, as the parameters' all-gather (train/data_parallel.h):
// every rank copies each rank's part of the range into that rank's chunk of the buffer (a
// short part's tail zeroed: Gloo's chunks are equal, as NCCL's), the buffer is
// reduce-scattered, and this rank's summed part goes back into its gradients. The other
// ranks' parts are then zeroed here. A rank's part is its shard's pieces inside the range,
// in flat order: over the whole arena, its whole shard (the rounds of dist.bucket_mb = 0).
void ShardedGradients::reduce_scatter_range(int64_t begin, int64_t end) {
  KILN_PHASE("gradient reduce-scatter");
  const int world = shards_.world_size();
  const size_t element = dtype_size(shards_.dtype());
  std::vector<std::vector<Segment>> parts(static_cast<size_t>(world));
  std::vector<int64_t> sizes(static_cast<size_t>(world), 0);
  int64_t largest = 0;
  for (int r = 0; r < world; ++r) {
    for (const ParameterPiece& piece : shards_.pieces(r)) {
      auto* grad = static_cast<unsigned char*>(piece.parameter->grad().raw());
      const int64_t at = (grad - arena_) / static_cast<int64_t>(element) + piece.begin;
      const int64_t a = std::max(begin, at), b = std::min(end, at + piece.count);
      if (a >= b) continue;
      parts[static_cast<size_t>(r)].push_back({arena_ + static_cast<size_t>(a) * element, b - a});
      sizes[static_cast<size_t>(r)] += b - a;
    }
    largest = std::max(largest, sizes[static_cast<size_t>(r)]);
  }
  const int64_t chunk = chunk_;
  const size_t chunk_bytes = static_cast<size_t>(chunk) * element;
  for (int64_t first = 0; first < largest; first += chunk) {
    for (int r = 0; r < world; ++r) {
      const int64_t lo = std::min(first, sizes[static_cast<size_t>(r)]);
      const int64_t hi = std::min(lo + chunk, sizes[static_cast<size_t>(r)]);
      unsigned char* own = buffer_ + chunk_bytes * static_cast<size_t>(r);
      copy_segments(parts[static_cast<size_t>(r)], lo, hi, own, true, element);
      std::memset(own + static_cast<size_t>(hi - lo) * element, 0, static_cast<size_t>(chunk - (hi - lo)) * element);
    }
    comm_.reduce_scatter(buffer_, chunk, shards_.dtype(), dist::ReduceOp::sum, "gradients (reduce-scatter)");
    const int64_t lo = std::min(first, sizes[static_cast<size_t>(rank_)]);
    const int64_t hi = std::min(lo + chunk, sizes[static_cast<size_t>(rank_)]);
    copy_segments(parts[static_cast<size_t>(rank_)], lo, hi, buffer_ + chunk_bytes * static_cast<size_t>(rank_), false,
                  element);
  }
  for (int r = 0; r < world; ++r) {
    if (r == rank_) continue;
    for (const Segment& s : parts[static_cast<size_t>(r)]) std::memset(s.data, 0, static_cast<size_t>(s.count) * element);
  }
}

}  // namespace kiln
