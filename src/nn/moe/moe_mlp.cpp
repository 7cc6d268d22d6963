// The sparse MLP (registry name "moe"; keys in [model.moe]): a router sends each token to
// k of E SwiGLU experts (DeepSeekMoE / Qwen3-MoE), their outputs summed with the routing
// weights, plus an optional shared expert every token passes:
//   logits = x Wr^T (fp32);  (experts, weights) = router(logits)
//   out = sum_j weights_j SwiGLU_{experts_j}(x) + SwiGLU_shared(x)
//
// LatentMoE (model.moe.latent_width = L > 0; Nemotron-3's LatentMoE, seed 001): the routed
// experts work in a latent of width L, the router and the shared expert on x itself:
//   z = W_down x [L];  out = W_up (sum_j weights_j SwiGLU_{experts_j}(z)) + SwiGLU_shared(x)
// Each expert's gate|up is then [2F, L] and its down [L, F]. The weight multiplies the
// expert's output, which equals applying it to the activation before the down projection
// (seed 001's form): the projection is linear and has no bias. On the GPU the projections
// are the CUDA linear ops (cuBLASLt) and the experts the same dispatch, grouped GEMMs and
// combine as the plain sparse MLP's, at width L (tests/gpu/test_gpu_latent_moe.cpp).
//
// Dropless by default: an expert takes every token routed to it; with
// model.moe.capacity_factor a token-choice router's expert keeps at most ceil(cf T k / E)
// of a training micro-batch's pairs, the first in token order (Switch / GShard), the rest
// dropped (counted in the diagnostics; evaluation and decoding stay dropless). Routers with
// a variable count per token (expert_choice, relu) route over E slots, empty ones -1. The
// experts' weights are two fused
// matrices, gate|up [E 2F, d] and down [E d, F], each expert's rows contiguous (so one
// grouped product serves them all) and every expert's tensors separately named (Hugging
// Face's per-expert layout; llama.cpp stacks them: ParamName::gguf_stack).
//
// Losses (nn/loss_terms.h, per micro-batch): the Switch load-balancing loss
// aux_loss x E sum_i f_i P_i and the router z-loss z_loss x mean lse(logits)^2, each when
// its coefficient is set, as slots "moe_aux" and "moe_z" summed over the sparse layers.
// Their gradients reach the router (f_i held fixed).
//
// With model.moe.balance_scope = "step" the balance loss is the whole step's instead (seed
// 004's and transformers' definition): f_i and P_i over every micro-batch of every rank.
// Each micro-batch's backward needs the step's f_i, so the step program first runs a
// counting pass (train/step_program.cpp): the training forward of every micro-batch again
// (one extra forward per step), of which only the routed counts are kept here, summed over
// the ranks. Its routing is the training pass's: the same weights and batches, the same
// dropout keys, the training route (sinkhorn's balancing, the capacity's drops), and no
// router draws at random. Each micro-batch then adds its share E sum_i f_i P_i^(mb), P_i^(mb)
// its tokens' probabilities summed / the step's tokens, so the shares sum to the step's
// loss (slot per step), and its gradient E aux f_i / T_step per token, unscaled by the
// micro-batch count. The z-loss under this scope is the mean over the step's tokens in the
// same way. The step's counts live on the model's device (balance_counts_), and the loss
// kernels read them there (ops/moe/balance_scope.h): on the GPU the counting pass adds to
// them with a kernel, nothing is read back, and a captured step replays for any counts.
//
// On the GPU (bf16 mixed precision or fp32) the same ops run with every size in device
// memory: the router's logits in fp32 from the bf16 activations, its math and the routing
// weights in fp32, the experts as grouped products over the device offsets, the step's
// expert counts summed on the device, the losses' values added to the device step's slots
// (LossContext::device_sums) without a host read; so a training step with sparse layers
// is still one capturable CUDA graph per micro-batch.
#include "nn/moe/moe_mlp.h"

