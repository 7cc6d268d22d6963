// Activation frames: the saved state of several micro-batches at once. A model keeps what
// its backward reads -- saved activations, its loaded batch, the routes of its MoE layers --
// in one arena planned for one micro-batch (BuildContext::saved*), plus a few views of it
// that modules keep from forward to backward (a norm's input, BuildContext::kept_view).
// With F frames that arena is bound to one of F regions at a time: selecting a frame binds
// its region and restores the views the frame had, so a forward run in frame a and a
// backward run later in frame a see the same memory, whatever ran in the other frames in
// between. Pipeline stages hold one frame per micro-batch in flight
// (train/pipeline_model_stage.h) instead of running the forward again before the backward.
//
// Buffers no micro-batch owns (tables, scratch, step statistics) live in arenas of their
// own and are shared by every frame.
#pragma once

#include "core/arena.h"
#include "core/tensor.h"

#include <vector>

namespace kiln {

class ActivationFrames {
 public:
  // `arena`: one micro-batch's state, planned and not yet bound; `views`: the kept views
  // into it (read when frames change, so modules may still add theirs until allocate()).
  ActivationFrames(Arena& arena, const std::vector<Tensor*>& views, int frames);

  int frames() const { return static_cast<int>(kept_.size()); }
  int current() const { return current_; }
  size_t planned_bytes() const { return arena_.planned_bytes() * kept_.size(); }

  // One zero-filled region per frame, once; binds frame 0.
  void allocate();
  // Keeps the current frame's views, binds `frame`'s region and gives the views back the
  // values they had when that frame was last left (undefined before its first use).
  void select(int frame);

 private:
  Arena& arena_;
  const std::vector<Tensor*>& views_;
  std::vector<Storage> regions_;
  std::vector<std::vector<Tensor>> kept_;  // per frame, the views' values while it is not current
  int current_ = 0;
};

}  // namespace kiln
