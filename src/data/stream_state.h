// StreamState: where a training batch stream is, as four integers a checkpoint stores.
#pragma once

#include <cstdint>

namespace kiln {

// The next piece to pack, in the global stream (before any data-parallel sharding): a
// run resumed from it sees exactly the batches an uninterrupted run would, on every
// rank, and for any data.world_size (the state is where the next round of world_size
// micro-batches starts).
struct StreamState {
  uint64_t epoch = 0;          // epochs completed before the current one
  uint64_t next_document = 0;  // index into the current epoch's shuffled order
  uint64_t next_piece = 0;     // first piece of that document not yet emitted
  uint64_t fingerprint = 0;    // data + seed + packing; set_state() rejects a mismatch

  bool operator==(const StreamState&) const = default;
};

}  // namespace kiln
