// Muon's update (ops/optim/muon.h): validation, the CPU reference and the GPU dispatch.
// This file is compiled with -ffp-contract=off (src/CMakeLists.txt): the momentum of the
// f32 reference is each product and sum rounded on its own, the bits of the GPU kernels'
// explicit intrinsics (x86-64-v3 has FMA, and GCC contracts a * b + c by default).
#include "ops/optim/muon.h"

#include "core/device_memory.h"
#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/linear/linear.h"
#include "ops/optim/muon_cuda.h"
#include "ops/optim/stochastic_round.h"

#if KILN_WITH_CUDA
#include "core/step_graphs.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <type_traits>
#include <utility>

namespace kiln::ops {

namespace {

constexpr const char* kOp = "muon";

// ---- CPU reference -------------------------------------------------------------------------

// The iteration on x [rows, cols] (normalized here, in place) with scratch y (rows x cols)
// and a, b (min(rows, cols)^2 each); returns the buffer holding the result (x or y). The
// norm is summed in double in index order and applied as one factor in T.
template <typename T>
T* newton_schulz_cpu(T* x, T* y, T* a, T* b, int64_t rows, int64_t cols, int steps, double eps) {
  const int64_t count = rows * cols;
  double ss = 0;
  for (int64_t i = 0; i < count; ++i) ss += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  const T inv = static_cast<T>(1.0 / (std::sqrt(ss) + eps));
  for (int64_t i = 0; i < count; ++i) x[i] *= inv;
  const T ka = static_cast<T>(kNewtonSchulzA), kb = static_cast<T>(kNewtonSchulzB),
          kc = static_cast<T>(kNewtonSchulzC);
  const bool wide = rows <= cols;
  const int64_t n = wide ? rows : cols;
  const size_t gram_bytes = sizeof(T) * static_cast<size_t>(n * n), x_bytes = sizeof(T) * static_cast<size_t>(count);
  for (int s = 0; s < steps; ++s) {
    if (wide)
      cpu_gemm<T>(false, true, n, n, cols, T(1), x, cols, x, cols, T(0), a, n);  // A = X X^T
    else
      cpu_gemm<T>(true, false, n, n, rows, T(1), x, cols, x, cols, T(0), a, n);  // A = X^T X
    std::memcpy(b, a, gram_bytes);
    cpu_gemm<T>(false, false, n, n, n, kc, a, n, a, n, kb, b, n);  // B = b A + c A A
    std::memcpy(y, x, x_bytes);
    if (wide)
      cpu_gemm<T>(false, false, rows, cols, rows, T(1), b, n, x, cols, ka, y, cols);  // X' = a X + B X
    else
      cpu_gemm<T>(false, false, rows, cols, cols, T(1), x, cols, b, n, ka, y, cols);  // X' = a X + X B
    std::swap(x, y);
  }
  return x;
}

// One matrix's update in T, with scratch of 2 rows x cols + 2 min(rows, cols)^2 elements.
template <typename T>
void muon_matrix_cpu(const MuonMatrix& mm, const MuonSettings& s, double lr, double grad_scale, int64_t update,
                     T* scratch) {
  const int64_t rows = mm.param.size(0), cols = mm.param.size(1), count = rows * cols;
  const int64_t n = std::min(rows, cols);
  const T* g = mm.grad.data<T>();
  T* m = mm.momentum.data<T>();
  T* u = scratch;
  const T mu = static_cast<T>(s.momentum), one_minus_mu = static_cast<T>(1.0 - s.momentum);
  const T gs = static_cast<T>(grad_scale);
  const bool ema = s.ema, nesterov = s.nesterov;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    const T gi = g[i] * gs;
    const T mi = ema ? mu * m[i] + one_minus_mu * gi : mu * m[i] + gi;
    m[i] = mi;
    u[i] = !nesterov ? mi : ema ? one_minus_mu * gi + mu * mi : gi + mu * mi;
  }
  const T* x = newton_schulz_cpu<T>(u, u + count, u + 2 * count, u + 2 * count + n * n, rows, cols, s.ns_steps,
                                    s.ns_eps);
  const T decay = static_cast<T>(1.0 - lr * mm.weight_decay);
  const T step = static_cast<T>(lr * mm.update_scale);
  if constexpr (std::is_same_v<T, float>) {
    if (mm.param.dtype() == DType::bf16) {  // a bf16 master: fp32 arithmetic, stochastic rounding
      auto* p16 = static_cast<uint16_t*>(mm.param.raw());
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < count; ++i)
        p16[i] = stochastic_round_bf16(bf16_bits_to_float(p16[i]) * decay - step * x[i],
                                       rounding_bits(mm.rounding_stream, static_cast<uint64_t>(update),
                                                     static_cast<uint64_t>(i)));
      return;
    }
  }
  T* p = mm.param.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) p[i] = p[i] * decay - step * x[i];
}

