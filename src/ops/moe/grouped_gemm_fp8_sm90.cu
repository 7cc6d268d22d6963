// CUTLASS's sm90 ptr-array grouped GEMM with FP8 operands (grouped_gemm_fp8_sm90.h). The
// same persistent, warp-specialized cooperative TMA + WGMMA kernel as the bf16 one
// (grouped_gemm_sm90.cu, 128 x 128 x 64 tiles, cluster 1 x 1), whose collective builder picks
// CUTLASS's FP8 mainloop (MainloopSm90ArrayTmaGmmaWarpSpecializedFP8: accumulators promoted
// to fp32 every 4 MMAs) for 1-byte inputs. Both operands K-major (A RowMajor, B ColumnMajor,
// i.e. B stored [N, K] row-major). The epilogue's alpha is per expert: alpha_ptr with an L
// stride of 1 over a float array the problems kernel writes (alpha[e] = sA * sB_e), so the
// scales stay on the device.
#include "ops/moe/grouped_gemm_fp8_sm90.h"

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

namespace {
constexpr const char* kOp = "moe_grouped_linear_fp8";
}

#if KILN_CUTLASS_SM90

namespace {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per expert
using Problem = ProblemShape::UnderlyingProblemShape;
using Bf16 = cutlass::bfloat16_t;
using E4m3 = cutlass::float_e4m3_t;
using E5m2 = cutlass::float_e5m2_t;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// One FP8 grouped GEMM type: A's and B's formats (A RowMajor, B ColumnMajor: both K-major),
// C's element (void: no source) and D's.
template <class ElementA_, class ElementB_, class ElementC_, class ElementD_>
struct Grouped {
  using ElementA = ElementA_;
  using ElementB = ElementB_;
  using ElementC = ElementC_;
  using ElementD = ElementD_;
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int kAlignAB = 16;  // 16 one-byte codes: TMA's 16 bytes
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, RowMajor*, kAlignD, ElementD,
      RowMajor*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, RowMajor*, kAlignAB, ElementB, ColumnMajor*,
      kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
};

using Forward = Grouped<E4m3, E4m3, void, Bf16>;
using InputGrad = Grouped<E5m2, E4m3, void, Bf16>;
using WeightGrad = Grouped<E5m2, E4m3, float, float>;

// A packed row- or column-major stride: its one dynamic mode (of M/N and K) is `ld`.
template <class Stride>
Stride leading(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<0>(s))>>) cute::get<1>(s) = ld;
  else cute::get<0>(s) = ld;
  return s;
}

// The device arrays the kernel reads (problems, addresses, strides, the experts' alphas),
// its parameters and workspace: made once per (product, stream, experts, widths).
template <class G>
struct Plan {
  int64_t experts = 0;
  Problem* problems = nullptr;                   // [E]
  const typename G::ElementA** a = nullptr;      // [E]
  const typename G::ElementB** b = nullptr;      // [E]
  const typename G::ElementC** c = nullptr;      // [E] (unused when C is void)
  typename G::ElementD** d = nullptr;            // [E]
  float* alpha = nullptr;                        // [E]
  void* storage = nullptr;
  void* workspace = nullptr;
  typename G::Gemm gemm;

