// The decode side of MoeMlp (nn/moe/moe_mlp.h): the same routing and experts over a decode
// step's rows. It has no state between steps (a token's experts depend on that token only:
// sinkhorn routes by its softmax here as in every non-training forward, a capacity drops
// nothing, and expert_choice, whose choice reads later tokens, is refused). LatentMoE's
// projections wrap the experts as in the training forward.
// On the GPU every size stays in device memory (the grouped products read the dispatch's
// offsets there), so decode steps with sparse layers are captured as CUDA graphs too.
#include "nn/moe/moe_mlp.h"

#include "nn/moe/router.h"
#include "ops/elementwise/elementwise.h"
#include "ops/moe/routing.h"
#include "ops/swiglu/swiglu.h"

namespace kiln {

class MoeDecoder final : public BranchDecoder {
 public:
  MoeDecoder(const MoeMlp& mlp, DecodeContext& ctx) : m_(mlp), exec_(ctx.exec), workspace_(ctx.workspace), dtype_(ctx.dtype), wide_(ctx.wide) {
    const MoeConfig& moe = mlp.moe_;
    const int64_t r = ctx.max_rows, k = mlp.slots_, e_count = moe.experts, f = moe.expert_hidden, io = mlp.expert_io_;
    const int64_t d = mlp.hidden_, l = moe.latent_width;
    const int64_t rows = mlp.router_->most_pairs(r);
    dispatch_.experts = e_count, dispatch_.top_k = k;
    ctx.state.reserve(dispatch_.counts, DType::i32, Shape{e_count});
    ctx.state.reserve(dispatch_.offsets, DType::i32, Shape{e_count + 1});
    ctx.state.reserve(dispatch_.pair_of_row, DType::i32, Shape{rows});
    ctx.state.reserve(dispatch_.row_of_pair, DType::i32, Shape{r * k});
    ctx.state.reserve(experts_, DType::i32, Shape{r, k});
    auto bytes = [](DType dt, Shape s) { return Workspace::footprint(dt, s); };
    const int64_t s = moe.shared_hidden;
    ctx.workspace.reserve_peak(3 * bytes(wide_, Shape{r, e_count}) + bytes(wide_, Shape{r, k}) +
                               2 * bytes(dtype_, Shape{rows, io}) + bytes(dtype_, Shape{rows, 2 * f}) +
                               bytes(dtype_, Shape{rows, f}) + (l > 0 ? 2 * bytes(dtype_, Shape{r, l}) : 0) +
                               (s > 0 ? bytes(dtype_, Shape{r, 2 * s}) + bytes(dtype_, Shape{r, s}) + bytes(dtype_, Shape{r, d})
                                      : 0));
  }

  void forward(const Tensor& h, const DecodeRows& rows, const Tensor& out) override {
    const MoeConfig& moe = m_.moe_;
    const int64_t n = rows.count, k = m_.slots_, e_count = moe.experts, f = moe.expert_hidden, d = m_.hidden_;
    const int64_t io = m_.expert_io_;
    const int64_t grouped_rows = m_.router_->most_pairs(n);
    Workspace::Scope scope(workspace_);
    const Tensor logits = scope.take(wide_, Shape{n, e_count}), probs = scope.take(wide_, Shape{n, e_count});
    const ops::Routes routes{experts_.rows(0, n), scope.take(wide_, Shape{n, k})};
    ops::MoeDispatch dispatch = dispatch_;
    dispatch.pair_of_row = dispatch_.pair_of_row.rows(0, grouped_rows);
    dispatch.row_of_pair = dispatch_.row_of_pair.rows(0, n * k);
    // The experts read `in` and sum into `routed`: h and out, or LatentMoE's latent.
    const bool latent = m_.latent();
    const Tensor in = latent ? scope.take(dtype_, Shape{n, io}) : h, routed = latent ? scope.take(dtype_, Shape{n, io}) : out;
    if (latent) m_.latent_down_proj_.forward(exec_, h, in);
    ops::router_logits(exec_, h, m_.router_w_, logits);
    m_.router_->route(logits, routes, probs, scope.take(wide_, Shape{n, e_count}), /*training=*/false);
    ops::moe_dispatch(exec_, routes.experts, dispatch);
    const Tensor grouped = scope.take(dtype_, Shape{grouped_rows, io});
    const Tensor gate_up = scope.take(dtype_, Shape{grouped_rows, 2 * f});
    const Tensor act = scope.take(dtype_, Shape{grouped_rows, f}), y = scope.take(dtype_, Shape{grouped_rows, io});
    ops::moe_gather(exec_, in, dispatch, grouped);
    ops::moe_grouped_linear_forward(exec_, grouped, m_.gate_up_w_, dispatch, gate_up);
    ops::swiglu_forward(exec_, gate_up, act);
    ops::moe_grouped_linear_forward(exec_, act, m_.down_w_, dispatch, y);
    ops::moe_combine(exec_, y, routes.weights, dispatch, routed);
    if (latent) m_.latent_up_proj_.forward(exec_, routed, out);
    if (moe.shared_hidden > 0) {
      const Tensor sgu = scope.take(dtype_, Shape{n, 2 * moe.shared_hidden});
      const Tensor sact = scope.take(dtype_, Shape{n, moe.shared_hidden}), sout = scope.take(dtype_, Shape{n, d});
      m_.shared_gate_up_proj_.forward(exec_, h, sgu);
      ops::swiglu_forward(exec_, sgu, sact);
      m_.shared_down_proj_.forward(exec_, sact, sout);
      ops::add_inplace(exec_, out, sout);
    }
  }

 private:
  const MoeMlp& m_;
  const ExecContext& exec_;
  Workspace& workspace_;
  DType dtype_, wide_;
  ops::MoeDispatch dispatch_;  // [E], [E + 1], [max_rows k]
  Tensor experts_;             // i32 [max_rows, k]
};

std::unique_ptr<BranchDecoder> make_moe_decoder(const MoeMlp& mlp, DecodeContext& ctx) {
  return std::make_unique<MoeDecoder>(mlp, ctx);
}

}  // namespace kiln
