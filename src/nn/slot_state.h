// Decode state indexed by slot: the copies and resets behind BranchDecoder's slot contract
// (nn/decode.h), for a component's decoder to apply to its own state tensors. Two shapes:
//   positional [slots, max_len, ...]  a KV cache: a sequence writes each position before
//                                     it reads it, so only copies (of a prefix) are needed
//   fixed      [slots, ...]           a recurrent state: whole per sequence, carried from
//                                     step to step, so a new sequence starts from zero
// Each is one contiguous copy or fill per slot: a memcpy on the CPU, a device copy or
// memset on the GPU. Those run on the legacy stream, which waits for kiln's (blocking)
// stream: they follow the step that wrote the slot, and the next step follows them.
#pragma once

#include "core/tensor.h"

#include <cstdint>

namespace kiln {

// Positions [0, positions) of slot `from` into slot `to` of a positional state.
void copy_slot_positions(const Tensor& state, int32_t from, int32_t to, int64_t positions);
// Slot `from` of a fixed-size state into slot `to`, whole.
void copy_slot_whole(const Tensor& state, int32_t from, int32_t to);
// Slot `slot` of a fixed-size state to zero (the state a new sequence starts from).
void zero_slot(const Tensor& state, int32_t slot);

}  // namespace kiln
