// AdamW with bf16 or 8-bit moments on the GPU (adamw_lowmem_cuda.h), multi-tensor as the
// fp32 kernel (adamw_cuda.cu): tensors cut into chunks of kChunk elements, CUDA block b
// updating chunk b, the tensor and chunk table on the device and rebuilt only when the
// list changes. 8-bit: a chunk is whole quantization blocks of 256 elements, thread t takes
// element t of each, and the block's new absmax is a block-wide max before the codes are
// written; the dynamic maps are read into shared memory once a chunk. The arithmetic is
// adamw_lowmem_math.h's, shared with the CPU reference.
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/step_graphs.h"
#include "ops/optim/adamw_lowmem_cuda.h"
#include "ops/optim/adamw_lowmem_math.h"
#include "ops/optim/dynamic_map.h"

#include <cstdint>
#include <vector>

namespace kiln::cuda {

namespace {

namespace am = adamw_lowmem;

constexpr int kThreads = 256;
constexpr int64_t kChunk = 64 * 1024;
static_assert(kThreads == am::kBlock, "one thread per element of an 8-bit block");
static_assert(kChunk % am::kBlock == 0, "chunks hold whole 8-bit blocks");

struct Chunk {
  int32_t tensor;
  int64_t begin;
};

// The two maps, in one device buffer: signed (m) then unsigned (v).
struct Maps {
  float m[256], v[256];
};

struct Scalars {
  float grad_scale, b1, b2, eps;
  am::Factors f;
};

__device__ __forceinline__ void update_bf16(const AdamWLowMemTensorDev& t, int64_t begin, int64_t end,
                                            const Scalars& s) {
  auto* m = static_cast<uint16_t*>(t.m);
  auto* v = static_cast<uint16_t*>(t.v);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float p = t.p[i], mi = am::from_bf16(m[i]), vi = am::from_bf16(v[i]);
    am::update(p, am::mul(t.g[i], s.grad_scale), mi, vi, s.b1, s.b2, s.eps, s.f);
    t.p[i] = p, m[i] = am::to_bf16(mi), v[i] = am::to_bf16(vi);
  }
}

// The largest of each thread's a and of its b over the CUDA block (max is exact: any order
// gives the CPU's result).
__device__ __forceinline__ void block_max(float& a, float& b) {
  __shared__ float part_a[kThreads / 32], part_b[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, offset));
    b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, offset));
  }
  if (threadIdx.x % 32 == 0) part_a[threadIdx.x / 32] = a, part_b[threadIdx.x / 32] = b;
  __syncthreads();
  a = part_a[0], b = part_b[0];
  for (int w = 1; w < kThreads / 32; ++w) a = fmaxf(a, part_a[w]), b = fmaxf(b, part_b[w]);
  __syncthreads();  // the parts are rewritten by the next block's call
}

__device__ __forceinline__ void update_int8(const AdamWLowMemTensorDev& t, int64_t begin, int64_t end,
                                            const Scalars& s, const Maps& maps) {
  auto* mq = static_cast<uint8_t*>(t.m);
  auto* vq = static_cast<uint8_t*>(t.v);
  for (int64_t first = begin; first < end; first += am::kBlock) {
    const int64_t block = first / am::kBlock, i = first + threadIdx.x;
    const bool live = i < end;
    float m = 0, v = 0;
    if (live) {
      m = am::dequantize(maps.m, mq[i], t.m_absmax[block]);
      v = am::dequantize(maps.v, vq[i], t.v_absmax[block]);
      float p = t.p[i];
      am::update(p, am::mul(t.g[i], s.grad_scale), m, v, s.b1, s.b2, s.eps, s.f);
      t.p[i] = p;
    }
    float m_max = fabsf(m), v_max = v;  // every thread has read this block's absmax first
    block_max(m_max, v_max);
    if (live) mq[i] = am::quantize(maps.m, m, m_max), vq[i] = am::quantize(maps.v, v, v_max);
    if (threadIdx.x == 0) t.m_absmax[block] = m_max, t.v_absmax[block] = v_max;
  }
}

__device__ __forceinline__ void update_chunk(const AdamWLowMemTensorDev* tensors, const Chunk* chunks,
                                             const Maps* maps, bool int8, float grad_scale, float b1, float b2,
                                             float eps, float lr, float bc1, float bc2) {
  const Chunk c = chunks[blockIdx.x];
  const AdamWLowMemTensorDev t = tensors[c.tensor];
  const Scalars s{grad_scale, b1, b2, eps, am::factors(lr, t.weight_decay, bc1, bc2)};
  const int64_t end = min(c.begin + kChunk, t.n);
  if (!int8) return update_bf16(t, c.begin, end, s);
  __shared__ Maps shared;
  shared.m[threadIdx.x] = maps->m[threadIdx.x];
  shared.v[threadIdx.x] = maps->v[threadIdx.x];
  __syncthreads();
  update_int8(t, c.begin, end, s, shared);
}

__global__ void __launch_bounds__(kThreads) lowmem_kernel(const AdamWLowMemTensorDev* tensors, const Chunk* chunks,
                                                          const Maps* maps, bool int8, float lr, float b1, float b2,
                                                          float eps, float bc1, float bc2) {
  update_chunk(tensors, chunks, maps, int8, 1.0f, b1, b2, eps, lr, bc1, bc2);
}

// The same update with its scalars read from device memory when it runs.
__global__ void __launch_bounds__(kThreads) lowmem_device_kernel(const AdamWLowMemTensorDev* tensors,
                                                                 const Chunk* chunks, const Maps* maps, bool int8,
                                                                 float b1, float b2, float eps,
                                                                 const ops::DeviceUpdateScalars* scalars, int group) {
  if (scalars->skip != 0) return;
  const ops::GroupUpdateScalars& g = scalars->group[group];
  update_chunk(tensors, chunks, maps, int8, scalars->grad_scale, b1, b2, eps, g.lr, g.bias_correction1,
               g.bias_correction2);
}

