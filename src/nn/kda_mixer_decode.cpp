// The decode side of KdaMixer (nn/kda_mixer.h): a fixed-size state per slot, never per
// position: the short convolution's last kernel - 1 inputs [slots, K-1, C] (of the compute
// dtype: they are the projection's outputs as computed) and the delta rule's state [slots,
// H, d_k, d_v] (fp32 on the GPU, the wide dtype on the CPU, as the sequence op keeps it). A
// step's rows run the mixer's ops and then advance their slots' states one row at a time,
// in order: a prefill chunk's rows (consecutive positions of one slot) and single tokens
// alike, O(1) per token. On the GPU every op enqueues on the context's stream without
// allocating or reading back, so a step can be captured.
#include "core/op_profiler.h"
#include "nn/kda_mixer.h"
#include "nn/slot_state.h"
#include "ops/kda/kda_decode.h"
#include "ops/kda/kda_gate.h"
#include "ops/kda/kda_mixer_ops.h"
#include "ops/short_conv/short_conv.h"

namespace kiln {

class KdaDecoder final : public BranchDecoder {
 public:
  KdaDecoder(const KdaMixer& a, DecodeContext& ctx) : a_(a), exec_(ctx.exec), workspace_(ctx.workspace), dtype_(ctx.dtype) {
    // On the CPU the compute dtype is the wide one: the states are read and written by the
    // same f32/f64 ops as the activations. The GPU keeps the delta rule's state in fp32
    // whatever the activations' dtype, as the sequence kernels do.
    const bool gpu = ctx.device == Device::cuda;
    KILN_CHECK(gpu || ctx.dtype == ctx.wide, a.key_, "'kda' decodes in one dtype on the CPU (got compute {} and wide {})",
               dtype_name(ctx.dtype), dtype_name(ctx.wide));
    ctx.state.reserve(conv_state_, ctx.dtype, Shape{ctx.slots, a.kernel_ - 1, a.qkv_cols_});
    ctx.state.reserve(kda_state_, gpu ? DType::f32 : ctx.wide, Shape{ctx.slots, a.h_, a.dk_, a.dv_});
    const int64_t r = ctx.max_rows;
    auto bytes = [&](int64_t cols) { return Workspace::footprint(ctx.dtype, Shape{r, cols}); };
    const int64_t kc = a.h_ * a.dk_, vc = a.h_ * a.dv_;
    // raw, act; q, k, g, graw; v, o, gpre, y; braw, beta; the gates' low-rank rows.
    ctx.workspace.reserve_peak(2 * bytes(a.qkv_cols_) + 4 * bytes(kc) + 4 * bytes(vc) + 2 * bytes(a.h_) +
                               bytes(a.rank_));
  }

  void forward(const Tensor& h, const DecodeRows& rows, const Tensor& out) override {
    const KdaMixer& a = a_;
    const int64_t n = rows.count;
    Workspace::Scope scope(workspace_);
    const Tensor raw = scope.take(dtype_, Shape{n, a.qkv_cols_}), act = scope.take(dtype_, Shape{n, a.qkv_cols_});
    a.qkv_proj_.forward(exec_, h, raw);
    ops::short_conv_step(exec_, raw, a.conv_w_, rows.slots, conv_state_, act);
    const Tensor q = scope.take(dtype_, Shape{n, a.h_, a.dk_}), k = scope.take(dtype_, Shape{n, a.h_, a.dk_});
    const Tensor v = scope.take(dtype_, Shape{n, a.h_, a.dv_}), g = scope.take(dtype_, Shape{n, a.h_, a.dk_});
    ops::kda_split_norm_forward(exec_, act, q, k, v);
    const Tensor low = scope.take(dtype_, Shape{n, a.rank_}), graw = scope.take(dtype_, Shape{n, a.h_ * a.dk_});
    a.f_a_proj_.forward(exec_, h, low);
    a.f_b_proj_.forward(exec_, low, graw);
    // The gate as KdaMixer::gate, on the decoder's context (its stream, which a step's
    // capture records) rather than the mixer's.
    ops::kda_gate_forward(exec_, graw.view(Shape{n, a.h_, a.dk_}), a.a_log_, a.dt_bias_2d(), g);
    const Tensor braw = scope.take(dtype_, Shape{n, a.h_}), beta = scope.take(dtype_, Shape{n, a.h_});
    a.b_proj_.forward(exec_, h, braw);
    ops::kda_beta_forward(exec_, braw, beta);
    // Each row continues its slot's state; a slot's rows in order.
    const Tensor o = scope.take(dtype_, Shape{n, a.h_, a.dv_});
    ops::kda_decode_step(exec_, q, k, v, g, beta, rows.slots, rows.distinct_slots, {}, kda_state_, o);
    const Tensor gpre = scope.take(dtype_, Shape{n, a.h_ * a.dv_}), y = scope.take(dtype_, Shape{n, a.h_ * a.dv_});
    a.g_a_proj_.forward(exec_, h, low);
    a.g_b_proj_.forward(exec_, low, gpre);
    ops::kda_output_gate_forward(exec_, o, a.gain_, gpre, a.norm_eps_, y);
    a.o_proj_.forward(exec_, y, out);
  }

  // Fixed-size states: a new sequence starts from zero, a follower takes the whole state.
  void reset_slot(int32_t slot) override {
    zero_slot(conv_state_, slot);
    zero_slot(kda_state_, slot);
  }
  void copy_slot(int32_t from, int32_t to, int64_t positions) override {
    (void)positions;  // the state after the shared prompt is the whole slot
    copy_slot_whole(conv_state_, from, to);
    copy_slot_whole(kda_state_, from, to);
  }

 private:
  const KdaMixer& a_;
  const ExecContext& exec_;
  Workspace& workspace_;
  DType dtype_;
  Tensor conv_state_, kda_state_;  // [slots, K-1, C], [slots, H, d_k, d_v]
};

std::unique_ptr<BranchDecoder> KdaMixer::make_decoder(DecodeContext& ctx, const Norm& pre_norm) const {
  (void)pre_norm;  // no fused decode branch: the norm runs on its own
  // The GPU's step kernels take d_k up to 256 (ops/kda/kda_cuda.h).
  KILN_CHECK(ctx.device == Device::cpu || dk_ <= 256, key_,
             "'kda' decodes on the GPU with model.kda.head_dim <= 256, got {}", dk_);
  return std::make_unique<KdaDecoder>(*this, ctx);
}

}  // namespace kiln
