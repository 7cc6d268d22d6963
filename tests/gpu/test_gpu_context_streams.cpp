// Ops on two execution contexts (two CUDA streams) at once (core/exec_context.h, issue 39
// step c): the kernel families that keep partial sums between their launches take them from
// their context's scratch (core/context_scratch.h), so two streams running the same op
// concurrently never overwrite each other's partials. With the old module-level scratch
// the interleaved runs below raced; each must now give the bytes of a run alone.
#include "core/context_scratch.h"
#include "core/cuda_context.h"
#include "core/device_memory.h"
#include "core/tensor.h"
#include "gpu/gpu_harness.h"
#include "ops/elementwise/elementwise.h"
#include "ops/layer_norm/layer_norm.h"
#include "test_util.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

// A non-blocking stream of the test's own, and a context naming it.
struct OwnStream {
  cudaStream_t stream = nullptr;
  ExecContext ctx;
  OwnStream() {
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    ctx.stream = stream;
  }
  ~OwnStream() { cudaStreamDestroy(stream); }
};

constexpr cuda::ScratchKind kTestKind{"test scratch", 4096};

TEST(ContextScratch, EachStreamHasItsOwnBufferOfAKind) {
  OwnStream a, b;
  void* on_a = cuda::context_scratch(a.ctx, kTestKind);
  void* on_b = cuda::context_scratch(b.ctx, kTestKind);
  void* on_process = cuda::context_scratch(process_exec(), kTestKind);
  EXPECT_NE(on_a, on_b);
  EXPECT_NE(on_a, on_process);
  EXPECT_EQ(on_a, cuda::context_scratch(a.ctx, kTestKind)) << "a context's buffer moved between calls";
  std::vector<unsigned char> bytes(kTestKind.bytes, 0xAB);
  ASSERT_EQ(cudaMemcpy(bytes.data(), on_b, bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (unsigned char byte : bytes) ASSERT_EQ(byte, 0) << "a new scratch buffer is not zeroed";
}

// One LayerNorm backward case with gain and bias gradients (its dw/db partials go through
// scratch), on the device.
struct LayerNormCase {
  OwnedTensor x, w, dy, mean, rstd, dx, dw, db;
  LayerNormCase(int64_t rows, int64_t cols, uint64_t seed) {
    x = to_device(*test::random_tensor(DType::f32, Shape{rows, cols}, seed));
    w = to_device(*test::random_tensor(DType::f32, Shape{cols}, seed + 1));
    dy = to_device(*test::random_tensor(DType::f32, Shape{rows, cols}, seed + 2));
    mean = OwnedTensor(DType::f32, Device::cuda, Shape{rows});
    rstd = OwnedTensor(DType::f32, Device::cuda, Shape{rows});
    dx = OwnedTensor(DType::f32, Device::cuda, Shape{rows, cols});
    dw = OwnedTensor(DType::f32, Device::cuda, Shape{cols});
    db = OwnedTensor(DType::f32, Device::cuda, Shape{cols});
    OwnedTensor y(DType::f32, Device::cuda, Shape{rows, cols});
    ops::layer_norm_forward(process_exec(), *x, *w, Tensor(), 1e-5, *y, *mean, *rstd);
  }
  // dw and db from zero, then `repeats` backwards accumulating into them.
  void run(const ExecContext& ctx, int repeats) {
    ASSERT_EQ(cudaMemsetAsync(dw->raw(), 0, dw->nbytes(), cuda::stream(ctx)), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(db->raw(), 0, db->nbytes(), cuda::stream(ctx)), cudaSuccess);
    for (int i = 0; i < repeats; ++i)
      ops::layer_norm_backward(ctx, *x, *w, *mean, *rstd, *dy, *dx, *dw, *db, false, Tensor());
  }
};

TEST(ContextScratch, TwoStreamsRunTheSameOpsConcurrentlyWithTheBytesOfARunAlone) {
  constexpr int kRepeats = 40;
  // Many rows: many blocks write partial rows, so a shared buffer would be overwritten.
  LayerNormCase first(65536, 512, 11), second(65536, 512, 23);
  first.run(process_exec(), kRepeats);
  second.run(process_exec(), kRepeats);
  synchronize_stream();
  const OwnedTensor dw_first = to_host(*first.dw), db_first = to_host(*first.db);
  const OwnedTensor dw_second = to_host(*second.dw), db_second = to_host(*second.db);
  OwnedTensor sq_input = to_device(*test::random_tensor(DType::f32, Shape{1 << 20}, 37));
  const double sum_alone = ops::sum_squares(process_exec(), *sq_input);

  OwnStream a, b;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the inputs, written on the legacy stream
  first.run(a.ctx, kRepeats);  // enqueued, not waited for: b's work overlaps it
  second.run(b.ctx, kRepeats);
  const double sum_on_b = ops::sum_squares(b.ctx, *sq_input);  // while a still runs
  ASSERT_EQ(cudaStreamSynchronize(a.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(b.stream), cudaSuccess);
  EXPECT_TRUE(same_bytes(*to_host(*first.dw), *dw_first));
  EXPECT_TRUE(same_bytes(*to_host(*first.db), *db_first));
  EXPECT_TRUE(same_bytes(*to_host(*second.dw), *dw_second));
  EXPECT_TRUE(same_bytes(*to_host(*second.db), *db_second));
  EXPECT_EQ(sum_on_b, sum_alone);
}

}  // namespace
}  // namespace kiln