// ---- GPU layout ----------------------------------------------------------------------------

int64_t padded_slot(int64_t elements) {
  return (elements + cuda::kMuonSlotAlign - 1) / cuda::kMuonSlotAlign * cuda::kMuonSlotAlign;
}
int64_t chunks_of(int64_t n) { return (n + cuda::kMuonChunk - 1) / cuda::kMuonChunk; }
size_t aligned_bytes(size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

#if KILN_WITH_CUDA
bool same_entry(const cuda::MuonMatrixF32& a, const cuda::MuonMatrixF32& b) {
  return a.p == b.p && a.p16 == b.p16 && a.stream == b.stream && a.g == b.g && a.m == b.m && a.n == b.n && a.weight_decay == b.weight_decay &&
         a.update_scale == b.update_scale && a.x == b.x && a.x_final == b.x_final && a.first_chunk == b.first_chunk &&
         a.chunk_count == b.chunk_count;
}
#endif

}  // namespace

struct MuonUpdate::State {
  MuonSettings settings;
  std::vector<Shape> shapes;
  Device device;

  // CPU: scratch for the largest matrix, sized at the first step of each dtype.
  size_t scratch_elements = 0;
  std::vector<float> scratch_f32;
  std::vector<double> scratch_f64;

  // GPU: the table's order (matrices grouped by shape, in order of first appearance, each
  // group cut into batches), chunk ranges, workspace size, and the arena tensors.
  struct Batch {
    int64_t rows, cols, first, count;
  };
  std::vector<int64_t> order;        // table entry -> matrix index
  std::vector<int64_t> first_chunk;  // per table entry
  std::vector<Batch> batches;
  int64_t chunk_count = 0;
  size_t workspace_bytes = 0;
  Tensor workspace, table, chunks, partials;
  bool planned = false;
  std::vector<cuda::MuonBatchF32> device_batches;  // the batches with their workspace slots
  std::vector<cuda::MuonMatrixF32> host_table, uploaded;
  bool chunks_uploaded = false;

  // The GPU update of checked matrices with these scalars (both step forms).
  void run_on_device(const ExecContext& ctx, const std::vector<MuonMatrix>& matrices, const cuda::MuonScalars& scalars);

  size_t table_bytes() const { return sizeof(cuda::MuonMatrixF32) * order.size(); }
  size_t chunk_bytes() const { return sizeof(cuda::MuonChunk) * static_cast<size_t>(chunk_count); }
};

MuonUpdate::MuonUpdate(MuonSettings settings, std::vector<Shape> shapes, Device device)
    : state_(std::make_unique<State>()) {
  State& st = *state_;
  KILN_CHECK(settings.momentum >= 0 && settings.momentum < 1, kOp, "momentum must be in [0, 1), got {}",
             settings.momentum);
  KILN_CHECK(settings.ns_steps >= 0, kOp, "ns_steps must be >= 0, got {}", settings.ns_steps);
  KILN_CHECK(settings.ns_eps > 0, kOp, "ns_eps must be > 0, got {}", settings.ns_eps);
  for (size_t i = 0; i < shapes.size(); ++i)
    KILN_CHECK(shapes[i].rank() == 2 && shapes[i][0] > 0 && shapes[i][1] > 0, kOp,
               "matrix {} must be a non-empty [rows, cols], got {}", i, shapes[i].str());
  st.settings = settings;
  st.shapes = std::move(shapes);
  st.device = device;
  for (const Shape& s : st.shapes) {
    const int64_t n = std::min(s[0], s[1]);
    st.scratch_elements = std::max(st.scratch_elements, static_cast<size_t>(2 * s[0] * s[1] + 2 * n * n));
  }
  if (device != Device::cuda) return;

  // Buckets by shape in order of first appearance; each cut into batches of at most
  // batch_capacity matrices, consecutive in the table.
  std::vector<std::pair<int64_t, int64_t>> keys;
  std::map<std::pair<int64_t, int64_t>, std::vector<int64_t>> buckets;
  for (size_t i = 0; i < st.shapes.size(); ++i) {
    const std::pair<int64_t, int64_t> key{st.shapes[i][0], st.shapes[i][1]};
    auto& members = buckets[key];
    if (members.empty()) keys.push_back(key);
    members.push_back(static_cast<int64_t>(i));
  }
  for (const auto& key : keys) {
    const std::vector<int64_t>& members = buckets[key];
    const int64_t cap = batch_capacity(key.first, key.second);
    for (size_t begin = 0; begin < members.size(); begin += static_cast<size_t>(cap)) {
      const int64_t count = std::min<int64_t>(cap, static_cast<int64_t>(members.size() - begin));
      st.batches.push_back({key.first, key.second, static_cast<int64_t>(st.order.size()), count});
      st.workspace_bytes = std::max(st.workspace_bytes, batch_workspace_bytes(key.first, key.second, count));
      for (int64_t j = 0; j < count; ++j) {
        st.order.push_back(members[begin + static_cast<size_t>(j)]);
        st.first_chunk.push_back(st.chunk_count);
        st.chunk_count += chunks_of(key.first * key.second);
      }
    }
  }
}

