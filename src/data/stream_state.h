// StreamState: where a training batch stream is, as a few integers a checkpoint stores.
#pragma once

#include <cstdint>
#include <vector>

namespace kiln {

// One source of a mixture (data.sources): where its own shuffled epochs are.
struct SourcePosition {
  uint64_t epoch = 0;          // the source's epochs completed
  uint64_t next_document = 0;  // index into the source's current shuffled order
  uint64_t draws = 0;          // documents drawn from it so far (the schedule's count)

  bool operator==(const SourcePosition&) const = default;
};

// The next piece to pack, in the global stream (before any data-parallel sharding): a
// run resumed from it sees exactly the batches an uninterrupted run would, on every
// rank, and for any data.world_size (the state is where the next round of world_size
// micro-batches starts).
//
// A mixture (sources not empty) keeps each source's position in `sources`; then
// next_document counts the documents drawn from all sources (the schedule's position,
// data/mixture.h), next_piece is the piece of the current document, and epoch is only
// for logs (the most epochs any source has completed).
struct StreamState {
  uint64_t epoch = 0;          // epochs completed before the current one
  uint64_t next_document = 0;  // index into the current epoch's shuffled order
  uint64_t next_piece = 0;     // first piece of that document not yet emitted
  uint64_t fingerprint = 0;    // data + seed + packing; set_state() rejects a mismatch
  std::vector<SourcePosition> sources;  // a mixture's sources; empty for one source

  bool operator==(const StreamState&) const = default;
};

}  // namespace kiln
