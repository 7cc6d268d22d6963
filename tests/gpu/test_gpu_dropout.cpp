// Dropout's CUDA kernel against the CPU reference: the same mask (dropout::keeps on both),
// fp32 values bit for bit, bf16 the fp32 result rounded once; the key read from device
// memory; a size that is not a multiple of anything.
#include "gpu/bf16_tensors.h"
#include "gpu/gpu_harness.h"
#include "ops/dropout/dropout.h"
#include "test_util.h"

#include <cstring>

namespace kiln {
namespace {

using namespace gpu_test;

OwnedTensor key_tensor(uint64_t key) {
  OwnedTensor t(DType::i32, Device::cpu, Shape{2});
  t->data<int32_t>()[0] = static_cast<int32_t>(static_cast<uint32_t>(key));
  t->data<int32_t>()[1] = static_cast<int32_t>(static_cast<uint32_t>(key >> 32));
  return t;
}

class DropoutGpu : public GpuTest {};

TEST_F(DropoutGpu, MatchesTheCpuMaskAndValues) {
  const Shape shape{1237, 193};
  const OwnedTensor x = test::random_tensor(DType::f32, shape, 3);
  for (const uint64_t key : {uint64_t{0}, uint64_t{0xfeedface12345678ull}}) {
    for (const double p : {0.1, 0.5}) {
      SCOPED_TRACE(fmt::format("key {:x} p {}", key, p));
      const OwnedTensor host_key = key_tensor(key), device_key = to_device(*host_key);
      OwnedTensor want(DType::f32, Device::cpu, shape);
      ops::dropout_apply(process_exec(), *x, {p, 5, *host_key}, *want);

      const OwnedTensor dx = to_device(*x);
      OwnedTensor dy(DType::f32, Device::cuda, shape);
      ops::dropout_apply(process_exec(), *dx, {p, 5, *device_key}, *dy);
      const OwnedTensor got = to_host(*dy);
      EXPECT_EQ(std::memcmp(got->raw(), want->raw(), want->nbytes()), 0) << "fp32 not bit for bit";

      // bf16 in, bf16 out (in place): the fp32 product of the bf16 input, rounded once.
      const OwnedTensor xb = bf16_of(*x);
      const OwnedTensor dxb = to_device(*xb);
      ops::dropout_apply(process_exec(), *dxb, {p, 5, *device_key}, *dxb);
      const OwnedTensor gotb = f32_of_bf16(*to_host(*dxb));
      OwnedTensor from_bf16(DType::f32, Device::cpu, shape);
      ops::dropout_apply(process_exec(), *f32_of_bf16(*xb), {p, 5, *host_key}, *from_bf16);
      const OwnedTensor wantb = f32_of_bf16(*bf16_of(*from_bf16));
      EXPECT_EQ(std::memcmp(gotb->raw(), wantb->raw(), wantb->nbytes()), 0) << "bf16 not the rounded fp32";
    }
  }
}

}  // namespace
}  // namespace kiln