#include "nn/moe/router.h"
#include "nn/mup.h"
#include "ops/moe/load_stats.h"
#include "ops/moe/moe.h"
#include "ops/moe/routing.h"
#include "ops/elementwise/elementwise.h"
#include "ops/swiglu/swiglu.h"

#include <cmath>

namespace kiln {

MoeMlp::MoeMlp(BuildContext& ctx, const LayerSpec& layer)
    : model_(*layer.model), moe_(layer.model->moe), exec_(ctx.exec), workspace_(ctx.workspace), losses_(*ctx.losses), layer_(layer.index) {
  const ModelConfig& m = *layer.model;
  const int64_t t = ctx.max_tokens, d = m.hidden, e_count = moe_.experts, k = moe_.top_k, f = moe_.expert_hidden;
  hidden_ = d;
  expert_io_ = latent() ? moe_.latent_width : d;
  const NameScope n = layer.names.child("mlp.", "mlp.", "");
  const double out_std = residual_init_std(m);
  // The router: no weight decay (as the norms' gains; its scale is what routes).
  ctx.parameter(router_w_, router_g_, n("gate.weight", "gate.weight", "ffn_gate_inp.weight"), Shape{e_count, d},
                ParamRole::router, Init::normal(hidden_init_std(m)));
  std::vector<std::pair<ParamName, int64_t>> gate_up, down;
  for (int64_t e = 0; e < e_count; ++e) {
    const std::string ex = "experts." + std::to_string(e) + ".";
    ParamName gate = n(ex + "gate_proj.weight", ex + "gate_proj.weight", "ffn_gate_exps.weight");
    ParamName up = n(ex + "up_proj.weight", ex + "up_proj.weight", "ffn_up_exps.weight");
    ParamName dn = n(ex + "down_proj.weight", ex + "down_proj.weight", "ffn_down_exps.weight");
    gate.gguf_stack = up.gguf_stack = dn.gguf_stack = e;
    gate_up.push_back({gate, f});
    gate_up.push_back({up, f});
    down.push_back({dn, expert_io_});
  }
  // LatentMoE's projections: always active (every token passes them), as the router.
  if (latent()) {
    const int64_t l = moe_.latent_width;
    latent_down_proj_.declare(ctx, n("latent_down_proj.weight", "latent_down_proj.weight", "ffn_latent_down.weight"),
                              l, d, ParamRole::matrix, Init::normal(hidden_init_std(m)));
    latent_up_proj_.declare(ctx, n("latent_up_proj.weight", "latent_up_proj.weight", "ffn_latent_up.weight"), d, l,
                            ParamRole::matrix, Init::normal(out_std));
    ctx.saved(latent_in_, Shape{t, l});
    ctx.saved(latent_sum_, Shape{t, l});
  }
  const size_t first_expert = ctx.parameters.size();
  ctx.fused_parameter(gate_up_w_, gate_up_g_, gate_up, expert_io_, ParamRole::expert, Init::normal(hidden_init_std(m)));
  // The residual's scale goes to whichever matrix writes the branch's output: W_up in LatentMoE.
  ctx.fused_parameter(down_w_, down_g_, down, f, ParamRole::expert, Init::normal(latent() ? hidden_init_std(m) : out_std));
  const double active = static_cast<double>(k) / static_cast<double>(e_count);
  for (size_t i = first_expert; i < ctx.parameters.size(); ++i) ctx.parameters[i]->set_active_fraction(active);
  if (moe_.shared_hidden > 0) {
    const int64_t s = moe_.shared_hidden;
    const NameScope sh = n.child("shared_experts.", "shared_experts.", "");
    shared_gate_up_proj_.declare_fused(ctx,
                                       {{sh("gate_proj.weight", "gate_proj.weight", "ffn_gate_shexp.weight"), s},
                                        {sh("up_proj.weight", "up_proj.weight", "ffn_up_shexp.weight"), s}},
                                       d, ParamRole::matrix, Init::normal(hidden_init_std(m)));
    shared_down_proj_.declare(ctx, sh("down_proj.weight", "down_proj.weight", "ffn_down_shexp.weight"), d, s,
                              ParamRole::matrix, Init::normal(out_std));
    shared_gate_up_proj_.keep_fp8_input(ctx);  // in FP8, x's operand from forward to backward (gated_mlp.cpp)
    shared_down_proj_.keep_fp8_input(ctx);
    ctx.saved(shared_gate_up_, Shape{t, 2 * s});
  }
  router_ = router_registry().build("model.moe.router", moe_.router, ctx, RouterSpec{&moe_, n});
  slots_ = router_->slots();
  const int64_t rows = router_->most_pairs(t);

  // Saved for backward: the router's logits and probabilities, the routes and their
  // dispatch, each expert's pre-activation rows and, with model.moe.save_outputs, its output
  // rows (otherwise the routing weights' gradient comes from the activations: backward).
  ctx.saved_wide(logits_, Shape{t, e_count});
  ctx.saved_wide(probs_, Shape{t, e_count});
  ctx.saved_wide(router_saved_, Shape{t, e_count});
  ctx.saved_buffer(routes_.experts, Shape{t, slots_}, DType::i32);
  ctx.saved_wide(routes_.weights, Shape{t, slots_});
  dispatch_.experts = e_count, dispatch_.top_k = slots_;
  ctx.saved_buffer(dispatch_.counts, Shape{e_count}, DType::i32);
  ctx.saved_buffer(dispatch_.offsets, Shape{e_count + 1}, DType::i32);
  ctx.saved_buffer(dispatch_.pair_of_row, Shape{rows}, DType::i32);
  ctx.saved_buffer(dispatch_.row_of_pair, Shape{t * slots_}, DType::i32);
  ctx.saved(gate_up_, Shape{rows, 2 * f});
  if (moe_.save_outputs) ctx.saved(expert_out_, Shape{rows, expert_io_});
  // train.fp8_experts: the grouped products in tensorwise FP8 (ops/moe/moe.h), their
  // operands' copies from the workspace's gemm level.
  expert_fp8_ = ctx.precision.format(ParamRole::expert) == GemmFormat::fp8_tensorwise;
  if (expert_fp8_) {
    const DType expected = ctx.device == Device::cpu ? DType::f32 : DType::bf16;
    KILN_CHECK(ctx.dtype == expected, "train.fp8_experts", "FP8 experts compute in {} on the {}, not {}",
               dtype_name(expected), device_name(ctx.device), dtype_name(ctx.dtype));
    ctx.workspace.reserve_peak(
        std::max(ops::moe_grouped_linear_fp8_scratch_bytes(ctx.device, rows, e_count, expert_io_, 2 * f, ctx.training),
                 ops::moe_grouped_linear_fp8_scratch_bytes(ctx.device, rows, e_count, f, expert_io_, ctx.training)),
        Workspace::Level::gemm);
  }
  ctx.step_statistic(step_counts_, Shape{e_count}, DType::i32, StepReduction::sum);
  ctx.step_statistic(step_entropy_, Shape{2}, DType::f64, StepReduction::sum);
  ctx.step_buffer(last_counts_, Shape{e_count}, DType::i32);
  ctx.step_buffer(last_entropy_, Shape{2}, DType::f64);
  ctx.step_buffer(dead_steps_, Shape{e_count}, DType::i32);
  ctx.step_statistic(step_dropped_, Shape{1}, DType::i32, StepReduction::sum);
  ctx.step_buffer(last_dropped_, Shape{1}, DType::i32);

  if (moe_.aux_loss > 0 && moe_.balance_scope == "step" && ctx.training) {
    step_scope_ = true;
    ctx.step_buffer(balance_counts_, Shape{e_count + 1}, DType::f64);
    ctx.losses->step_routes.push_back(&balance_counts_);
  }
  if (moe_.aux_loss > 0) aux_slot_ = slot(ctx, "moe_aux", step_scope() ? LossTerm::Per::step : LossTerm::Per::micro_batch);
  if (moe_.z_loss > 0) z_slot_ = slot(ctx, "moe_z", step_scope() ? LossTerm::Per::step : LossTerm::Per::micro_batch);

  // Scratch: the grouped input rows [T k, d] and the activation [T k, F] (forward); in
  // backward also their gradients, the weights' and probabilities' gradients, the logits'.
  auto bytes = [&](DType dt, Shape s) { return Workspace::footprint(dt, s); };
  const size_t shared = moe_.shared_hidden > 0 ? bytes(ctx.dtype, Shape{t, moe_.shared_hidden}) +
                                                     bytes(ctx.dtype, Shape{t, 2 * moe_.shared_hidden}) +
                                                     bytes(ctx.dtype, Shape{t, d}) +
                                                     bytes(DType::f32, Shape{1})  // an FP8 projection's amax
                                               : 0;
  // Also the router's backward scratch [T, E] (wide) and the logits' gradient in the compute
  // dtype (the mixed path's bf16 products read it). LatentMoE: the latent's two gradients.
  const size_t latent_grads = latent() ? 2 * bytes(ctx.dtype, Shape{t, moe_.latent_width}) : 0;
  ctx.workspace.reserve_peak(3 * bytes(ctx.dtype, Shape{rows, expert_io_}) + bytes(ctx.dtype, Shape{rows, f}) +
                             bytes(ctx.dtype, Shape{rows, 2 * f}) + bytes(ctx.master_dtype, Shape{t, slots_}) +
                             3 * bytes(ctx.master_dtype, Shape{t, e_count}) + bytes(ctx.dtype, Shape{t, e_count}) +
                             shared + latent_grads);
}

MoeMlp::~MoeMlp() = default;

// The sparse layers share one slot per loss: the first reserves it, the others add to it.
int MoeMlp::slot(BuildContext& ctx, const char* name, LossTerm::Per per) {
  const int found = ctx.losses->terms.find(name);
  if (found >= 0) return found;
  return ctx.losses->terms.reserve({{name, true, per}});
}

void MoeMlp::forward(const Tensor& x, const Tensor& out) {
  const int64_t t = x.size(0), k = moe_.top_k, f = moe_.expert_hidden, rows = router_->most_pairs(t);
  Workspace::Scope scope(workspace_);
  const Tensor logits = logits_.rows(0, t), probs = probs_.rows(0, t);
  const ops::Routes routes = routes_rows(t);
  ops::MoeDispatch d = dispatch_rows(t);
  // The step's load and drops: of training forwards, once (not a recomputed block's forward again).
  const bool counted = losses_.backward && !losses_.recomputing;
  // The counting pass routes as the training forward it precedes (the capacity's drops too).
  const bool training = losses_.backward || losses_.counting_routes;
  if (training && router_->capacity_drops()) d.capacity = expert_capacity(moe_, t, moe_.capacity_factor);
  if (counted) d.dropped = step_dropped_;
  // The experts read `in` and sum into `routed`: x and out, or LatentMoE's latent.
  const Tensor in = latent() ? latent_in_.rows(0, t) : x, routed = latent() ? latent_sum_.rows(0, t) : out;
  if (latent()) latent_down_proj_.forward(x, in);
  ops::router_logits(exec_, x, router_w_, logits);
  router_->route(logits, routes, probs, router_saved_.rows(0, t), training);
  ops::moe_dispatch(exec_, routes.experts, d);
  if (losses_.counting_routes && step_scope()) ops::balance_step_routes_add(exec_, d.counts, t, balance_counts_);
  if (counted) {
    ops::moe_accumulate_counts(exec_, d.counts, step_counts_);
    ops::routing_entropy_sum(exec_, probs, step_entropy_);
  }
  const Tensor grouped = scope.take(x.dtype(), Shape{rows, expert_io_});
  const Tensor gate_up = gate_up_.rows(0, rows), act = scope.take(x.dtype(), Shape{rows, f});
  const Tensor y = moe_.save_outputs ? expert_out_.rows(0, rows) : scope.take(x.dtype(), Shape{rows, expert_io_});
  ops::moe_gather(exec_, in, d, grouped);
  grouped_forward(grouped, gate_up_w_, d, gate_up);
  ops::swiglu_forward(exec_, gate_up, act);
  grouped_forward(act, down_w_, d, y);
  ops::moe_combine(exec_, y, routes.weights, d, routed);
  if (latent()) latent_up_proj_.forward(routed, out);
  if (moe_.shared_hidden > 0) {
    const Tensor sgu = shared_gate_up_.rows(0, t), sact = scope.take(x.dtype(), Shape{t, moe_.shared_hidden});
    const Tensor sout = scope.take(x.dtype(), Shape{t, hidden_});
    // In FP8, SwiGLU's max |output| is the down projection's quantize scale (gated_mlp.cpp).
    const Tensor sact_amax = shared_down_proj_.amax_slot(scope);
    shared_gate_up_proj_.forward(x, sgu);
    ops::swiglu_forward(exec_, sgu, sact, sact_amax);
    shared_down_proj_.forward(sact, sout, sact_amax);
    ops::add_inplace(exec_, out, sout);
  }
  // The losses' values of this micro-batch (their gradients are formed in backward): into
  // the device step's slots in device memory, else the host's (a GPU model reads them back).
  if (losses_.recomputing || losses_.counting_routes) return;
  if (double* device = losses_.device_sums) {
    if (aux_slot_ >= 0) ops::balance_loss_sum(exec_, probs, d.counts, k, device + aux_slot_, balance_counts_);
    if (z_slot_ >= 0) ops::router_z_loss_sum(exec_, logits, device + z_slot_, step_tokens());
    router_->add_losses(logits, device, nullptr);
  } else if (losses_.host_sums != nullptr) {
    LossSlotSums& sums = *losses_.host_sums;
    if (aux_slot_ >= 0) sums[static_cast<size_t>(aux_slot_)] += ops::balance_loss(exec_, probs, d.counts, k, 0, Tensor(), balance_counts_);
    if (z_slot_ >= 0) sums[static_cast<size_t>(z_slot_)] += ops::router_z_loss(exec_, logits, 0, Tensor(), step_tokens());
    router_->add_losses(logits, nullptr, &sums);
  }
}

void MoeMlp::grouped_forward(const Tensor& x, const Tensor& w, const ops::MoeDispatch& d, const Tensor& y) const {
  if (expert_fp8_) ops::moe_grouped_linear_fp8_forward(exec_, workspace_, x, w, d, y);
  else ops::moe_grouped_linear_forward(exec_, x, w, d, y);
}

void MoeMlp::grouped_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const ops::MoeDispatch& d,
                              const Tensor& dx, const Tensor& dw) const {
  if (expert_fp8_) ops::moe_grouped_linear_fp8_backward(exec_, workspace_, x, w, dy, d, dx, dw);
  else ops::moe_grouped_linear_backward(exec_, x, w, dy, d, dx, dw);
}

