#include "train/gradient_reduce_scatter.h"

#include "core/device_memory.h"
#include "core/phase_scope.h"
#include "ops/elementwise/elementwise.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace kiln {

namespace {

// A run of one parameter's gradient elements inside a rank's part of a reduced range.
struct Segment {
  unsigned char* data;
  int64_t count;
};

// Copies and zeroes bytes on the host, or enqueued on a stream of the GPU.
struct Bytes {
  const ExecContext& exec;
  Device device;
  void copy(unsigned char* dst, const unsigned char* src, size_t bytes) const {
    if (bytes == 0) return;
    if (device == Device::cpu) std::memcpy(dst, src, bytes);
    else copy_on_device_async(exec, dst, src, bytes);
  }
  void zero(unsigned char* dst, size_t bytes) const {
    if (bytes == 0) return;
    if (device == Device::cpu) std::memset(dst, 0, bytes);
    else ops::zero(exec, Tensor(dst, DType::u8, device, Shape{static_cast<int64_t>(bytes)}));
  }
};

// Copies elements [lo, hi) of the concatenated segments into `window` or out of it.
void copy_segments(const std::vector<Segment>& segments, int64_t lo, int64_t hi, unsigned char* window,
                   bool into_window, size_t element, const Bytes& bytes) {
  int64_t at = 0;
  for (const Segment& s : segments) {
    const int64_t a = std::max(lo, at), b = std::min(hi, at + s.count);
    if (a < b) {
      unsigned char* gradient = s.data + static_cast<size_t>(a - at) * element;
      unsigned char* in_window = window + static_cast<size_t>(a - lo) * element;
      const size_t n = static_cast<size_t>(b - a) * element;
      if (into_window) bytes.copy(in_window, gradient, n);
      else bytes.copy(gradient, in_window, n);
    }
    at += s.count;
    if (at >= hi) break;
  }
}

}  // namespace

GradientReduceScatter::GradientReduceScatter(dist::Communicator& comm, int rank, const ParameterShards& shards,
                                             const Tensor& arena, unsigned char* buffer, int64_t chunk)
    : comm_(comm), rank_(rank), shards_(shards), arena_(static_cast<unsigned char*>(arena.raw())),
      device_(arena.device()), buffer_(buffer), chunk_(chunk) {}

void GradientReduceScatter::run(const ExecContext& exec, int64_t begin, int64_t end) {
  KILN_PHASE("gradient reduce-scatter");
  const Bytes bytes{exec, device_};
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
      copy_segments(parts[static_cast<size_t>(r)], lo, hi, own, true, element, bytes);
      bytes.zero(own + static_cast<size_t>(hi - lo) * element, static_cast<size_t>(chunk - (hi - lo)) * element);
    }
    comm_.reduce_scatter_on(exec, buffer_, chunk, shards_.dtype(), dist::ReduceOp::sum, "gradients (reduce-scatter)");
    const int64_t lo = std::min(first, sizes[static_cast<size_t>(rank_)]);
    const int64_t hi = std::min(lo + chunk, sizes[static_cast<size_t>(rank_)]);
    copy_segments(parts[static_cast<size_t>(rank_)], lo, hi, buffer_ + chunk_bytes * static_cast<size_t>(rank_), false,
                  element, bytes);
  }
  for (int r = 0; r < world; ++r) {
    if (r == rank_) continue;
    for (const Segment& s : parts[static_cast<size_t>(r)]) bytes.zero(s.data, static_cast<size_t>(s.count) * element);
  }
}

}  // namespace kiln
