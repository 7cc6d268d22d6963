// AdamW on the GPU (declared in adamw_cuda.h): one tensor per launch, or every parameter
// tensor in one launch (multi-tensor apply). The multi-tensor form cuts the tensors into
// chunks of kChunk elements; block b updates chunk b of its tensor. The table of tensors
// and chunks (AdamWTable, one per optimizer) lives on the device and is rebuilt only when
// the tensor list changes (in training, never after the first step), so a step costs one
// launch and no host-to-device copy. Both forms compute adamw_element (adamw_math.cuh): the same bits.
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/step_graphs.h"
#include "ops/optim/adamw_cuda.h"
#include "ops/grid_stride.cuh"
#include "ops/optim/adamw_math.cuh"

#include <cstdint>
#include <vector>

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 64 * 1024;

struct Chunk {
  int32_t tensor;
  int64_t begin;
};

// The elements [begin, end) of one tensor, gradients times grad_scale (1 is exact: the
// same bits as the unscaled update). Four elements per thread and iteration as float4
// loads and stores where the tensor's arrays are 16-byte aligned (chunk starts are
// multiples of 4): the kernel is bound by the bandwidth of its seven streams.
__device__ __forceinline__ void update_range(const AdamWTensorF32& t, int64_t begin, int64_t end, float grad_scale,
                                             float b1, float b2, float eps, const AdamWFactors& f) {
  const auto bits = reinterpret_cast<uintptr_t>(t.p) | reinterpret_cast<uintptr_t>(t.g) |
                    reinterpret_cast<uintptr_t>(t.m) | reinterpret_cast<uintptr_t>(t.v);
  int64_t scalar_begin = begin;
  if ((bits & 15) == 0 && begin % 4 == 0) {
    const int64_t vec_end = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + 4 * static_cast<int64_t>(threadIdx.x); i < vec_end; i += 4 * kThreads) {
      float4 p = *reinterpret_cast<const float4*>(t.p + i);
      const float4 g = *reinterpret_cast<const float4*>(t.g + i);
      float4 m = *reinterpret_cast<const float4*>(t.m + i);
      float4 v = *reinterpret_cast<const float4*>(t.v + i);
      adamw_element(p.x, __fmul_rn(g.x, grad_scale), m.x, v.x, b1, b2, eps, f.decay, f.step, f.inv_sqrt_bc2);
      adamw_element(p.y, __fmul_rn(g.y, grad_scale), m.y, v.y, b1, b2, eps, f.decay, f.step, f.inv_sqrt_bc2);
      adamw_element(p.z, __fmul_rn(g.z, grad_scale), m.z, v.z, b1, b2, eps, f.decay, f.step, f.inv_sqrt_bc2);
      adamw_element(p.w, __fmul_rn(g.w, grad_scale), m.w, v.w, b1, b2, eps, f.decay, f.step, f.inv_sqrt_bc2);
      *reinterpret_cast<float4*>(t.p + i) = p;
      *reinterpret_cast<float4*>(t.m + i) = m;
      *reinterpret_cast<float4*>(t.v + i) = v;
    }
    scalar_begin = vec_end;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < end; i += kThreads)
    adamw_element(t.p[i], __fmul_rn(t.g[i], grad_scale), t.m[i], t.v[i], b1, b2, eps, f.decay, f.step,
                  f.inv_sqrt_bc2);
}

// The per-tensor update: one element per thread of a grid-stride loop.
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, float lr, float b1, float b2,
                             float eps, float wd, float bc1, float bc2) {
  const AdamWFactors f = adamw_factors(lr, wd, bc1, bc2);
  KILN_GRID_STRIDE(i, n) adamw_element(p[i], g[i], m[i], v[i], b1, b2, eps, f.decay, f.step, f.inv_sqrt_bc2);
}

__global__ void adamw_multi_kernel(const AdamWTensorF32* tensors, const Chunk* chunks, float lr, float b1, float b2,
                                   float eps, float bc1, float bc2) {
  const Chunk c = chunks[blockIdx.x];
  const AdamWTensorF32 t = tensors[c.tensor];
  const AdamWFactors f = adamw_factors(lr, t.weight_decay, bc1, bc2);
  update_range(t, c.begin, min(c.begin + kChunk, t.n), 1.0f, b1, b2, eps, f);
}

// The same update with its scalars read from device memory when it runs.
__global__ void adamw_multi_device_kernel(const AdamWTensorF32* tensors, const Chunk* chunks, float b1, float b2,
                                          float eps, const ops::DeviceUpdateScalars* scalars, int group) {
  if (scalars->skip != 0) return;
  const Chunk c = chunks[blockIdx.x];
  const AdamWTensorF32 t = tensors[c.tensor];
  const ops::GroupUpdateScalars& g = scalars->group[group];
  const AdamWFactors f = adamw_factors(g.lr, t.weight_decay, g.bias_correction1, g.bias_correction2);
  update_range(t, c.begin, min(c.begin + kChunk, t.n), scalars->grad_scale, b1, b2, eps, f);
}

