#include "nn/slot_state.h"

namespace kiln {

namespace {

// The state as [slots, row]: one slot's elements are contiguous.
Tensor by_slot(const Tensor& state) { return state.view(Shape{state.size(0), state.numel() / state.size(0)}); }

}  // namespace

void copy_slot_positions(const Tensor& state, int32_t from, int32_t to, int64_t positions) {
  const int64_t len = state.size(1), row = state.numel() / (state.size(0) * len);
  const Tensor flat = state.view(Shape{state.size(0) * len, row});
  copy_tensor(flat.rows(from * len, from * len + positions), flat.rows(to * len, to * len + positions));
}

void copy_slot_whole(const Tensor& state, int32_t from, int32_t to) {
  const Tensor slots = by_slot(state);
  copy_tensor(slots.rows(from, from + 1), slots.rows(to, to + 1));
}

void zero_slot(const Tensor& state, int32_t slot) { zero_tensor(by_slot(state).rows(slot, slot + 1)); }

}  // namespace kiln
