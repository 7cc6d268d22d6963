// CUTLASS's Hopper grouped GEMM for the experts (grouped_gemm_sm90.h). Built only where
// CMake found CUTLASS and targets sm_90a (KILN_CUTLASS_SM90); elsewhere the functions
// below say they are unavailable and grouped_gemm_cuda.cu takes its portable kernel.
//
// The kernel: CUTLASS 3's grouped GEMM (GemmUniversal over a GroupProblemShape, the
// pointer-array TMA warp-specialized cooperative mainloop and epilogue), 128 x 128 x 64
// tiles on 1 x 1 x 1 clusters, bf16 operands, fp32 accumulation. The problem sizes live in
// device memory only (no host copy is passed), so the persistent grid is sized by the SM
// count and each block takes tiles from the group tile scheduler, rebuilding its TMA
// descriptors on the device when it moves to another expert. In CUTLASS's terms
// (D = A B, A [M, K], B [K, N]) with kiln's row-major buffers:
//   forward       A = x_e RowMajor,     B = W_e^T ColumnMajor (K-major), D = y_e bf16
//   input grad    A = dy_e RowMajor,    B = W_e RowMajor (N-major),      D = dx_e bf16
//   weight grad   A = dy_e^T ColumnMajor (M-major), B = x_e RowMajor,    C = D = dW_e fp32, beta 1
// An expert without rows is an empty problem (M = 0): no tiles, nothing written (for the
// weight gradient, whose K is the rows, this keeps dW_e as it was; K = 0 tiles would
// write uninitialized accumulators).
#include "ops/moe/grouped_gemm_sm90.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"

#if KILN_CUTLASS_SM90
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include <map>
#include <memory>
#include <tuple>
#include <vector>
#endif

namespace kiln::cuda::sm90 {

#if KILN_CUTLASS_SM90

namespace {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per expert
using Problem = ProblemShape::UnderlyingProblemShape;
using Bf16 = cutlass::bfloat16_t;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// One grouped GEMM type: operand layouts, C's element (void: no source) and D's.
template <class LayoutA, class LayoutB, class ElementC_, class ElementD_>
struct Grouped {
  using ElementC = ElementC_;
  using ElementD = ElementD_;
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<Bf16>::value;       // 16 bytes: TMA
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, RowMajor*, kAlignD, ElementD,
      RowMajor*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, kAlignAB, Bf16, LayoutB*, kAlignAB, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
};

using Forward = Grouped<RowMajor, ColumnMajor, void, Bf16>;
using InputGrad = Grouped<RowMajor, RowMajor, void, Bf16>;
using WeightGrad = Grouped<ColumnMajor, RowMajor, float, float>;

// A packed row- or column-major stride: its one dynamic mode (of M/N and K) is `ld`.
template <class Stride>
Stride leading(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<0>(s))>>) cute::get<1>(s) = ld;
  else cute::get<0>(s) = ld;
  return s;
}

// The device arrays the kernel reads, the kernel's parameters and its workspace: made once
// per (product, experts, widths), then only the problems and addresses change per call.
template <class G>
struct Plan {
  int64_t experts = 0;
  Problem* problems = nullptr;                             // [E]
  const Bf16** a = nullptr;                                // [E]
  const Bf16** b = nullptr;                                // [E]
  const typename G::ElementC** c = nullptr;                // [E] (unused when C is void)
  typename G::ElementD** d = nullptr;                      // [E]
  void* storage = nullptr;                                 // all of the above and the strides
  void* workspace = nullptr;
  typename G::Gemm gemm;