MuonUpdate::~MuonUpdate() = default;
MuonUpdate::MuonUpdate(MuonUpdate&&) noexcept = default;
MuonUpdate& MuonUpdate::operator=(MuonUpdate&&) noexcept = default;

const MuonSettings& MuonUpdate::settings() const { return state_->settings; }
const std::vector<Shape>& MuonUpdate::shapes() const { return state_->shapes; }

size_t MuonUpdate::batch_workspace_bytes(int64_t rows, int64_t cols, int64_t count) {
  const int64_t n = std::min(rows, cols);
  return static_cast<size_t>(count) * 2 * static_cast<size_t>(2 * padded_slot(rows * cols) + 2 * padded_slot(n * n));
}

int64_t MuonUpdate::batch_capacity(int64_t rows, int64_t cols) {
  const size_t one = batch_workspace_bytes(rows, cols, 1);
  return std::clamp<int64_t>(static_cast<int64_t>(kMuonMaxBatchBytes / one), 1, kMuonMaxBatchMatrices);
}

size_t MuonUpdate::planned_bytes() const {
  const State& st = *state_;
  if (st.device != Device::cuda || st.order.empty()) return 0;
  return aligned_bytes(st.workspace_bytes) + aligned_bytes(st.table_bytes()) + aligned_bytes(st.chunk_bytes()) +
         aligned_bytes(sizeof(float) * static_cast<size_t>(st.chunk_count));
}

void MuonUpdate::plan(Arena& arena) {
  State& st = *state_;
  KILN_CHECK(!st.planned, kOp, "planned twice");
  KILN_CHECK(arena.device() == st.device, kOp, "the arena is on {}, the update on {}", device_name(arena.device()),
             device_name(st.device));
  st.planned = true;
  if (st.device != Device::cuda || st.order.empty()) return;
  // Byte buffers as 8-byte elements (the arena aligns each to 256 bytes).
  auto words = [](size_t bytes) { return static_cast<int64_t>((bytes + 7) / 8); };
  arena.reserve(st.workspace, DType::i64, Shape{words(st.workspace_bytes)});
  arena.reserve(st.table, DType::i64, Shape{words(st.table_bytes())});
  arena.reserve(st.chunks, DType::i64, Shape{words(st.chunk_bytes())});
  arena.reserve(st.partials, DType::f32, Shape{st.chunk_count});
}

namespace {

// Checks one matrix against its planned shape and the update's device (and, on the GPU, fp32).
void check_matrix(const MuonMatrix& mm, size_t i, const Shape& shape, Device device) {
  KILN_CHECK(mm.param.defined(), kOp, "matrix {}: param is undefined", i);
  KILN_CHECK(mm.param.shape() == shape, kOp, "matrix {}: param must be {}, got {}", i, shape.str(),
             mm.param.describe());
  KILN_CHECK(mm.param.device() == device, kOp, "matrix {}: the update runs on {}, param is {}", i, device_name(device),
             mm.param.describe());
  // A bf16 param is a bf16 master (optim.master_weights): its grad and momentum are fp32.
  if (mm.param.dtype() == DType::bf16) {
    expect_tensor(kOp, "grad", mm.grad, shape, DType::f32, device);
    expect_tensor(kOp, "momentum", mm.momentum, shape, DType::f32, device);
  } else {
    expect_same(kOp, "grad", mm.grad, mm.param);
    expect_same(kOp, "momentum", mm.momentum, mm.param);
  }
  KILN_CHECK(mm.grad.shape() == shape && mm.momentum.shape() == shape, kOp,
             "matrix {}: shape mismatch: param {}, grad {}, momentum {}", i, mm.param.describe(), mm.grad.describe(),
             mm.momentum.describe());
  if (device == Device::cuda) expect_dtype(kOp, "grad", mm.grad, DType::f32);
}

}  // namespace

