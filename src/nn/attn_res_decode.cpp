#include "nn/attn_res_decode.h"

#include "ops/elementwise/elementwise.h"

namespace kiln {

AttnResDecoder::AttnResDecoder(DecodeContext& ctx, const BlockAttnRes& res, int64_t hidden)
    : exec_(ctx.exec), res_(res), mixed_(ctx.mixed()) {
  sums_.resize(static_cast<size_t>(res.blocks()));
  for (Tensor& s : sums_) ctx.state.reserve(s, ctx.wide, Shape{ctx.max_rows, hidden});
  ctx.state.reserve(mix_, ctx.wide, Shape{ctx.max_rows, hidden});
}

void AttnResDecoder::forward(const std::vector<std::unique_ptr<BlockDecoder>>& blocks, DecodeStepBuffers& s,
                             const DecodeRows& rows) {
  const int64_t n = rows.count, size = res_.block_size();
  std::vector<Tensor> sums;
  for (const Tensor& t : sums_) sums.push_back(t.rows(0, n));
  const Tensor embedding = s.x, mix = mix_.rows(0, n);
  for (size_t l = 0; l < blocks.size(); ++l)
    for (const Sublayer which : {Sublayer::attention, Sublayer::mlp}) {
      const auto j = static_cast<int64_t>(2 * l) + (which == Sublayer::mlp ? 1 : 0);
      if (j > 0) res_.mix_blocks(j, embedding, sums, mix);  // sublayer 0 reads the embedding itself
      blocks[l]->sublayer(which, j > 0 ? mix : embedding, rows, s.h, s.branch);
      const Tensor& sum = sums[static_cast<size_t>(j / size)];
      // A block's first output starts its sum (widened on the mixed path); the others add
      // into it, as the training forward's BlockAttnRes::add_output does.
      if (j % size == 0) {
        ops::convert(exec_, s.branch, sum);
      } else {
        residual_add(exec_, sum, s.branch, mixed_);
      }
    }
  res_.mix_blocks(res_.sublayers(), embedding, sums, mix);
  ops::convert(exec_, mix, s.x);  // on the stream: a captured step
  s.pending = false;
}

}  // namespace kiln
