// Decode state indexed by slot: a component whose state between steps is a tensor
// [slots, max_len, ...] (attention's K and V caches) registers it here against the Arena
// it is planned in (DecodeContext::state). The Decoder that owns that arena can then copy
// one slot's first positions into another (Decoder::copy_slot: a prompt prefilled once and
// continued by several sequences) without knowing its components, and the components
// without state between steps (norms, MLPs, MoE's per-step buffers) need nothing at all.
#pragma once

#include "core/arena.h"

#include <cstdint>

namespace kiln {

// `state` must stay at its address while registered (a member of a heap-held decoder
// object); its first dimension is the slot and its second the position.
void register_slot_state(const Arena& arena, const Tensor* state);
void unregister_slot_state(const Arena& arena, const Tensor* state);

// Positions [0, positions) of slot `from` into slot `to`, in every state registered
// against `arena`: one copy each (the slot's rows are contiguous), a memcpy on the CPU and
// a device-to-device copy on the GPU.
void copy_slot_states(const Arena& arena, int32_t from, int32_t to, int64_t positions);

}  // namespace kiln