void MoeMlp::backward(const Tensor& x, const Tensor& dout, const Tensor& dx) {
  const int64_t t = dout.size(0), k = moe_.top_k, f = moe_.expert_hidden, e_count = moe_.experts;
  const int64_t rows = router_->most_pairs(t);
  Workspace::Scope scope(workspace_);
  const Tensor logits = logits_.rows(0, t), probs = probs_.rows(0, t);
  const ops::Routes routes = routes_rows(t);
  const ops::MoeDispatch d = dispatch_rows(t);
  const Tensor gate_up = gate_up_.rows(0, rows);
  const DType dt = dout.dtype(), wide = logits.dtype();
  // LatentMoE: out = W_up routed, so the routed sum's gradient is dout W_up.
  Tensor drouted = dout;
  if (latent()) {
    drouted = scope.take(dt, Shape{t, moe_.latent_width});
    latent_up_proj_.backward(latent_sum_.rows(0, t), dout, drouted);
  }
  const Tensor dy = scope.take(dt, Shape{rows, expert_io_});
  const Tensor dweights = scope.take(wide, Shape{t, slots_});
  const Tensor dact = scope.take(dt, Shape{rows, f});
  const Tensor dgate_up = scope.take(dt, Shape{rows, 2 * f});
  if (moe_.save_outputs) {
    // routed = combine(y, weights): the experts' output rows' and the weights' gradients,
    // then as SwigluMlp's backward, per expert on the grouped rows.
    ops::moe_combine_backward(exec_, expert_out_.rows(0, rows), routes.weights, drouted, d, dy, dweights);
    grouped_backward(dact, down_w_, dy, d, dact, Tensor());
    ops::swiglu_backward(exec_, gate_up, dact, dgate_up, dact);  // dact then holds the activation again
  } else {
    // The weights off the outputs (ops::moe_swiglu_backward): dy holds dout's rows
    // unweighted, dact their input gradient, then each row's weight times its activation.
    ops::moe_gather(exec_, drouted, d, dy);
    grouped_backward(dact, down_w_, dy, d, dact, Tensor());
    ops::moe_swiglu_backward(exec_, gate_up, dact, routes.weights, d, dgate_up, dact, dweights);
  }
  grouped_backward(dact, down_w_, dy, d, Tensor(), down_g_);
  const Tensor grouped = scope.take(dt, Shape{rows, expert_io_}), dgrouped = scope.take(dt, Shape{rows, expert_io_});
  ops::moe_gather(exec_, latent() ? latent_in_.rows(0, t) : x, d, grouped);
  grouped_backward(grouped, gate_up_w_, dgate_up, d, dgrouped, gate_up_g_);
  if (latent()) {  // z = W_down x: the latent's gradient back to x (dx =) and W_down
    const Tensor dz = scope.take(dt, Shape{t, moe_.latent_width});
    ops::moe_gather_backward(exec_, dgrouped, d, dz, false);
    latent_down_proj_.backward(x, dz, dx);
  } else {
    ops::moe_gather_backward(exec_, dgrouped, d, dx, false);
  }
  if (moe_.shared_hidden > 0) {
    const int64_t s = moe_.shared_hidden;
    const Tensor sgu = shared_gate_up_.rows(0, t);
    const Tensor sdact = scope.take(dt, Shape{t, s}), sdgu = scope.take(dt, Shape{t, 2 * s});
    const Tensor sdgu_amax = shared_gate_up_proj_.amax_slot(scope);
    if (shared_down_proj_.weight_grad_reads_x(t)) {  // as GatedMlp::backward
      shared_down_proj_.backward_input(dout, sdact);
      ops::swiglu_backward(exec_, sgu, sdact, sdgu, sdact, sdgu_amax);
      shared_down_proj_.backward_weight(sdact, dout);
    } else {  // the kept FP8 operand: one call, and the activation is not rebuilt
      shared_down_proj_.backward(sdact, dout, sdact);
      ops::swiglu_backward(exec_, sgu, sdact, sdgu, Tensor(), sdgu_amax);
    }
    shared_gate_up_proj_.backward(x, sdgu, dx, true, sdgu_amax);
  }
  // The router: the weights' gradient, the balance loss's (through the probabilities) and
  // the z-loss's (on the logits), scaled as the step's per-micro-batch terms; under the step
  // scope they are the step's losses, whose gradients are not divided among the micro-batches.
  const double scale = losses_.per_micro_batch_scale, loss_share = step_scope() ? 1.0 : scale;
  Tensor dprobs;
  if (aux_slot_ >= 0) {
    dprobs = scope.take(wide, Shape{t, e_count});
    ops::balance_loss_backward(exec_, probs, d.counts, k, router_grad_scale(loss_share * moe_.aux_loss), dprobs, balance_counts_);
  }
  const Tensor dlogits = scope.take(wide, Shape{t, e_count});
  router_->backward(routes, probs, router_saved_.rows(0, t), dweights, dprobs, dlogits, scope.take(wide, Shape{t, e_count}),
                    router_grad_scale(scale));
  if (z_slot_ >= 0) ops::router_z_loss_backward(exec_, logits, router_grad_scale(loss_share * moe_.z_loss), dlogits, step_tokens());
  ops::router_logits_backward(exec_, x, router_w_, dlogits, scope.take(dt, Shape{t, e_count}), dx, router_g_);
}