bool same_tensor(const AdamWLowMemTensorDev& a, const AdamWLowMemTensorDev& b) {
  return a.p == b.p && a.g == b.g && a.m == b.m && a.v == b.v && a.m_absmax == b.m_absmax &&
         a.v_absmax == b.v_absmax && a.n == b.n && a.weight_decay == b.weight_decay;
}

}  // namespace

class AdamWLowMemTable {
 public:
  AdamWLowMemTable() = default;
  AdamWLowMemTable(const AdamWLowMemTable&) = delete;
  AdamWLowMemTable& operator=(const AdamWLowMemTable&) = delete;
  // Errors ignored: a table destroyed at exit may outlive the CUDA context.
  ~AdamWLowMemTable() {
    for (void* p : {static_cast<void*>(tensors), static_cast<void*>(chunks), static_cast<void*>(maps)})
      if (p) (void)cudaFree(p);
  }

  std::vector<AdamWLowMemTensorDev> host;
  AdamWLowMemTensorDev* tensors = nullptr;
  Chunk* chunks = nullptr;
  Maps* maps = nullptr;
  int64_t chunk_count = 0;

  void update(const AdamWLowMemTensorDev* list, int64_t count) {
    bool same = static_cast<int64_t>(host.size()) == count;
    for (int64_t i = 0; same && i < count; ++i) same = same_tensor(host[static_cast<size_t>(i)], list[i]);
    if (same) return;
    host.assign(list, list + count);
    std::vector<Chunk> host_chunks;
    for (int64_t i = 0; i < count; ++i)
      for (int64_t b = 0; b < list[i].n; b += kChunk) host_chunks.push_back({static_cast<int32_t>(i), b});
    // Rebuilt rarely (the first step): plain allocation and copies, ordered with the stream.
    bump_capture_generation();  // graphs captured with the old table must not run again
    if (!maps) {
      Maps host_maps;
      for (int c = 0; c < 256; ++c)
        host_maps.m[c] = ops::signed_dynamic_map()[c], host_maps.v[c] = ops::unsigned_dynamic_map()[c];
      check(cudaMalloc(&maps, sizeof(Maps)), "adamw_lowmem", "cudaMalloc");
      check(cudaMemcpy(maps, &host_maps, sizeof(Maps), cudaMemcpyHostToDevice), "adamw_lowmem", "cudaMemcpy");
    }
    if (tensors) check(cudaFree(tensors), "adamw_lowmem", "cudaFree");
    if (chunks) check(cudaFree(chunks), "adamw_lowmem", "cudaFree");
    tensors = nullptr, chunks = nullptr;
    chunk_count = static_cast<int64_t>(host_chunks.size());
    if (chunk_count == 0) return;
    check(cudaMalloc(&tensors, sizeof(AdamWLowMemTensorDev) * host.size()), "adamw_lowmem", "cudaMalloc");
    check(cudaMalloc(&chunks, sizeof(Chunk) * host_chunks.size()), "adamw_lowmem", "cudaMalloc");
    check(cudaMemcpy(tensors, host.data(), sizeof(AdamWLowMemTensorDev) * host.size(), cudaMemcpyHostToDevice),
          "adamw_lowmem", "cudaMemcpy");
    check(cudaMemcpy(chunks, host_chunks.data(), sizeof(Chunk) * host_chunks.size(), cudaMemcpyHostToDevice),
          "adamw_lowmem", "cudaMemcpy");
  }
};

std::shared_ptr<AdamWLowMemTable> make_adamw_lowmem_table() { return std::make_shared<AdamWLowMemTable>(); }

void adamw_lowmem_update_many(const ExecContext& ctx, AdamWLowMemTable& table, bool int8, const AdamWLowMemTensorDev* tensors, int64_t count,
                              float lr, float beta1, float beta2, float eps, float bc1, float bc2) {
  table.update(tensors, count);
  if (table.chunk_count == 0) return;
  KILN_CHECK(table.chunk_count <= 0x7fffffff, "adamw_lowmem", "{} chunks exceed the grid", table.chunk_count);
  lowmem_kernel<<<static_cast<unsigned>(table.chunk_count), kThreads, 0, stream(ctx)>>>(
      table.tensors, table.chunks, table.maps, int8, lr, beta1, beta2, eps, bc1, bc2);
  check_launch("adamw_lowmem", "lowmem_kernel");
}

void adamw_lowmem_update_many_device(const ExecContext& ctx, AdamWLowMemTable& table, bool int8, const AdamWLowMemTensorDev* tensors,
                                     int64_t count, float beta1, float beta2, float eps,
                                     const ops::DeviceUpdateScalars* scalars, int group) {
  KILN_CHECK(group >= 0 && group < ops::kMaxUpdateGroups, "adamw_lowmem", "update group {} out of range", group);
  table.update(tensors, count);
  if (table.chunk_count == 0) return;
  KILN_CHECK(table.chunk_count <= 0x7fffffff, "adamw_lowmem", "{} chunks exceed the grid", table.chunk_count);
  lowmem_device_kernel<<<static_cast<unsigned>(table.chunk_count), kThreads, 0, stream(ctx)>>>(
      table.tensors, table.chunks, table.maps, int8, beta1, beta2, eps, scalars, group);
  check_launch("adamw_lowmem", "lowmem_device_kernel");
}

}  // namespace kiln::cuda