  Plan(const ExecContext& ctx, int64_t e, int64_t lda, int64_t ldb, int64_t ldd, float beta) : experts(e) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(stream(ctx), &capture), kOp, "cudaStreamIsCapturing");
    KILN_CHECK(capture == cudaStreamCaptureStatusNone, kOp,
               "the FP8 grouped GEMM's first call for these shapes is inside a CUDA graph capture (run the step "
               "once before capturing)");
    using SA = typename G::StrideA;
    using SB = typename G::StrideB;
    using SC = typename G::StrideC;
    using SD = typename G::StrideD;
    const size_t n = static_cast<size_t>(e);
    size_t bytes = 0;
    auto place = [&](size_t size) {
      const size_t at = (bytes + 15) / 16 * 16;
      bytes = at + size;
      return at;
    };
    const size_t at_problems = place(n * sizeof(Problem)), at_a = place(n * sizeof(void*)),
                 at_b = place(n * sizeof(void*)), at_c = place(n * sizeof(void*)), at_d = place(n * sizeof(void*)),
                 at_alpha = place(n * sizeof(float));
    const size_t at_sa = place(n * sizeof(SA)), at_sb = place(n * sizeof(SB)), at_sc = place(n * sizeof(SC)),
                 at_sd = place(n * sizeof(SD));
    check(cudaMalloc(&storage, bytes), kOp, "cudaMalloc grouped GEMM arrays");
    char* base = static_cast<char*>(storage);
    problems = reinterpret_cast<Problem*>(base + at_problems);
    a = reinterpret_cast<const typename G::ElementA**>(base + at_a);
    b = reinterpret_cast<const typename G::ElementB**>(base + at_b);
    c = reinterpret_cast<const typename G::ElementC**>(base + at_c);
    d = reinterpret_cast<typename G::ElementD**>(base + at_d);
    alpha = reinterpret_cast<float*>(base + at_alpha);
    auto* sa = reinterpret_cast<SA*>(base + at_sa);
    auto* sb = reinterpret_cast<SB*>(base + at_sb);
    auto* sc = reinterpret_cast<SC*>(base + at_sc);
    auto* sd = reinterpret_cast<SD*>(base + at_sd);
    const std::vector<SA> host_sa(n, leading<SA>(lda));
    const std::vector<SB> host_sb(n, leading<SB>(ldb));
    const std::vector<SC> host_sc(n, leading<SC>(ldd));
    const std::vector<SD> host_sd(n, leading<SD>(ldd));
    check(cudaMemcpy(sa, host_sa.data(), n * sizeof(SA), cudaMemcpyHostToDevice), kOp, "copy strides");
    check(cudaMemcpy(sb, host_sb.data(), n * sizeof(SB), cudaMemcpyHostToDevice), kOp, "copy strides");
    check(cudaMemcpy(sc, host_sc.data(), n * sizeof(SC), cudaMemcpyHostToDevice), kOp, "copy strides");
    check(cudaMemcpy(sd, host_sd.data(), n * sizeof(SD), cudaMemcpyHostToDevice), kOp, "copy strides");
    // Until the first problems kernel writes them: alpha 1.
    const std::vector<float> ones(n, 1.0f);
    check(cudaMemcpy(alpha, ones.data(), n * sizeof(float), cudaMemcpyHostToDevice), kOp, "copy alphas");

    cutlass::KernelHardwareInfo hw;
    check(cudaGetDevice(&hw.device_id), kOp, "cudaGetDevice");
    hw.sm_count = sm_count();
    typename G::Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {static_cast<int>(e), problems, nullptr};  // sizes on the device only
    args.mainloop = {a, sa, b, sb};
    // Expert l's alpha is alpha[l] (a strided pointer, L stride 1); beta a plain scalar.
    args.epilogue.thread.alpha_ptr = alpha;
    args.epilogue.thread.dAlpha = {cute::_0{}, cute::_0{}, 1};
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
    KILN_CHECK(ok == cutlass::Status::kSuccess, kOp, "CUTLASS cannot run this FP8 grouped GEMM: {}",
               cutlassGetStatusString(ok));
    const size_t workspace_bytes = G::Gemm::get_workspace_size(args);
    if (workspace_bytes > 0) check(cudaMalloc(&workspace, workspace_bytes), kOp, "cudaMalloc CUTLASS workspace");
    const cutlass::Status init = gemm.initialize(args, workspace, stream(ctx));
    KILN_CHECK(init == cutlass::Status::kSuccess, kOp, "CUTLASS initialize: {}", cutlassGetStatusString(init));
  }

  void run(const ExecContext& ctx) {
    const cutlass::Status status = gemm.run(stream(ctx));
    KILN_CHECK(status == cutlass::Status::kSuccess, kOp, "CUTLASS run: {}", cutlassGetStatusString(status));
    check_launch(kOp, "CUTLASS FP8 grouped GEMM");
  }
};