  Plan(const ExecContext& ctx, int64_t e, int64_t lda, int64_t ldb, int64_t ldd, float beta) : experts(e) {
    const char* op = "moe_grouped_linear";
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(stream(ctx), &capture), op, "cudaStreamIsCapturing");
    KILN_CHECK(capture == cudaStreamCaptureStatusNone, op,
               "the grouped GEMM's first call for these shapes is inside a CUDA graph capture (run the step once "
               "before capturing)");
    using SA = typename G::StrideA;
    using SB = typename G::StrideB;
    using SC = typename G::StrideC;
    using SD = typename G::StrideD;
    const size_t n = static_cast<size_t>(e);
    // One allocation: problems, four pointer arrays, four stride arrays.
    size_t bytes = 0;
    auto place = [&](size_t size) {
      const size_t at = (bytes + 15) / 16 * 16;
      bytes = at + size;
      return at;
    };
    const size_t at_problems = place(n * sizeof(Problem)), at_a = place(n * sizeof(void*)),
                 at_b = place(n * sizeof(void*)), at_c = place(n * sizeof(void*)), at_d = place(n * sizeof(void*));
    const size_t at_sa = place(n * sizeof(SA)), at_sb = place(n * sizeof(SB)), at_sc = place(n * sizeof(SC)),
                 at_sd = place(n * sizeof(SD));
    check(cudaMalloc(&storage, bytes), op, "cudaMalloc grouped GEMM arrays");
    char* base = static_cast<char*>(storage);
    problems = reinterpret_cast<Problem*>(base + at_problems);
    a = reinterpret_cast<const Bf16**>(base + at_a);
    b = reinterpret_cast<const Bf16**>(base + at_b);
    c = reinterpret_cast<const typename G::ElementC**>(base + at_c);
    d = reinterpret_cast<typename G::ElementD**>(base + at_d);
    auto* sa = reinterpret_cast<SA*>(base + at_sa);
    auto* sb = reinterpret_cast<SB*>(base + at_sb);
    auto* sc = reinterpret_cast<SC*>(base + at_sc);
    auto* sd = reinterpret_cast<SD*>(base + at_sd);
    // Every expert's operands have the same widths: one stride each, repeated.
    const std::vector<SA> host_sa(n, leading<SA>(lda));
    const std::vector<SB> host_sb(n, leading<SB>(ldb));
    const std::vector<SC> host_sc(n, leading<SC>(ldd));
    const std::vector<SD> host_sd(n, leading<SD>(ldd));
    check(cudaMemcpy(sa, host_sa.data(), n * sizeof(SA), cudaMemcpyHostToDevice), op, "copy strides");
    check(cudaMemcpy(sb, host_sb.data(), n * sizeof(SB), cudaMemcpyHostToDevice), op, "copy strides");
    check(cudaMemcpy(sc, host_sc.data(), n * sizeof(SC), cudaMemcpyHostToDevice), op, "copy strides");
    check(cudaMemcpy(sd, host_sd.data(), n * sizeof(SD), cudaMemcpyHostToDevice), op, "copy strides");

    cutlass::KernelHardwareInfo hw;
    check(cudaGetDevice(&hw.device_id), op, "cudaGetDevice");
    hw.sm_count = sm_count();
    typename G::Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {static_cast<int>(e), problems, nullptr};  // sizes on the device only
    args.mainloop = {a, sa, b, sb};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = beta;
    if constexpr (cute::is_void_v<typename G::ElementC>) {
      args.epilogue.ptr_C = nullptr;
      args.epilogue.dC = nullptr;
    } else {
      args.epilogue.ptr_C = c;
      args.epilogue.dC = sc;
    }
    args.epilogue.ptr_D = d;
    args.epilogue.dD = sd;
    args.hw_info = hw;
    const cutlass::Status ok = gemm.can_implement(args);
    KILN_CHECK(ok == cutlass::Status::kSuccess, op, "CUTLASS cannot run this grouped GEMM: {}",
               cutlassGetStatusString(ok));
    const size_t workspace_bytes = G::Gemm::get_workspace_size(args);
    if (workspace_bytes > 0) check(cudaMalloc(&workspace, workspace_bytes), op, "cudaMalloc CUTLASS workspace");
    const cutlass::Status init = gemm.initialize(args, workspace, stream(ctx));
    KILN_CHECK(init == cutlass::Status::kSuccess, op, "CUTLASS initialize: {}", cutlassGetStatusString(init));
  }

  void run(const ExecContext& ctx) {
    const cutlass::Status status = gemm.run(stream(ctx));
    KILN_CHECK(status == cutlass::Status::kSuccess, "moe_grouped_linear", "CUTLASS run: {}",
               cutlassGetStatusString(status));
    check_launch("moe_grouped_linear", "CUTLASS grouped GEMM");
  }
};

// The plan of a product for these sizes on the context's stream, made on first use: a
// plan's device arrays are rewritten by every call, so two streams never share one. Plans
// live as long as the process (the kernels' parameters point into their arrays).
template <class G>
Plan<G>& plan_for(const ExecContext& ctx, int64_t experts, int64_t lda, int64_t ldb, int64_t ldd, float beta) {
  static std::map<std::tuple<cudaStream_t, int64_t, int64_t, int64_t, int64_t>, std::unique_ptr<Plan<G>>> plans;
  auto& plan = plans[{stream(ctx), experts, lda, ldb, ldd}];
  if (!plan) plan = std::make_unique<Plan<G>>(ctx, experts, lda, ldb, ldd, beta);
  return *plan;
}

// Expert e's problem and operands from the offsets (one thread per expert).
__global__ void forward_problems(const int32_t* __restrict__ offsets, int64_t experts, int64_t in, int64_t out,
                                 const Bf16* x, const Bf16* w, Bf16* y, Problem* problems, const Bf16** a,
                                 const Bf16** b, Bf16** d) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= experts) return;
  const int64_t first = offsets[e], rows = offsets[e + 1] - first;
  problems[e] = cute::make_shape(static_cast<int>(rows), static_cast<int>(out), static_cast<int>(in));
  a[e] = x + first * in;
  b[e] = w + e * out * in;
  d[e] = y + first * out;
}

__global__ void input_grad_problems(const int32_t* __restrict__ offsets, int64_t experts, int64_t in, int64_t out,
                                    const Bf16* dy, const Bf16* w, Bf16* dx, Problem* problems, const Bf16** a,
                                    const Bf16** b, Bf16** d) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= experts) return;
  const int64_t first = offsets[e], rows = offsets[e + 1] - first;
  problems[e] = cute::make_shape(static_cast<int>(rows), static_cast<int>(in), static_cast<int>(out));
  a[e] = dy + first * out;
  b[e] = w + e * out * in;
  d[e] = dx + first * in;
}