// The step's routed choices reach the router (sigmoid_bias balances by them), then become
// the last step's (and extend the dead experts' runs) for report(): kernels on the GPU,
// nothing read back here.
void MoeMlp::after_step(bool applied) {
  if (applied) router_->after_step(step_counts_, step_entropy_.rows(1, 2));
  ops::moe_end_step(exec_, step_counts_, step_entropy_, last_counts_, last_entropy_, dead_steps_);
  ops::moe_take_counts(exec_, step_dropped_, last_dropped_);
}

// Reads the last step's load back (a synchronization on the GPU: log steps only).
void MoeMlp::report(std::vector<std::pair<std::string, double>>& out) const {
  const ops::MoeLoadReport load = ops::moe_load_report(exec_, last_counts_, last_entropy_, dead_steps_);
  const std::string prefix = fmt::format("moe.{}.", layer_);
  out.insert(out.end(), {{prefix + "load_min", load.min},
                         {prefix + "load_max", load.max},
                         {prefix + "load_cv", load.cv},
                         {prefix + "dead", static_cast<double>(load.dead)},
                         {prefix + "dead_steps_max", static_cast<double>(load.dead_steps_max)},
                         {prefix + "entropy", load.entropy}});
  if (moe_.capacity_factor > 0 && router_->capacity_drops()) {
    // The pairs the capacity dropped in the last step, and their share of the routed ones.
    const double dropped = static_cast<double>(ops::moe_read_count(exec_, last_dropped_));
    out.insert(out.end(), {{prefix + "dropped", dropped}, {prefix + "dropped_share", load.routed > 0 ? dropped / load.routed : 0.0}});
  }
  router_->report(prefix, out);
}