template <class G>
Plan<G>& plan_for(const ExecContext& ctx, int64_t experts, int64_t lda, int64_t ldb, int64_t ldd, float beta) {
  static std::map<std::tuple<cudaStream_t, int64_t, int64_t, int64_t, int64_t>, std::unique_ptr<Plan<G>>> plans;
  auto& plan = plans[{stream(ctx), experts, lda, ldb, ldd}];
  if (!plan) plan = std::make_unique<Plan<G>>(ctx, experts, lda, ldb, ldd, beta);
  return *plan;
}

// Expert e's problem, operands and alpha from the offsets (one thread per expert).
template <class A, class B>
__global__ void forward_problems(const int32_t* __restrict__ offsets, int64_t experts, int64_t in, int64_t out,
                                 const A* x, const float* x_scale_inv, const B* w, const float* w_scale_inv, Bf16* y,
                                 Problem* problems, const A** a, const B** b, Bf16** d, float* alpha) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= experts) return;
  const int64_t first = offsets[e], rows = offsets[e + 1] - first;
  problems[e] = cute::make_shape(static_cast<int>(rows), static_cast<int>(out), static_cast<int>(in));
  a[e] = x + first * in;
  b[e] = w + e * out * in;
  d[e] = y + first * out;
  alpha[e] = __fmul_rn(*x_scale_inv, w_scale_inv[e]);
}

__global__ void input_grad_problems(const int32_t* __restrict__ offsets, int64_t experts, int64_t in, int64_t out,
                                    const E5m2* dy, const float* dy_scale_inv, const E4m3* wt, const float* w_scale_inv,
                                    Bf16* dx, Problem* problems, const E5m2** a, const E4m3** b, Bf16** d,
                                    float* alpha) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= experts) return;
  const int64_t first = offsets[e], rows = offsets[e + 1] - first;
  problems[e] = cute::make_shape(static_cast<int>(rows), static_cast<int>(in), static_cast<int>(out));
  a[e] = dy + first * out;
  b[e] = wt + e * in * out;
  d[e] = dx + first * in;
  alpha[e] = __fmul_rn(*dy_scale_inv, w_scale_inv[e]);
}

__global__ void weight_grad_problems(const int32_t* __restrict__ offsets, const int32_t* __restrict__ padded,
                                     int64_t experts, int64_t in, int64_t out, const E4m3* xt,
                                     const float* x_scale_inv, const E5m2* dyt, const float* dy_scale_inv, float* dw,
                                     Problem* problems, const E5m2** a, const E4m3** b, const float** c, float** d,
                                     float* alpha) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= experts) return;
  const int64_t rows = offsets[e + 1] - offsets[e], column = padded[e];
  // No rows: no tiles at all (M = 0), so dW_e stays as it is.
  problems[e] = cute::make_shape(rows > 0 ? static_cast<int>(out) : 0, static_cast<int>(in), static_cast<int>(rows));
  a[e] = dyt + column;  // row m of expert e's A: dyt[m * ld + column ..]
  b[e] = xt + column;
  c[e] = dw + e * out * in;
  d[e] = dw + e * out * in;
  alpha[e] = __fmul_rn(*dy_scale_inv, *x_scale_inv);
}

constexpr int kProblemThreads = 128;

unsigned problem_blocks(int64_t experts) {
  return static_cast<unsigned>((experts + kProblemThreads - 1) / kProblemThreads);
}

bool device_is_sm90() {
  static const bool sm90 = [] {
    int device = 0, major = 0, minor = 0;
    check(cudaGetDevice(&device), kOp, "cudaGetDevice");
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), kOp, "compute capability");
    check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), kOp, "compute capability");
    return major == 9 && minor == 0;
  }();
  return sm90;
}

template <class T>
const T* codes_as(const uint8_t* p) {
  return reinterpret_cast<const T*>(p);
}

}  // namespace