void MuonUpdate::step(const ExecContext& ctx, const std::vector<MuonMatrix>& matrices, double lr, double grad_scale,
                      int64_t update) {
  State& st = *state_;
  KILN_CHECK(matrices.size() == st.shapes.size(), kOp, "{} matrices given, {} planned", matrices.size(),
             st.shapes.size());
  if (matrices.empty()) return;
  KILN_OP_SCOPE(kOp, matrices.front().param);
  for (size_t i = 0; i < matrices.size(); ++i) check_matrix(matrices[i], i, st.shapes[i], st.device);
  if (st.device == Device::cuda) {
    cuda::MuonScalars scalars;
    scalars.lr = static_cast<float>(lr);
    scalars.grad_scale = static_cast<float>(grad_scale);
    scalars.update = static_cast<uint32_t>(update);
    st.run_on_device(ctx, matrices, scalars);
    return;
  }
  for (const MuonMatrix& mm : matrices) {
    dispatch_cpu_float(kOp, mm.grad.dtype(), [&](auto zero) {
      using T = decltype(zero);
      std::vector<T>& scratch = [&]() -> std::vector<T>& {
        if constexpr (std::is_same_v<T, float>) return st.scratch_f32;
        else return st.scratch_f64;
      }();
      if (scratch.size() < st.scratch_elements) scratch.resize(st.scratch_elements);  // once per dtype
      muon_matrix_cpu<T>(mm, st.settings, lr, grad_scale, update, scratch.data());
    });
  }
}

void MuonUpdate::step_on_device(const ExecContext& ctx, const std::vector<MuonMatrix>& matrices,
                                const DeviceUpdateScalars* scalars, int group) {
  State& st = *state_;
  KILN_CHECK(st.device == Device::cuda, kOp, "scalars in device memory need a GPU update");
  KILN_CHECK(scalars != nullptr, kOp, "no device scalars");
  KILN_CHECK(group >= 0 && group < kMaxUpdateGroups, kOp, "update group {} out of range [0, {})", group,
             kMaxUpdateGroups);
  KILN_CHECK(matrices.size() == st.shapes.size(), kOp, "{} matrices given, {} planned", matrices.size(),
             st.shapes.size());
  if (matrices.empty()) return;
  KILN_OP_SCOPE(kOp, matrices.front().param);
  for (size_t i = 0; i < matrices.size(); ++i) check_matrix(matrices[i], i, st.shapes[i], st.device);
  cuda::MuonScalars device_scalars;
  device_scalars.device = scalars;
  device_scalars.group = group;
  st.run_on_device(ctx, matrices, device_scalars);
}

