// The GPU's form of data parallelism's bucketed gradient reduction (train/
// gradient_buckets.h): each bucket is all-reduced by NCCL on a communication stream beside
// the model's, as soon as backward has finished its gradients, while backward goes on
// with the blocks below on the model's stream. Each launch forks the communication stream
// after the kernels that wrote the bucket (an event); the end of backward joins it, so the
// model's stream reads the gradients (the norm) only once every bucket is summed. All of
// it only enqueues work: a captured micro-batch replays the overlap as the branches of its
// graph. Every rank launches the same buckets in the same order, as NCCL requires.
//
// ZeRO-2 (dist.zero = 2) gives each bucket another collective: its reduce-scatter into the
// owners' shards (train/gradient_reduce_scatter.h), on the same stream, the same way.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "train/gradient_buckets.h"

#include <functional>
#include <memory>
#include <vector>

namespace kiln {

namespace cuda {
class SideStream;
}

class StreamBucketedReduction final : public BucketReduction {
 public:
  // What a bucket's collective does, enqueued on the communication stream `exec`.
  using BucketCollective = std::function<void(const ExecContext& exec, const GradientBucket& bucket)>;
  // Reduces buckets of `gradients` (device memory) over `comm`'s ranks on a stream beside
  // `model`'s: sums each in place (all-reduce), or runs `collective` on it when given.
  // CUDA builds only; made outside any capture.
  StreamBucketedReduction(dist::Communicator& comm, const ExecContext& model, const Tensor& gradients,
                          std::vector<GradientBucket> buckets, BucketCollective collective = {});
  ~StreamBucketedReduction() override;
  StreamBucketedReduction(const StreamBucketedReduction&) = delete;
  StreamBucketedReduction& operator=(const StreamBucketedReduction&) = delete;

  void start() override;
  // Reduces the ready buckets on the communication stream, after the work enqueued so far
  // on the model's.
  void ready(int event) override;
  // The model's stream waits for every bucket.
  void finish() override;

  const std::vector<GradientBucket>& buckets() const override { return buckets_; }

 private:
  dist::Communicator& comm_;
  Tensor gradients_;
  std::vector<GradientBucket> buckets_;
  BucketCollective collective_;
  BucketLaunches launches_{buckets_};
  std::unique_ptr<cuda::SideStream> communication_;
};

}  // namespace kiln