bool grouped_gemm_fp8_available() { return device_is_sm90(); }

void grouped_fp8_forward(const ExecContext& ctx, const uint8_t* x_codes, const float* x_scale_inv, const uint8_t* w_codes,
                         const float* w_scale_inv, const int32_t* offsets, int64_t experts, int64_t in, int64_t out,
                         bf16_bits* y) {
  Plan<Forward>& plan = plan_for<Forward>(ctx, experts, in, in, out, 0.0f);
  forward_problems<E4m3, E4m3><<<problem_blocks(experts), kProblemThreads, 0, stream(ctx)>>>(
      offsets, experts, in, out, codes_as<E4m3>(x_codes), x_scale_inv, codes_as<E4m3>(w_codes), w_scale_inv,
      reinterpret_cast<Bf16*>(y), plan.problems, plan.a, plan.b, plan.d, plan.alpha);
  check_launch(kOp, "forward_problems");
  plan.run(ctx);
}

void grouped_fp8_backward_input(const ExecContext& ctx, const uint8_t* dy_codes, const float* dy_scale_inv,
                                const uint8_t* wt_codes, const float* w_scale_inv, const int32_t* offsets,
                                int64_t experts, int64_t in, int64_t out, bf16_bits* dx) {
  Plan<InputGrad>& plan = plan_for<InputGrad>(ctx, experts, out, out, in, 0.0f);
  input_grad_problems<<<problem_blocks(experts), kProblemThreads, 0, stream(ctx)>>>(
      offsets, experts, in, out, codes_as<E5m2>(dy_codes), dy_scale_inv, codes_as<E4m3>(wt_codes), w_scale_inv,
      reinterpret_cast<Bf16*>(dx), plan.problems, plan.a, plan.b, plan.d, plan.alpha);
  check_launch(kOp, "input_grad_problems");
  plan.run(ctx);
}

void grouped_fp8_backward_weight(const ExecContext& ctx, const uint8_t* xt_codes, const float* x_scale_inv,
                                 const uint8_t* dyt_codes, const float* dy_scale_inv, const int32_t* offsets,
                                 const int32_t* padded, int64_t ld, int64_t experts, int64_t in, int64_t out, float* dw) {
  Plan<WeightGrad>& plan = plan_for<WeightGrad>(ctx, experts, ld, ld, in, 1.0f);
  weight_grad_problems<<<problem_blocks(experts), kProblemThreads, 0, stream(ctx)>>>(
      offsets, padded, experts, in, out, codes_as<E4m3>(xt_codes), x_scale_inv, codes_as<E5m2>(dyt_codes),
      dy_scale_inv, dw, plan.problems, plan.a, plan.b, plan.c, plan.d, plan.alpha);
  check_launch(kOp, "weight_grad_problems");
  plan.run(ctx);
}

#else  // built without CUTLASS for sm_90a: the experts' FP8 path falls back to bf16

bool grouped_gemm_fp8_available() { return false; }

void grouped_fp8_forward(const ExecContext&, const uint8_t*, const float*, const uint8_t*, const float*, const int32_t*,
                         int64_t, int64_t, int64_t, bf16_bits*) {
  fail(kOp, "kiln was built without CUTLASS's sm_90a grouped GEMM");
}
void grouped_fp8_backward_input(const ExecContext&, const uint8_t*, const float*, const uint8_t*, const float*,
                                const int32_t*, int64_t, int64_t, int64_t, bf16_bits*) {
  fail(kOp, "kiln was built without CUTLASS's sm_90a grouped GEMM");
}
void grouped_fp8_backward_weight(const ExecContext&, const uint8_t*, const float*, const uint8_t*, const float*,
                                 const int32_t*, const int32_t*, int64_t, int64_t, int64_t, int64_t, float*) {
  fail(kOp, "kiln was built without CUTLASS's sm_90a grouped GEMM");
}

#endif

}  // namespace kiln::cuda::sm90