void MuonUpdate::State::run_on_device(const ExecContext& ctx, const std::vector<MuonMatrix>& matrices, const cuda::MuonScalars& scalars) {
#if KILN_WITH_CUDA
  State& st = *this;
  KILN_CHECK(st.planned && st.workspace.defined(), kOp,
             "the GPU update needs plan(arena) and the arena allocated before its first step");
  const MuonSettings& s = st.settings;
  const cuda::MuonKernelSettings ks{static_cast<float>(s.momentum), static_cast<float>(1.0 - s.momentum),
                                    static_cast<float>(s.ns_eps), s.nesterov ? 1 : 0, s.ema ? 1 : 0, s.ns_steps};
  // The batches' workspace slots: x0, x1, a, b, each `count` slots, from the workspace start.
  auto* base = static_cast<cuda::bf16_bits*>(st.workspace.raw());
  std::vector<cuda::MuonBatchF32>& batches = st.device_batches;
  if (batches.empty()) {
    for (const State::Batch& b : st.batches) {
      const int64_t n = std::min(b.rows, b.cols);
      cuda::MuonBatchF32 d{};
      d.rows = b.rows, d.cols = b.cols, d.first = b.first, d.count = b.count;
      d.chunk_begin = st.first_chunk[static_cast<size_t>(b.first)];
      d.chunk_end = b.first + b.count < static_cast<int64_t>(st.order.size())
                        ? st.first_chunk[static_cast<size_t>(b.first + b.count)]
                        : st.chunk_count;
      d.stride_x = padded_slot(b.rows * b.cols);
      d.stride_a = padded_slot(n * n);
      d.x0 = base;
      d.x1 = d.x0 + b.count * d.stride_x;
      d.a = d.x1 + b.count * d.stride_x;
      d.b = d.a + b.count * d.stride_a;
      batches.push_back(d);
    }
  }
  // The device table, rewritten only when a pointer or setting of the list changes.
  st.host_table.resize(st.order.size());
  for (const cuda::MuonBatchF32& b : batches) {
    for (int64_t j = 0; j < b.count; ++j) {
      const size_t e = static_cast<size_t>(b.first + j);
      const MuonMatrix& mm = matrices[static_cast<size_t>(st.order[e])];
      cuda::MuonMatrixF32& t = st.host_table[e];
      const bool bf16_master = mm.param.dtype() == DType::bf16;
      t.p = bf16_master ? nullptr : mm.param.data<float>();
      t.p16 = bf16_master ? static_cast<cuda::bf16_bits*>(mm.param.raw()) : nullptr;
      t.stream = mm.rounding_stream;
      t.g = mm.grad.data<float>();
      t.m = mm.momentum.data<float>();
      t.n = b.rows * b.cols;
      t.weight_decay = static_cast<float>(mm.weight_decay);
      t.update_scale = static_cast<float>(mm.update_scale);
      t.x = b.x0 + j * b.stride_x;
      t.x_final = (s.ns_steps % 2 ? b.x1 : b.x0) + j * b.stride_x;
      t.first_chunk = st.first_chunk[e];
      t.chunk_count = chunks_of(t.n);
    }
  }
  bool same = st.uploaded.size() == st.host_table.size();
  for (size_t i = 0; same && i < st.host_table.size(); ++i) same = same_entry(st.host_table[i], st.uploaded[i]);
  if (!same || !st.chunks_uploaded) {
    // Ordered on the context's stream behind any update still reading the old table; from pageable
    // memory, staged before the call returns. Graphs captured with the old contents must
    // not run again.
    if (!st.chunks_uploaded) {
      std::vector<cuda::MuonChunk> chunks;
      chunks.reserve(static_cast<size_t>(st.chunk_count));
      for (size_t e = 0; e < st.order.size(); ++e)
        for (int64_t begin = 0; begin < st.host_table[e].n; begin += cuda::kMuonChunk)
          chunks.push_back({static_cast<int64_t>(e), begin});
      copy_to_device_async(ctx, st.chunks.raw(), chunks.data(), st.chunk_bytes());
      st.chunks_uploaded = true;
    }
    copy_to_device_async(ctx, st.table.raw(), st.host_table.data(), st.table_bytes());
    st.uploaded = st.host_table;
    cuda::bump_capture_generation();
  }
  const cuda::MuonDeviceTable table{static_cast<const cuda::MuonMatrixF32*>(st.table.raw()),
                                    static_cast<const cuda::MuonChunk*>(st.chunks.raw()),
                                    st.partials.data<float>(), st.chunk_count};
  cuda::muon_momentum_f32(ctx, table, ks, scalars);
  for (const cuda::MuonBatchF32& b : batches) cuda::muon_orthogonalize_apply_f32(ctx, table, b, ks, scalars);
#else
  (void)ctx, (void)matrices, (void)scalars;
  no_cuda_kernel(kOp);
#endif
}

void newton_schulz(const ExecContext& ctx, const Tensor& x, int steps, double eps) {
  const char* op = "newton_schulz";
  expect_rank(op, "x", x, 2);
  KILN_CHECK(steps >= 0, op, "steps must be >= 0, got {}", steps);
  KILN_CHECK(eps > 0, op, "eps must be > 0, got {}", eps);
  KILN_OP_SCOPE(op, x);
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
  if (x.device() == Device::cuda) {
#if KILN_WITH_CUDA
    expect_dtype(op, "x", x, DType::f32);
    Storage workspace(Device::cuda, cuda::newton_schulz_workspace_bytes(rows, cols));
    cuda::newton_schulz_f32(ctx, x.data<float>(), rows, cols, steps, static_cast<float>(eps), workspace.data());
    synchronize_stream(ctx);  // the workspace is freed on return
    return;
#else
    no_cuda_kernel(op);
#endif
  }
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t count = rows * cols, n = std::min(rows, cols);
    std::vector<T> scratch(static_cast<size_t>(count + 2 * n * n));
    T* data = x.data<T>();
    const T* out = newton_schulz_cpu<T>(data, scratch.data(), scratch.data() + count, scratch.data() + count + n * n,
                                        rows, cols, steps, eps);
    if (out != data) std::memcpy(data, out, sizeof(T) * static_cast<size_t>(count));
  });
}

}  // namespace kiln::ops
