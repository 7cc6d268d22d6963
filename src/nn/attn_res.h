// Block Attention Residuals (Kimi Team, "Attention Residuals", 2026; docs/attn-res.md), the
// opt-in alternative to the plain residual stream (model.attn_res_block = S > 0).
//
// The model's 2L sublayers (each layer's attention, then its MLP) fall into blocks of S in
// order. Sublayer j reads not the running sum of every output before it but a mix over
// depth of its sources: the embedding, each completed block (the sum of its sublayers'
// outputs) and the partial sum of its own block so far (none at a block's first sublayer):
//   input_j = sum_s a_s V_s,   a = softmax_s(w_j . RMSNorm(V_s))   (ops/attn_res)
// with a zero-initialized pseudo-query w_j [hidden] per sublayer (zero: the sources' plain
// mean). The final norm reads the same mix over the sources after the last sublayer, with a
// query of its own. input_j then goes through the sublayer's own pre-norm, which stands for
// the paper's RMSNorm of the mix: the mix is not normalized twice.
//
// Sublayer 0 has the embedding alone for a source; a softmax over one source is exactly 1,
// so it reads the embedding itself and has no query (it would never get a gradient).
//
// Memory: one saved [T, hidden] per sublayer, the running sum of its block after it
// (sums_[j]); a completed block is its last one, kept once and read by every later mix.
// The mixed inputs live in the buffers the plain stream would use (Backbone).
//
// GPU (ops/attn_res/attn_res_cuda.h): fp32, and on the mixed path the same fp32 mix beside
// the bf16 branches: the sources (the embedding, the block sums), the mixes and their
// gradients are wide; a sublayer's bf16 output is added into its block's fp32 sum, and
// its output gradient reaches it as a bf16 copy of the block sum's.
#pragma once

#include "nn/modules.h"

#include <span>
#include <vector>

namespace kiln {

class BlockAttnRes {
 public:
  BlockAttnRes(BuildContext& ctx, const ModelConfig& config);

  int64_t sublayers() const { return sublayers_; }
  int64_t block_size() const { return block_; }
  int64_t blocks() const { return block_of(sublayers_ - 1) + 1; }  // the last may be partial
  // Forward FLOPs per token of every mix: per source its squares, its score and its weighted
  // add, 2 x hidden each.
  double forward_flops_per_token() const;
  // forward: input [rows, hidden] = the mix of sublayer j's sources (j = sublayers(): the
  // final read), embedding the embedding's output; j >= 1.
  void mix(int64_t j, const Tensor& embedding, const Tensor& input) const;
  // forward: sublayer j's output joins its block's running sum.
  void add_output(int64_t j, const Tensor& out) const;

  // Scratch [rows, hidden]: a sublayer's output on its way into the sum (compute dtype),
  // and (training) the gradient of a mix's output.
  Tensor output(int64_t rows) const { return output_.rows(0, rows); }
  Tensor input_grad(int64_t rows) const { return input_grad_.rows(0, rows); }

  // Decode (no backward, so no sum per sublayer): the mix of sublayer j for rows whose
  // blocks' sums are block_sums[b], j's own block holding its partial sum.
  void mix_blocks(int64_t j, const Tensor& embedding, std::span<const Tensor> block_sums, const Tensor& input) const;

  // backward, sublayers in reverse after the final read: zeroes the block sums' gradients.
  void begin_backward(int64_t rows) const;
  // d(sublayer j's output), [rows, hidden]: complete once every mix after j is through
  // mix_backward (the gradient of its block's sum, the later partial sums' added in). In the
  // compute dtype: on the mixed path a bf16 copy of the fp32 sum's gradient, made by this
  // call (read it before the next call).
  Tensor output_grad(int64_t j, int64_t rows) const;
  // The gradient of mix(j) from d(input): into dembedding (+=), the sums it read and its
  // query's gradient (+=).
  void mix_backward(int64_t j, const Tensor& embedding, const Tensor& dinput, const Tensor& dembedding) const;

 private:
  int64_t block_of(int64_t j) const { return j / block_; }  // of sublayer j
  // The running sums sublayer j reads (completed blocks, then its partial sum), by index m:
  // sums_[m - 1] holds the sum of sublayer m - 1's block up to and including it.
  std::vector<int64_t> sums_read(int64_t j) const;

  const ExecContext& exec_;
  int64_t block_ = 0, sublayers_ = 0, hidden_ = 0;
  double eps_ = 0;
  // queries_[j]: sublayer j's pseudo-query (j >= 1; [sublayers]: the final read's).
  std::vector<Tensor> queries_, query_grads_;
  std::vector<Tensor> sums_;   // [sublayers] saved [T, hidden]
  std::vector<Tensor> grads_;  // per block [T, hidden]: d(its sum), training only
  Tensor output_, input_grad_;
  Tensor output_grad_compute_;  // mixed path, training: output_grad's bf16 copy
};

}  // namespace kiln
