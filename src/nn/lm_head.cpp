#include "nn/lm_head.h"

#include "config/config.h"
#include "core/op_profiler.h"
#include "nn/mup.h"

#if KILN_WITH_CUDA
#include "ops/cross_entropy/cross_entropy_cuda.h"
#include "ops/decode/decode_kernels.h"
#endif

#include <algorithm>
#include <cmath>

namespace kiln {

LmHead::LmHead(BuildContext& ctx, const ModelConfig& m, const Tensor& embed, const Tensor& embed_grad,
               const LmHeadSpec& spec, int first_slot)
    : exec_(ctx.exec), tied_(m.tie_embeddings), softcap_(m.logit_softcap), spec_(spec), embed_(embed), embed_grad_(embed_grad),
      first_slot_(first_slot) {
  check_mup(m);
  // muP: a zero head, so the logits start at 0 and move at a width-independent rate.
  if (!tied_)
    ctx.parameter(weight_, grad_, ParamName{"lm_head.weight", "lm_head.weight", "output.weight"},
                  Shape{m.vocab_size, m.hidden}, ParamRole::head,
                  mup_enabled(m) ? Init::zeros() : Init::normal(m.init_std));
  const int64_t chunk = std::min(spec.chunk_rows, ctx.max_tokens);
  spec_.chunk_rows = chunk;
  ctx.buffer(scratch_.logits, Shape{chunk, ops::lm_head_logits_cols(m.vocab_size)}, ctx.dtype);
  ctx.buffer(scratch_.row_stats, Shape{chunk, 2}, DType::f64);
  if (ops::lm_head_needs_padded_weight(m.vocab_size, ctx.device, ctx.dtype))
    ctx.buffer(scratch_.padded_weight, Shape{ops::lm_head_logits_cols(m.vocab_size), m.hidden}, ctx.dtype);
}

void LmHead::loss(const Tensor& hidden, const Tensor& targets, LossScale scale, const Tensor& dhidden,
                  LossSlotSums& sums, double* device_sums) {
  loss_through(weight(), weight_grad(), spec_.weight, first_slot_, hidden, targets, scale, dhidden, sums, device_sums);
}

void LmHead::loss_through(const Tensor& w, const Tensor& dw, double weight, int first_slot, const Tensor& hidden,
                          const Tensor& targets, LossScale scale, const Tensor& dhidden, LossSlotSums& sums,
                          double* device_sums) {
  ops::LmHeadLossOptions o;
  o.chunk_rows = spec_.chunk_rows;
  o.z_loss = spec_.z_loss;
  o.softcap = softcap_;
  o.loss_scale = scale.host;
  o.weight = weight;
  o.loss_scale_on_device = scale.device;
  o.sums_on_device = device_sums ? device_sums + first_slot : nullptr;
  const ops::LossSums s =
      ops::lm_head_loss(exec_, hidden, w, targets, o, scratch_, dhidden, dhidden.defined() ? dw : Tensor());
  sums[static_cast<size_t>(first_slot)] = s.loss;
  sums[static_cast<size_t>(first_slot + 1)] = s.z;
  sums[static_cast<size_t>(first_slot + 2)] = static_cast<double>(s.count);
}

void LmHead::logits(const Tensor& hidden, std::vector<float>& out) {
  const int64_t rows = hidden.size(0), vocab = weight().size(0);
  KILN_CHECK(rows <= spec_.chunk_rows, "model", "logits of {} rows at once (at most {})", rows, spec_.chunk_rows);
  // The chunk's memory as dense [rows, V] (the loss's padded rows are not needed here).
  const Tensor logits(scratch_.logits.raw(), scratch_.logits.dtype(), scratch_.logits.device(), Shape{rows, vocab});
  // bf16 logits (the GPU's mixed path) take the softcap here, in fp32, after the copy:
  // lm_head_logits caps f32 logits only.
  const bool cap_on_host = logits.dtype() == DType::bf16 && softcap_ > 0;
  ops::lm_head_logits(exec_, hidden, weight(), cap_on_host ? 0.0 : softcap_, logits);
  OwnedTensor host(logits.dtype(), Device::cpu, logits.shape());
  copy_tensor(logits, *host);
  out.resize(static_cast<size_t>(rows * vocab));
  const DType dtype = host->dtype();
  for (int64_t i = 0; i < rows * vocab; ++i)
    out[static_cast<size_t>(i)] = dtype == DType::f32    ? host->data<float>()[i]
                                  : dtype == DType::bf16 ? bf16_to_float(static_cast<const uint16_t*>(host->raw())[i])
                                                         : static_cast<float>(host->data<double>()[i]);
  if (cap_on_host) {
    const auto cap = static_cast<float>(softcap_);
    for (float& x : out) x = cap * std::tanh(x / cap);
  }
}

// A tied head is the embedding (Hugging Face: tie_word_embeddings; GGUF: no output.weight).
void LmHead::export_config(ExportConfig& out) const {
  const bool hf = out.format() == ExportConfig::Format::hf;
  if (out.gemma() && hf)  // written either way: Gemma2Config's default caps the logits at 30
    out.set("final_logit_softcapping", softcap_ > 0 ? nlohmann::json(softcap_) : nlohmann::json(nullptr),
            "model.logit_softcap");
  else if (out.gemma() && softcap_ > 0)
    out.set("final_logit_softcapping", static_cast<float>(softcap_), "model.logit_softcap");
  else if (softcap_ > 0)
    out.refuse("model.logit_softcap", fmt::format("{}", softcap_), "its LM head has no softcap");
  if (hf) return out.set("tie_word_embeddings", tied_, "model.tie_embeddings");
  if (tied_ && out.is("dots1"))
    out.refuse("model.tie_embeddings", "true", "llama.cpp's dots1 reads a separate output matrix");
  // llama.cpp's gemma2 caps the logits always (tanh(x / cap) * cap; 0 divides by zero) and
  // reads token_embd as its output matrix; its gemma3 caps when the key is there.
  if (out.is("gemma2") && softcap_ <= 0)
    out.refuse("model.logit_softcap", "0", "llama.cpp's gemma2 always softcaps the logits (set a cap)");
  if (out.is("gemma2") && !tied_)
    out.refuse("model.tie_embeddings", "false", "llama.cpp's gemma2 reads token_embd as its output matrix");
}

std::unique_ptr<HeadDecoder> LmHead::make_decoder(DecodeContext& ctx, const Norm& final_norm) const {
  return std::make_unique<HeadDecoder>(weight(), softcap_, ctx, final_norm);
}

HeadDecoder::HeadDecoder(const Tensor& weight, double softcap, DecodeContext& ctx, const Norm& final_norm)
    : exec_(ctx.exec), weight_(weight), softcap_(softcap) {
#if KILN_WITH_CUDA
  const std::optional<RmsNormForm> norm = final_norm.rms_form();
  const int64_t rows = std::min<int64_t>(ctx.fused_branch_rows, ctx.max_rows);
  fused_ = ctx.device == Device::cuda && ctx.fuse && rows > 0 && ctx.dtype == DType::bf16 && norm &&
           cuda::decode_gemv_fits(rows, weight.size(1));
  if (fused_) norm_ = *norm;
#else
  (void)ctx, (void)final_norm;
#endif
}

void HeadDecoder::logits(const Tensor& h, const Tensor& out) { ops::lm_head_logits(exec_, h, weight_, softcap_, out); }

void HeadDecoder::logits_fused([[maybe_unused]] const Tensor& x, [[maybe_unused]] const Tensor& out) {
#if KILN_WITH_CUDA
  const int64_t n = x.size(0), vocab = weight_.size(0);
  OpScope op("final norm + lm head (fused)", Device::cuda);
  cuda::norm_gemv(exec_, DType::f32, x.data<float>(), norm_.gain.data<float>(), static_cast<float>(norm_.eps), n, x.size(1),
                  weight_.raw(), vocab, out.raw());
  if (softcap_ > 0) cuda::softcap_f32(exec_, out.data<float>(), n * vocab, static_cast<float>(softcap_));
#endif
}

}  // namespace kiln
