#include "nn/attn_res.h"

#include "ops/attn_res/attn_res.h"
#include "ops/elementwise/elementwise.h"

#include <string>

namespace kiln {

BlockAttnRes::BlockAttnRes(BuildContext& ctx, const ModelConfig& config)
    : exec_(ctx.exec), block_(config.attn_res_block),
      sublayers_(2 * config.layers),
      hidden_(config.hidden),
      eps_(config.norm_eps) {
  // The GPU kernel takes a bounded number of sources; the final read has the most.
  const auto most_sources = static_cast<int64_t>(1 + sums_read(sublayers_).size());
  KILN_CHECK(ctx.device == Device::cpu || most_sources <= ops::kAttnResGpuMaxSources, "model.attn_res_block",
             "{} sublayers per block over {} sublayers: the final read mixes {} sources, the GPU kernel at most {}",
             block_, sublayers_, most_sources, ops::kAttnResGpuMaxSources);
  const int64_t t = ctx.max_tokens, d = config.hidden;
  queries_.resize(static_cast<size_t>(sublayers_ + 1));
  query_grads_.resize(queries_.size());
  // Role norm: a per-channel vector, no weight decay (a decayed query drifts back toward the
  // plain mean). No HF or GGUF name: no stock family has them, the exporters refuse them.
  for (int64_t j = 1; j <= sublayers_; ++j) {
    const std::string name = j == sublayers_ ? "attn_res.final_query"
                                             : "layers." + std::to_string(j / 2) + ".attn_res." +
                                                   (j % 2 == 0 ? "attn_query" : "mlp_query");
    ctx.parameter(queries_[static_cast<size_t>(j)], query_grads_[static_cast<size_t>(j)], ParamName{name, "", ""},
                  Shape{d}, ParamRole::norm, Init::zeros());
  }
  sums_.resize(static_cast<size_t>(sublayers_));
  for (Tensor& s : sums_) ctx.saved_wide(s, Shape{t, d});
  ctx.buffer(output_, Shape{t, d}, ctx.dtype);
  if (ctx.training) {
    ctx.buffer(input_grad_, Shape{t, d}, ctx.master_dtype);
    grads_.resize(static_cast<size_t>(block_of(sublayers_ - 1) + 1));
    for (Tensor& g : grads_) ctx.buffer(g, Shape{t, d}, ctx.master_dtype);
    // The mixed path's branches take their output's gradient in bf16: a copy of the block's.
    if (ctx.mixed()) ctx.buffer(output_grad_compute_, Shape{t, d}, ctx.dtype);
  }
}

std::vector<int64_t> BlockAttnRes::sums_read(int64_t j) const {
  std::vector<int64_t> read;
  for (int64_t m = block_; m <= j; m += block_) read.push_back(m);  // the completed blocks
  if (j % block_ != 0) read.push_back(j);                          // the partial sum of j's block
  return read;
}

double BlockAttnRes::forward_flops_per_token() const {
  double sources = 0;
  for (int64_t j = 1; j <= sublayers_; ++j) sources += 1.0 + static_cast<double>(sums_read(j).size());
  return 6.0 * static_cast<double>(hidden_) * sources;
}

void BlockAttnRes::mix(int64_t j, const Tensor& embedding, const Tensor& input) const {
  KILN_CHECK(j >= 1 && j <= sublayers_, "attn_res", "mix of sublayer {} outside [1, {}]", j, sublayers_);
  const int64_t rows = input.size(0);
  std::vector<Tensor> sources{embedding};
  for (int64_t m : sums_read(j)) sources.push_back(sums_[static_cast<size_t>(m - 1)].rows(0, rows));
  ops::attn_res_mix_forward(exec_, sources, queries_[static_cast<size_t>(j)], eps_, input);
}

void BlockAttnRes::mix_blocks(int64_t j, const Tensor& embedding, std::span<const Tensor> block_sums,
                              const Tensor& input) const {
  KILN_CHECK(j >= 1 && j <= sublayers_, "attn_res", "mix of sublayer {} outside [1, {}]", j, sublayers_);
  std::vector<Tensor> sources{embedding};
  for (int64_t b = 0; b < block_of(j); ++b) sources.push_back(block_sums[static_cast<size_t>(b)]);
  if (j % block_ != 0) sources.push_back(block_sums[static_cast<size_t>(block_of(j))]);
  ops::attn_res_mix_forward(exec_, sources, queries_[static_cast<size_t>(j)], eps_, input);
}

void BlockAttnRes::add_output(int64_t j, const Tensor& out) const {
  const int64_t rows = out.size(0);
  const Tensor sum = sums_[static_cast<size_t>(j)].rows(0, rows);
  if (j % block_ == 0) {
    ops::convert(exec_, out, sum);  // the block's first output starts its sum
  } else {
    ops::add(exec_, sums_[static_cast<size_t>(j - 1)].rows(0, rows), out, sum);
  }
}

void BlockAttnRes::begin_backward(int64_t rows) const {
  for (const Tensor& g : grads_) ops::zero(exec_, g.rows(0, rows));  // on the stream: captured steps
}

Tensor BlockAttnRes::output_grad(int64_t j, int64_t rows) const {
  const Tensor grad = grads_.at(static_cast<size_t>(block_of(j))).rows(0, rows);
  if (!output_grad_compute_.defined()) return grad;
  const Tensor copy = output_grad_compute_.rows(0, rows);
  ops::convert(exec_, grad, copy);
  return copy;
}

void BlockAttnRes::mix_backward(int64_t j, const Tensor& embedding, const Tensor& dinput,
                                const Tensor& dembedding) const {
  const int64_t rows = dinput.size(0);
  std::vector<Tensor> sources{embedding}, grads{dembedding};
  for (int64_t m : sums_read(j)) {
    sources.push_back(sums_[static_cast<size_t>(m - 1)].rows(0, rows));
    // sums_[m - 1] is a sum of outputs of sublayer m - 1's block: its gradient is the
    // block's, which output_grad hands to each of them (a partial sum's reaches only the
    // outputs before it, as the later ones take theirs before this one is added).
    grads.push_back(grads_.at(static_cast<size_t>(block_of(m - 1))).rows(0, rows));
  }
  ops::attn_res_mix_backward(exec_, sources, queries_[static_cast<size_t>(j)], eps_, dinput, grads,
                             query_grads_[static_cast<size_t>(j)]);
}

}  // namespace kiln
