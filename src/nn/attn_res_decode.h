// Block Attention Residuals in the decoder (nn/attn_res.h). The mix runs over depth, never
// over positions: a step's row reads its own embedding and its own block sums, so decode
// keeps no state between steps beyond the blocks' (KV caches, recurrent states). Per step it
// holds each block's sum for the step's rows, the current one partial.
#pragma once

#include "nn/attn_res.h"
#include "nn/block.h"

#include <memory>
#include <vector>

namespace kiln {

class AttnResDecoder {
 public:
  // Plans the blocks' sums and the mix in ctx.state ([max_rows, hidden] wide each).
  AttnResDecoder(DecodeContext& ctx, const BlockAttnRes& res, int64_t hidden);
  // From s.x = the rows' embedding through every block, sublayer by sublayer; leaves the
  // final read in s.x (nothing pending) for the final norm.
  void forward(const std::vector<std::unique_ptr<BlockDecoder>>& blocks, DecodeStepBuffers& s,
               const DecodeRows& rows);

 private:
  const ExecContext& exec_;
  const BlockAttnRes& res_;
  bool mixed_;                // sums wide, sublayer outputs in the compute dtype (the GPU's bf16)
  std::vector<Tensor> sums_;  // per block [max_rows, hidden]
  Tensor mix_;                // [max_rows, hidden]: a sublayer's input, then the final read
};

}  // namespace kiln
