#include "model/activation_frames.h"

#include "core/device_memory.h"
#include "core/error.h"

#include <algorithm>

namespace kiln {

ActivationFrames::ActivationFrames(Arena& arena, const std::vector<Tensor*>& views, int frames)
    : arena_(arena), views_(views) {
  KILN_CHECK(frames >= 1, "model", "{} activation frames: at least one is needed", frames);
  kept_.resize(static_cast<size_t>(frames));
}

void ActivationFrames::allocate() {
  KILN_CHECK(regions_.empty(), "model", "activation frames allocated twice");
  // Every region non-empty, so that each frame's tensors have an address of their own.
  const size_t bytes = std::max<size_t>(arena_.planned_bytes(), 1);
  for (size_t f = 0; f < kept_.size(); ++f) {
    regions_.emplace_back(arena_.device(), bytes);
    device_memset_zero(regions_.back().data(), arena_.device(), bytes);
    kept_[f].assign(views_.size(), Tensor());
  }
  arena_.bind_shared(regions_[0].data());
  current_ = 0;
}

void ActivationFrames::select(int frame) {
  KILN_CHECK(!regions_.empty(), "model", "activation frame selected before allocation");
  KILN_CHECK(frame >= 0 && frame < frames(), "model", "activation frame {} of {}", frame, frames());
  if (frame == current_) return;
  std::vector<Tensor>& leaving = kept_[static_cast<size_t>(current_)];
  leaving.resize(views_.size());
  for (size_t i = 0; i < views_.size(); ++i) leaving[i] = *views_[i];
  arena_.rebind(regions_[static_cast<size_t>(frame)].data());
  std::vector<Tensor>& entering = kept_[static_cast<size_t>(frame)];
  entering.resize(views_.size());
  for (size_t i = 0; i < views_.size(); ++i) *views_[i] = entering[i];
  current_ = frame;
}

}  // namespace kiln
