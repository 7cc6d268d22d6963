// Activation frames: the saved state of several micro-batches at once, for the layers a
// pipeline rank runs. A model keeps what its backward reads -- saved activations, its loaded
// batch, the routes of its MoE layers -- in one arena planned for one micro-batch
// (BuildContext::saved*), plus a few views into it that modules keep from forward to
// backward (a norm's input, BuildContext::kept_view). Each block's entries and views are one
// segment of that arena (model/backbone.h records them); what lies outside every block is
// the model's own state (its batch, the final norm's, the residual stream's last row).
//
// F frames: frame 0 is the arena's own memory; frames 1..F-1 are regions holding a copy of
// the framed segments only -- the blocks a rank runs and the model's own state. Selecting a
// frame binds the framed segments' tensors into its memory and gives their views back the
// values they had when that frame was last left, so a forward run in frame a and a backward
// run later in frame a see the same memory, whatever ran in other frames in between. Other
// blocks' tensors stay where they are: one copy, for passes over the whole model
// (validation). Buffers no micro-batch owns (tables, scratch, step statistics) live in arenas
// of their own, shared by every frame.
#pragma once

#include "core/arena.h"
#include "core/tensor.h"

#include <vector>

namespace kiln {

// A run of the activation arena's entries [first_entry, last_entry) and of the kept views
// [first_view, last_view).
struct FrameSegment {
  size_t first_entry = 0, last_entry = 0;
  size_t first_view = 0, last_view = 0;
};

class ActivationFrames {
 public:
  // `arena`: allocated; `views`: every kept view into it; `blocks`: each block's segment, in
  // order and disjoint; `framed`: per block, whether its segment gets frames. The model's
  // own state (everything outside the blocks' segments) always does. Allocates the regions of
  // frames 1..frames-1, zero-filled.
  ActivationFrames(Arena& arena, std::vector<Tensor*>& views, const std::vector<FrameSegment>& blocks,
                   const std::vector<bool>& framed, int frames);

  int frames() const { return static_cast<int>(kept_.size()); }
  int current() const { return current_; }
  size_t region_bytes() const { return region_bytes_; }  // each frame beyond the first
  size_t extra_bytes() const { return region_bytes_ * regions_.size(); }

  // Keeps the current frame's views, binds `frame`'s memory and gives the views back the
  // values they had when that frame was last left (undefined before its first use).
  void select(int frame);

 private:
  Arena& arena_;
  std::vector<Tensor*>& views_;
  std::vector<FrameSegment> runs_;  // the framed segments, in arena order
  std::vector<size_t> run_offsets_;  // each run's offset in a region
  size_t region_bytes_ = 0;
  std::vector<Storage> regions_;            // frames 1..F-1
  std::vector<std::vector<Tensor>> kept_;   // per frame, its framed views' values while it is not current
  int current_ = 0;
};

}  // namespace kiln
