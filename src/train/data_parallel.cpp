#include "train/data_parallel.h"

#include "core/device_memory.h"
#include "core/phase_scope.h"
#include "ops/elementwise/elementwise.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string_view>

namespace kiln {

namespace {

// KILN_MEASURE_GRADIENT_MEMORY=1: ZeRO-2 counts the gradient arena's resident pages at every
// bucket and backward's end, and the run's log ends with the most it held (a diagnostic:
// the count walks the whole arena's pages each time, so training leaves it off).
bool measure_gradient_memory() {
  const char* value = std::getenv("KILN_MEASURE_GRADIENT_MEMORY");
  if (value == nullptr || *value == '\0') return false;
  const std::string_view v(value);
  KILN_CHECK(v == "0" || v == "1", "KILN_MEASURE_GRADIENT_MEMORY", "'{}' is not 0 or 1", v);
  return v == "1";
}

}  // namespace

DataParallel::DataParallel(dist::ProcessGroup& group, Model& model, const DataParallelOptions& options,
                           std::unique_ptr<ParameterShards> shards)
    : group_(group), model_(model), bucket_mb_(options.bucket_mb), backward_buckets_(options.backward_buckets),
      shards_(std::move(shards)), shard_group_(options.shard_ranks), shard_gradients_(options.shard_gradients),
      measure_gradient_memory_(options.shard_gradients && measure_gradient_memory()) {
  KILN_CHECK(!shard_gradients_ || shards_, "dist.zero", "2 needs the parameters' shards");
  KILN_CHECK(!measure_gradient_memory_ || !on_gpu(), "KILN_MEASURE_GRADIENT_MEMORY",
             "1 counts the CPU's resident gradient pages; the GPU's ZeRO-2 keeps the whole arena: unset it");
  if (!shards_) return;
  const int sharing = shard_group().world_size();
  KILN_CHECK(shards_->world_size() == sharing, "dist.zero", "shards for {} ranks, {} share them", shards_->world_size(),
             sharing);
  // The all-gather's buffer, where its collectives run; made now, never inside a capture.
  const size_t chunk_bytes = static_cast<size_t>(shards_->gather_chunk(bucket_mb_)) * dtype_size(shards_->dtype());
  gathered_ = Storage(group.device().device(), chunk_bytes * static_cast<size_t>(sharing));
}

DataParallel::~DataParallel() { model_.set_backward_progress({}); }

namespace {

// Copies rank r's flat elements [lo, hi) between its parameters and
// `window` (hi - lo elements): into the window, or out of it; on the host, or enqueued on
// the model's stream (a captured update replays the copies).
void copy_window(const ParameterShards& s, int r, int64_t lo, int64_t hi, unsigned char* window, bool into_window,
                 const ExecContext& exec, Device device) {
  const size_t element = dtype_size(s.dtype());
  for (const ParameterPiece& piece : s.pieces(r)) {
    const int64_t a = std::max(lo, piece.flat), b = std::min(hi, piece.flat + piece.count);
    if (a >= b) continue;
    const Tensor tensor = piece.parameter->value();
    auto* parameter = static_cast<unsigned char*>(tensor.raw()) +
                      static_cast<size_t>(piece.begin + a - piece.flat) * element;
    unsigned char* in_window = window + static_cast<size_t>(a - lo) * element;
    unsigned char* dst = into_window ? in_window : parameter;
    const unsigned char* src = into_window ? parameter : in_window;
    const size_t bytes = static_cast<size_t>(b - a) * element;
    if (device == Device::cpu) std::memcpy(dst, src, bytes);
    else copy_on_device_async(exec, dst, src, bytes);
  }
}

}  // namespace

// In rounds of a chunk per rank (train/parameter_shards.h: gather_chunk, about
// dist.bucket_mb in all): each rank copies the round's window of its shard into its chunk
// of the buffer, the buffer is all-gathered, and the other ranks' windows go back into the
// parameters. The buffer stays bucket-sized, not parameter-sized. On the GPU every copy and
// the NCCL all-gather are enqueued on the model's stream, inside the captured update.
void DataParallel::gather_parameters() {
  if (!shards_) return;
  KILN_PHASE("parameter all-gather");
  const ParameterShards& s = *shards_;
  const Device device = group_.device().device();
  const int64_t chunk = s.gather_chunk(bucket_mb_);
  const size_t chunk_bytes = static_cast<size_t>(chunk) * dtype_size(s.dtype());
  auto* buffer = static_cast<unsigned char*>(gathered_.data());
  const int me = shard_rank();
  for (int64_t first = 0; first < s.largest(); first += chunk) {
    const auto window = [&](int r) {  // rank r's elements this round
      const int64_t lo = std::min(s.bound(r) + first, s.bound(r + 1));
      return std::make_pair(lo, std::min(lo + chunk, s.bound(r + 1)));
    };
    const auto [lo, hi] = window(me);
    copy_window(s, me, lo, hi, buffer + chunk_bytes * static_cast<size_t>(me), true, model_.exec(), device);
    shard_group().all_gather(buffer, static_cast<int64_t>(chunk_bytes), "updated parameters");
    for (int r = 0; r < s.world_size(); ++r) {
      if (r == me) continue;
      const auto [from, to] = window(r);
      copy_window(s, r, from, to, buffer + chunk_bytes * static_cast<size_t>(r), false, model_.exec(), device);
    }
  }
}

// ZeRO-2's rounds: the all-gather's chunk per rank.
int64_t DataParallel::scatter_chunk() const {
  const ParameterShards& s = *shards_;
  const size_t element = dtype_size(s.dtype());
  // Gloo counts a call's bytes in an int: rounds stay below 2 GiB whatever dist.bucket_mb.
  const int64_t most = std::numeric_limits<int>::max() / static_cast<int64_t>(element * s.world_size());
  return std::min(s.gather_chunk(bucket_mb_), most);
}

// ZeRO-2 on the GPU: made at the first step, once the arena exists.
GradientReduceScatter& DataParallel::device_scatter() {
  if (!scatter_)
    scatter_ = std::make_unique<GradientReduceScatter>(shard_group(), shard_rank(), *shards_, model_.all_gradients(),
                                                       static_cast<unsigned char*>(gathered_.data()), scatter_chunk());
  return *scatter_;
}

// ZeRO-2 on the CPU (train/sharded_gradients.h): made at the first step, once the arena exists.
ShardedGradients& DataParallel::sharded() {
  if (!sharded_) {
    const ParameterShards& s = *shards_;
    sharded_ = std::make_unique<ShardedGradients>(shard_group(), shard_rank(), s, model_,
                                                  static_cast<unsigned char*>(gathered_.data()), scatter_chunk(),
                                                  measure_gradient_memory_);
    if (bucketed()) {
      const Tensor grads = model_.all_gradients();
      const auto elements = static_cast<int64_t>(std::llround(bucket_mb_ * 1024 * 1024)) /
                            static_cast<int64_t>(dtype_size(grads.dtype()));
      sharded_->plan_buckets(
          plan_gradient_buckets(model_.gradient_ranges(), grads.numel(), std::max<int64_t>(1, elements)));
    }
  }
  return *sharded_;
}

void DataParallel::zero_gradients() {
  if (host_sharded()) sharded().zero();
  else model_.zero_grads();  // (the GPU's ZeRO-2 keeps the whole arena: zeroed whole)
}

// ZeRO-2: only this rank's shard (every other rank's part of the arena is zero).
void DataParallel::scale_gradients(double factor) {
  if (!shard_gradients_) return model_.scale_gradients(factor);
  KILN_PHASE("clip");
  for (const ParameterPiece& piece : shards_->pieces(shard_rank())) {
    const Tensor grad = piece.parameter->grad();
    ops::scale_inplace(model_.exec(), grad.view(Shape{grad.numel()}).rows(piece.begin, piece.begin + piece.count),
                       factor);
  }
}

std::optional<DataParallel::GradientMemory> DataParallel::gradient_memory() const {
  if (!sharded_ || !sharded_->measures_resident()) return std::nullopt;
  return GradientMemory{sharded_->peak_resident_bytes(), sharded_->arena_bytes(), sharded_->shard_page_bytes()};
}

// Without ZeRO-2 every rank holds the summed gradients: the norm is its own. With it, each
// holds its shard's sums and zeros elsewhere, so its sum of squares is its shard's; the
// shards partition the trainable parameters, so their sum over the ranks is the whole
// model's sum of squares (in another order of addition: equal up to rounding).
void DataParallel::use_stage_gradients(std::unique_ptr<StageGradients> stages) {
  KILN_CHECK(!bucketed(), "dist.pipeline_model",
             "'stages' sums its gradients once after the pipeline's schedule, not in buckets during backward");
  KILN_CHECK(!shards_ || (stages->replicas() != nullptr && stages->replicas() == shard_group_), "dist.zero",
             "with dist.pipeline_model = stages ZeRO shards each stage over its replicas, not over every rank");
  stages_ = std::move(stages);
}

double DataParallel::gradient_norm() {
  if (stages_) {  // each rank its stages' part (the tied table counted once), summed over the ranks
    KILN_PHASE("gradient norm");
    double squares = stages_->sum_of_squares();
    group_.host().all_reduce(&squares, 1, DType::f64, dist::ReduceOp::sum, "gradient sum of squares");
    return std::sqrt(squares);
  }
  if (!shard_gradients_) return model_.gradient_norm();
  KILN_PHASE("gradient norm");
  double squares = ops::sum_squares(model_.exec(), model_.all_gradients());
  group_.host().all_reduce(&squares, 1, DType::f64, dist::ReduceOp::sum, "gradient sum of squares");
  return std::sqrt(squares);
}

void DataParallel::sum_shard_squares_on_device(double* squares) {
  if (shard_gradients_)
    group_.device().all_reduce(squares, 1, DType::f64, dist::ReduceOp::sum, "gradient sum of squares");
}

void DataParallel::before_backward(bool last_micro_batch) {
  if (host_sharded() && sharded().bucketed()) {  // ZeRO-2 on the CPU: every micro-batch's buckets, on a thread
    ShardedGradients* reduction = &sharded();  // (start waits for the last micro-batch's)
    reduction->start();
    model_.set_backward_progress([reduction](int event) { reduction->ready(event); });
    return;
  }
  if (!bucketed() || !last_micro_batch || host_sharded()) {
    model_.set_backward_progress({});
    return;
  }
  if (!buckets_) {  // the arena exists only once the model is allocated
    const Tensor grads = model_.all_gradients();
    const auto elements = static_cast<int64_t>(std::llround(bucket_mb_ * 1024 * 1024)) /
                          static_cast<int64_t>(dtype_size(grads.dtype()));
    std::vector<GradientBucket> plan =
        plan_gradient_buckets(model_.gradient_ranges(), grads.numel(), std::max<int64_t>(1, elements));
    if (on_gpu() && shard_gradients_)  // ZeRO-2: each bucket reduce-scattered into its owners' shards
      buckets_ = std::make_unique<StreamBucketedReduction>(
          group_.device(), model_.exec(), grads, std::move(plan),
          [scatter = &device_scatter()](const ExecContext& exec, const GradientBucket& bucket) {
            scatter->run(exec, bucket.begin, bucket.end);
          });
    else if (on_gpu())
      buckets_ = std::make_unique<StreamBucketedReduction>(group_.device(), model_.exec(), grads, std::move(plan));
    else
      buckets_ = std::make_unique<BucketedGradientReduction>(group_.device(), grads, std::move(plan));
  }
  reducing_ = true;
  BucketReduction* reduction = buckets_.get();
  reduction->start();
  model_.set_backward_progress([reduction](int event) { reduction->ready(event); });
}

void DataParallel::after_backward() {
  model_.set_backward_progress({});
  if (host_sharded() && sharded().bucketed()) sharded().finish();  // the rest handed over; waited for later
  if (!reducing_) return;
  if (on_gpu()) {
    buckets_->finish();  // the model's stream waits here, inside the micro-batch's graph
    reducing_ = false;
  } else {
    buckets_->ready(std::numeric_limits<int>::max());  // the thread goes on; reduce_gradients waits
  }
}

void DataParallel::watch_step() {
  group_.device().watch(model_.exec(), "a captured step's gradients, loss sums and step statistics");
}

std::vector<GradientBucket> DataParallel::buckets() const {
  if (sharded_) return sharded_->buckets();
  return buckets_ ? buckets_->buckets() : std::vector<GradientBucket>{};
}

void DataParallel::sum_counts(int64_t* counts, int count) {
  group_.host().all_reduce(counts, count, DType::i64, dist::ReduceOp::sum, "step token counts");
}

int DataParallel::agree_on_stop(int local_signal) {
  int32_t signal = local_signal;
  group_.host().all_reduce(&signal, 1, DType::i32, dist::ReduceOp::max, "stop signals");
  return signal;
}

void DataParallel::reduce_gradients() {
  if (stages_) {  // the tied table's two shares first (nothing else has two holders), then the replicas'
    stages_->exchange_table();
    if (!shard_gradients_) return stages_->reduce_over_replicas();
    sharded().reduce_scatter_all();  // ZeRO-2: over the stage's replicas, the pipeline's one reduction
    return stages_->reduce_statistics();
  }
  dist::Communicator& comm = group_.device();
  if (reducing_) {  // the CPU's buckets went out during backward: wait for the last
    reducing_ = false;
    buckets_->finish();
  } else if (shard_gradients_ && on_gpu()) {  // ZeRO-2 on the GPU: on the model's stream (the buckets': joined)
    if (!bucketed()) device_scatter().run(model_.exec(), 0, model_.all_gradients().numel());
  } else if (shard_gradients_) {  // ZeRO-2: each rank its shard's sums (its buckets' on their thread)
    if (sharded().bucketed()) sharded().wait();
    else sharded().reduce_scatter_all();
  } else if (!buckets_ || !on_gpu()) {  // no buckets: one reduction now
    const Tensor grads = model_.all_gradients();
    comm.all_reduce(grads.raw(), grads.numel(), grads.dtype(), dist::ReduceOp::sum, "gradients");
  }  // (the GPU's buckets were summed during backward and joined at its end: after_backward)
  for (const StepStatistic& s : model_.step_statistics())
    comm.all_reduce(s.tensor->raw(), s.tensor->numel(), s.tensor->dtype(),
                    s.reduction == StepReduction::sum ? dist::ReduceOp::sum : dist::ReduceOp::max_unsigned,
                    "step statistics");
}

void DataParallel::sum(double* values, int64_t count, Device where) {
  dist::Communicator& comm = where == Device::cpu ? group_.host() : group_.device();
  comm.all_reduce(values, count, DType::f64, dist::ReduceOp::sum, "loss sums");
}

}  // namespace kiln