// The step's routed tokens (f64 [1], balance_counts_' last), undefined outside the step scope.
Tensor MoeMlp::step_tokens() const {
  return step_scope() ? balance_counts_.rows(moe_.experts, moe_.experts + 1) : Tensor();
}

// A router loss's gradient scale: `factor` (its coefficient over the micro-batches, or its
// share of the step) times the loss scale S, as the LM head's S / targets carries S: the
// host's, or the captured step's in device memory (LossContext).
ops::GradScale MoeMlp::router_grad_scale(double factor) const {
  if (losses_.loss_scale_on_device) return {factor, losses_.loss_scale_on_device};
  return factor * losses_.loss_scale;
}

ops::Routes MoeMlp::routes_rows(int64_t t) const {
  return {routes_.experts.rows(0, t), routes_.weights.rows(0, t)};
}

ops::MoeDispatch MoeMlp::dispatch_rows(int64_t t) const {
  ops::MoeDispatch d = dispatch_;
  d.pair_of_row = dispatch_.pair_of_row.rows(0, router_->most_pairs(t));
  d.row_of_pair = dispatch_.row_of_pair.rows(0, t * slots_);
  return d;
}

std::unique_ptr<BranchDecoder> MoeMlp::make_decoder(DecodeContext& ctx, const Norm& pre_norm) const {
  (void)pre_norm;
  if (const std::string why = router_->not_causal(); !why.empty())
    fail("model.moe.router", "'{}' cannot be decoded with a KV cache (kiln sample, kiln serve): {}", moe_.router, why);
  return make_moe_decoder(*this, ctx);
}

void register_moe_mlp(MlpRegistry& registry) {
  registry.add("moe", "routed SwiGLU experts + optional shared expert ([model.moe]; DeepSeekMoE / Qwen3-MoE; "
               "LatentMoE with model.moe.latent_width)",
               [](BuildContext& ctx, const LayerSpec& layer) { return std::make_unique<MoeMlp>(ctx, layer); });
}

}  // namespace kiln
