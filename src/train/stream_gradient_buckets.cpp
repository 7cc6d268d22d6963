#include "train/stream_gradient_buckets.h"

#include "core/error.h"
#include "core/side_stream.h"

#include <limits>

namespace kiln {

#if KILN_WITH_CUDA
StreamBucketedReduction::StreamBucketedReduction(dist::Communicator& comm, const ExecContext& model,
                                                 const Tensor& gradients, std::vector<GradientBucket> buckets,
                                                 BucketCollective collective)
    : comm_(comm),
      gradients_(gradients),
      buckets_(std::move(buckets)),
      collective_(std::move(collective)),
      communication_(std::make_unique<cuda::SideStream>(model)) {
  KILN_CHECK(gradients.device() == Device::cuda && comm.device() == Device::cuda, "dist",
             "buckets on a communication stream need GPU gradients and a GPU communicator");
}
#else
StreamBucketedReduction::StreamBucketedReduction(dist::Communicator& comm, const ExecContext&, const Tensor&,
                                                 std::vector<GradientBucket>, BucketCollective)
    : comm_(comm) {
  fail("dist", "buckets on a communication stream need the CUDA backend");
}
#endif

StreamBucketedReduction::~StreamBucketedReduction() = default;

void StreamBucketedReduction::start() { launches_.reset(); }

void StreamBucketedReduction::ready(int event) {
#if KILN_WITH_CUDA
  const std::vector<size_t> ready = launches_.take_ready(event);
  if (ready.empty()) return;
  communication_->fork();  // after the kernels that wrote these gradients
  const size_t element = dtype_size(gradients_.dtype());
  auto* base = static_cast<unsigned char*>(gradients_.raw());
  for (const size_t b : ready) {
    const GradientBucket& bucket = buckets_[b];
    if (collective_) {
      collective_(communication_->exec(), bucket);
      continue;
    }
    comm_.all_reduce_on(communication_->exec(), base + static_cast<size_t>(bucket.begin) * element,
                        bucket.end - bucket.begin, gradients_.dtype(), dist::ReduceOp::sum, "gradients");
  }
#else
  (void)event;
#endif
}

void StreamBucketedReduction::finish() {
  ready(std::numeric_limits<int>::max());
#if KILN_WITH_CUDA
  communication_->join();
#endif
}

}  // namespace kiln