__global__ void weight_grad_problems(const int32_t* __restrict__ offsets, int64_t experts, int64_t in, int64_t out,
                                     const Bf16* x, const Bf16* dy, float* dw, Problem* problems, const Bf16** a,
                                     const Bf16** b, const float** c, float** d) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= experts) return;
  const int64_t first = offsets[e], rows = offsets[e + 1] - first;
  // No rows: no tiles at all (M = 0), so dW_e stays as it is.
  problems[e] = cute::make_shape(rows > 0 ? static_cast<int>(out) : 0, static_cast<int>(in), static_cast<int>(rows));
  a[e] = dy + first * out;
  b[e] = x + first * in;
  c[e] = dw + e * out * in;
  d[e] = dw + e * out * in;
}

constexpr int kProblemThreads = 128;

unsigned problem_blocks(int64_t experts) {
  return static_cast<unsigned>((experts + kProblemThreads - 1) / kProblemThreads);
}

bool device_is_sm90() {
  static const bool sm90 = [] {
    int device = 0, major = 0, minor = 0;
    check(cudaGetDevice(&device), "moe_grouped_linear", "cudaGetDevice");
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "moe_grouped_linear",
          "compute capability");
    check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "moe_grouped_linear",
          "compute capability");
    return major == 9 && minor == 0;  // sm_90a code runs on compute capability 9.0 only
  }();
  return sm90;
}

const Bf16* as_cutlass(const bf16_bits* p) { return reinterpret_cast<const Bf16*>(p); }
Bf16* as_cutlass(bf16_bits* p) { return reinterpret_cast<Bf16*>(p); }

}  // namespace

bool grouped_gemm_available() { return device_is_sm90(); }

void grouped_forward(const ExecContext& ctx, const bf16_bits* x, const bf16_bits* w, const int32_t* offsets, int64_t experts, int64_t in,
                     int64_t out, bf16_bits* y) {
  Plan<Forward>& plan = plan_for<Forward>(ctx, experts, in, in, out, 0.0f);
  forward_problems<<<problem_blocks(experts), kProblemThreads, 0, stream(ctx)>>>(
      offsets, experts, in, out, as_cutlass(x), as_cutlass(w), as_cutlass(y), plan.problems, plan.a, plan.b, plan.d);
  check_launch("moe_grouped_linear", "forward_problems");
  plan.run(ctx);
}

void grouped_backward_input(const ExecContext& ctx, const bf16_bits* dy, const bf16_bits* w, const int32_t* offsets, int64_t experts,
                            int64_t in, int64_t out, bf16_bits* dx) {
  Plan<InputGrad>& plan = plan_for<InputGrad>(ctx, experts, out, in, in, 0.0f);
  input_grad_problems<<<problem_blocks(experts), kProblemThreads, 0, stream(ctx)>>>(
      offsets, experts, in, out, as_cutlass(dy), as_cutlass(w), as_cutlass(dx), plan.problems, plan.a, plan.b,
      plan.d);
  check_launch("moe_grouped_linear_backward", "input_grad_problems");
  plan.run(ctx);
}

void grouped_backward_weight(const ExecContext& ctx, const bf16_bits* x, const bf16_bits* dy, const int32_t* offsets, int64_t experts,
                             int64_t in, int64_t out, float* dw) {
  Plan<WeightGrad>& plan = plan_for<WeightGrad>(ctx, experts, out, in, in, 1.0f);
  weight_grad_problems<<<problem_blocks(experts), kProblemThreads, 0, stream(ctx)>>>(
      offsets, experts, in, out, as_cutlass(x), as_cutlass(dy), dw, plan.problems, plan.a, plan.b, plan.c, plan.d);
  check_launch("moe_grouped_linear_backward", "weight_grad_problems");
  plan.run(ctx);
}

#else  // built without CUTLASS for sm_90a: the portable kernel serves every call

bool grouped_gemm_available() { return false; }

void grouped_forward(const ExecContext&, const bf16_bits*, const bf16_bits*, const int32_t*, int64_t, int64_t, int64_t, bf16_bits*) {
  fail("moe_grouped_linear", "kiln was built without CUTLASS's sm_90a grouped GEMM");
}
void grouped_backward_input(const ExecContext&, const bf16_bits*, const bf16_bits*, const int32_t*, int64_t, int64_t, int64_t,
                            bf16_bits*) {
  fail("moe_grouped_linear_backward", "kiln was built without CUTLASS's sm_90a grouped GEMM");
}
void grouped_backward_weight(const ExecContext&, const bf16_bits*, const bf16_bits*, const int32_t*, int64_t, int64_t, int64_t, float*) {
  fail("moe_grouped_linear_backward", "kiln was built without CUTLASS's sm_90a grouped GEMM");
}

#endif

}  // namespace kiln::cuda::sm90
