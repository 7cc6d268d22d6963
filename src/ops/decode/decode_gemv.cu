// The decode step's projections with their neighbours fused in (declared in
// ops/decode/decode_kernels.h), on the skinny-product kernel of ops/linear/gemv_kernel.cuh. At
// decode batch sizes a step is a read of the weights plus a chain of small dependent
// kernels; folding the RMSNorms, the residual adds and SwiGLU into the projections leaves
// five kernels per block instead of nine.
#include "ops/decode/decode_kernels.h"

#include "ops/linear/gemv_kernel.cuh"

namespace kiln::cuda {

namespace {

gemv::Args args(int64_t m, int64_t k, const void* w, int64_t n) {
  gemv::Args p;
  p.m = m, p.n = n, p.k = k;
  p.w = static_cast<const gemv::bf16*>(w), p.ldw = k;
  p.constant_weights = true;  // the model's weights: streamed in while the kernels before finish
  return p;
}

void require_fit(const gemv::Args& p, gemv::Input in, const char* what) {
  if (!gemv::fits(p, in))
    fail("decoder", "{}: {} rows of {} do not fit the decode projection kernel (see decode_gemv_fits)", what, p.m,
         p.k);
}

}  // namespace

bool decode_gemv_fits(int64_t m, int64_t k) {
  gemv::Args p = args(m, k, nullptr, 1);
  return gemv::fits(p, gemv::Input::rms_norm);
}

void norm_gemv(const ExecContext& ctx, DType out_dtype, const float* x, const float* gain, float eps, int64_t m, int64_t k, const void* w,
               int64_t n, void* out) {
  gemv::Args p = args(m, k, w, n);
  p.x = x, p.ldx = k, p.gain = gain, p.eps = eps, p.out = out, p.ldo = n;
  require_fit(p, gemv::Input::rms_norm, "norm_gemv");
  if (out_dtype == DType::f32) return gemv::launch<gemv::Input::rms_norm, gemv::Output::store, float>(p, stream(ctx));
  if (out_dtype == DType::bf16) return gemv::launch<gemv::Input::rms_norm, gemv::Output::store, gemv::bf16>(p, stream(ctx));
  fail("decoder", "norm_gemv: no {} output", dtype_name(out_dtype));
}

void gemv_add_residual(const ExecContext& ctx, const void* a, int64_t m, int64_t k, const void* w, int64_t n, float* x) {
  gemv::Args p = args(m, k, w, n);
  p.a = static_cast<const gemv::bf16*>(a), p.lda = k, p.residual = x, p.ldr = n;
  require_fit(p, gemv::Input::bf16_rows, "gemv_add_residual");
  gemv::launch<gemv::Input::bf16_rows, gemv::Output::add_residual, float>(p, stream(ctx));
}

void norm_gemv_swiglu(const ExecContext& ctx, const float* x, const float* gain, float eps, int64_t m, int64_t k, const void* w, int64_t f,
                      void* act) {
  gemv::Args p = args(m, k, w, f);
  p.x = x, p.ldx = k, p.gain = gain, p.eps = eps, p.second_row = f, p.out = act, p.ldo = f;
  require_fit(p, gemv::Input::rms_norm, "norm_gemv_swiglu");
  gemv::launch<gemv::Input::rms_norm, gemv::Output::swiglu, gemv::bf16>(p, stream(ctx));
}

}  // namespace kiln::cuda
