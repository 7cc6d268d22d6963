// A pre-norm transformer block on the flat residual stream:
//   h = x + attention(norm1(x));   y = h + mlp(norm2(h))
#pragma once

#include "nn/modules.h"

namespace kiln {

class TransformerBlock {
 public:
  TransformerBlock(BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position);

  // x [T, hidden] (kept for backward) -> y [T, hidden].
  void forward(const Tensor& x, const SeqInfo& seq, const Tensor& y);
  // In place on the residual-stream gradient: on entry dres = dL/dy, on exit dL/dx.
  // dres_compute is dres in the compute dtype, current on entry and kept current: a bf16
  // copy on the mixed path (the norm backwards write it), otherwise dres itself.
  void backward(const Tensor& dres, const Tensor& dres_compute, const SeqInfo& seq);

 private:
  Workspace& workspace_;
  DType compute_dtype_;  // of the branches (norm outputs, branch outputs and gradients)
  bool mixed_;           // residual stream wider than the branches (the GPU's bf16 path)
  std::unique_ptr<Norm> attn_norm_, mlp_norm_;
  std::unique_ptr<Attention> attention_;
  std::unique_ptr<Mlp> mlp_;
  Tensor mid_;  // saved: h (the norm outputs are recomputed in backward)
};

}  // namespace kiln