bool same_tensor(const AdamWTensorF32& a, const AdamWTensorF32& b) {
  return a.p == b.p && a.g == b.g && a.m == b.m && a.v == b.v && a.n == b.n && a.weight_decay == b.weight_decay;
}

}  // namespace

// The device copy of the last tensor list and its chunks.
class AdamWTable {
 public:
  AdamWTable() = default;
  AdamWTable(const AdamWTable&) = delete;
  AdamWTable& operator=(const AdamWTable&) = delete;
  // Errors ignored: a table destroyed at exit may outlive the CUDA context.
  ~AdamWTable() {
    if (tensors) (void)cudaFree(tensors);
    if (chunks) (void)cudaFree(chunks);
  }

  std::vector<AdamWTensorF32> host;
  AdamWTensorF32* tensors = nullptr;
  Chunk* chunks = nullptr;
  int64_t chunk_count = 0;

  void update(const AdamWTensorF32* list, int64_t count) {
    bool same = static_cast<int64_t>(host.size()) == count;
    for (int64_t i = 0; same && i < count; ++i) same = same_tensor(host[static_cast<size_t>(i)], list[i]);
    if (same) return;
    host.assign(list, list + count);
    std::vector<Chunk> host_chunks;
    for (int64_t i = 0; i < count; ++i)
      for (int64_t b = 0; b < list[i].n; b += kChunk) host_chunks.push_back({static_cast<int32_t>(i), b});
    // Rebuilt rarely (the first step): plain allocation and copies, ordered with the stream.
    bump_capture_generation();  // graphs captured with the old table must not run again
    if (tensors) check(cudaFree(tensors), "adamw", "cudaFree");
    if (chunks) check(cudaFree(chunks), "adamw", "cudaFree");
    tensors = nullptr, chunks = nullptr;
    chunk_count = static_cast<int64_t>(host_chunks.size());
    if (chunk_count == 0) return;
    check(cudaMalloc(&tensors, sizeof(AdamWTensorF32) * host.size()), "adamw", "cudaMalloc");
    check(cudaMalloc(&chunks, sizeof(Chunk) * host_chunks.size()), "adamw", "cudaMalloc");
    check(cudaMemcpy(tensors, host.data(), sizeof(AdamWTensorF32) * host.size(), cudaMemcpyHostToDevice), "adamw",
          "cudaMemcpy");
    check(cudaMemcpy(chunks, host_chunks.data(), sizeof(Chunk) * host_chunks.size(), cudaMemcpyHostToDevice), "adamw",
          "cudaMemcpy");
  }
};

std::shared_ptr<AdamWTable> make_adamw_table() { return std::make_shared<AdamWTable>(); }

void adamw_update_f32(const ExecContext& ctx, float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                      float eps, float weight_decay, float bc1, float bc2) {
  adamw_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream(ctx)>>>(p, g, m, v, n, lr, beta1, beta2, eps, weight_decay,
                                                                    bc1, bc2);
  check_launch("adamw", "adamw_kernel");
}

void adamw_update_many_f32(const ExecContext& ctx, AdamWTable& table, const AdamWTensorF32* tensors, int64_t count, float lr, float beta1,
                           float beta2, float eps, float bc1, float bc2) {
  table.update(tensors, count);
  if (table.chunk_count == 0) return;
  KILN_CHECK(table.chunk_count <= 0x7fffffff, "adamw", "{} chunks exceed the grid", table.chunk_count);
  adamw_multi_kernel<<<static_cast<unsigned>(table.chunk_count), kThreads, 0, stream(ctx)>>>(
      table.tensors, table.chunks, lr, beta1, beta2, eps, bc1, bc2);
  check_launch("adamw", "adamw_multi_kernel");
}

void adamw_update_many_device_f32(const ExecContext& ctx, AdamWTable& table, const AdamWTensorF32* tensors, int64_t count, float beta1,
                                  float beta2, float eps, const ops::DeviceUpdateScalars* scalars, int group) {
  KILN_CHECK(group >= 0 && group < ops::kMaxUpdateGroups, "adamw", "update group {} out of range", group);
  table.update(tensors, count);
  if (table.chunk_count == 0) return;
  KILN_CHECK(table.chunk_count <= 0x7fffffff, "adamw", "{} chunks exceed the grid", table.chunk_count);
  adamw_multi_device_kernel<<<static_cast<unsigned>(table.chunk_count), kThreads, 0, stream(ctx)>>>(
      table.tensors, table.chunks, beta1, beta2, eps, scalars, group);
  check_launch("adamw", "adamw_multi_device_kernel");
}

}  // namespace kiln::cuda
