#include "model/activation_frames.h"

#include "core/device_memory.h"
#include "core/error.h"

#include <algorithm>

namespace kiln {

ActivationFrames::ActivationFrames(Arena& arena, std::vector<Tensor*>& views, const std::vector<FrameSegment>& blocks,
                                   const std::vector<bool>& framed, int frames)
    : arena_(arena), views_(views) {
  KILN_CHECK(frames >= 1, "model", "{} activation frames: at least one is needed", frames);
  KILN_CHECK(arena.allocated(), "model", "activation frames before the model's allocation");
  KILN_CHECK(framed.size() == blocks.size(), "model", "{} blocks, {} framed flags", blocks.size(), framed.size());
  // The framed runs: the gaps between blocks (the model's own state) and the framed blocks.
  FrameSegment gap;
  const auto add = [&](const FrameSegment& run) {
    if (run.first_entry < run.last_entry || run.first_view < run.last_view) runs_.push_back(run);
  };
  for (size_t b = 0; b < blocks.size(); ++b) {
    const FrameSegment& block = blocks[b];
    KILN_CHECK(block.first_entry >= gap.first_entry && block.first_view >= gap.first_view, "model",
               "block {}'s activation segment is out of order", b);
    gap.last_entry = block.first_entry, gap.last_view = block.first_view;
    add(gap);
    if (framed[b]) add(block);
    gap.first_entry = block.last_entry, gap.first_view = block.last_view;
  }
  gap.last_entry = arena.entry_count(), gap.last_view = views.size();
  add(gap);
  for (const FrameSegment& run : runs_) {
    run_offsets_.push_back(region_bytes_);
    region_bytes_ += arena.offset_of(run.last_entry) - arena.offset_of(run.first_entry);
  }
  for (int f = 1; f < frames; ++f) {
    regions_.emplace_back(arena.device(), std::max<size_t>(region_bytes_, 1));
    device_memset_zero(regions_.back().data(), arena.device(), regions_.back().bytes());
  }
  kept_.resize(static_cast<size_t>(frames));
}

void ActivationFrames::select(int frame) {
  KILN_CHECK(frame >= 0 && frame < frames(), "model", "activation frame {} of {}", frame, frames());
  if (frame == current_) return;
  std::vector<Tensor>& leaving = kept_[static_cast<size_t>(current_)];
  leaving.clear();
  for (const FrameSegment& run : runs_)
    for (size_t v = run.first_view; v < run.last_view; ++v) leaving.push_back(*views_[v]);
  std::vector<Tensor>& entering = kept_[static_cast<size_t>(frame)];
  size_t next = 0;
  for (size_t r = 0; r < runs_.size(); ++r) {
    const FrameSegment& run = runs_[r];
    void* region =
        frame == 0 ? nullptr : static_cast<char*>(regions_[static_cast<size_t>(frame) - 1].data()) + run_offsets_[r];
    arena_.bind_entries(run.first_entry, run.last_entry, region);
    for (size_t v = run.first_view; v < run.last_view; ++v, ++next)
      *views_[v] = next < entering.size() ? entering[next] : Tensor();
  }
  current_ = frame;
}

}  // namespace kiln
