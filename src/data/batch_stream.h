// BatchStream: the endless, shuffled sequence of training micro-batches, with a small
// position (StreamState) that saves and restores exactly; and the fixed validation set.
//
// Epoch e visits the split's documents in a Fisher-Yates shuffle seeded by
// Rng::derive(seed, e), so any epoch's order is recomputed from two integers and a run
// resumed from a StreamState produces bit-identical batches to one that never stopped.
#pragma once

#include "data/batch.h"
#include "data/dataset.h"
#include "data/packer.h"

#include <cstdint>
#include <vector>

namespace kiln {

// Where a stream is: the next piece to pack. Plain integers, so a checkpoint stores it
// as four numbers.
struct StreamState {
  uint64_t epoch = 0;          // epochs completed before the current one
  uint64_t next_document = 0;  // index into the current epoch's shuffled order
  uint64_t next_piece = 0;     // first piece of that document not yet emitted
  uint64_t fingerprint = 0;    // data + seed + packing; set_state() rejects a mismatch

  bool operator==(const StreamState&) const = default;
};

class BatchStream {
 public:
  // Keeps a reference to `split` (it must outlive the stream) and a copy of the packer.
  // Throws when the split has no document that can be packed (empty, or all dropped).
  BatchStream(const TokenizedSplit& split, const Packer& packer, uint64_t seed);
  BatchStream(const TokenDataset& dataset, Split split, const Packer& packer, uint64_t seed)
      : BatchStream(dataset.split(split), packer, seed) {}

  // The next micro-batch of exactly T positions, into `batch`, reusing its buffers
  // (no allocation after the first call). Crosses epoch boundaries without a seam: a
  // batch may end one epoch and begin the next.
  void next(HostBatch& batch);

  StreamState get_state() const;
  // Throws kiln::Error when the state belongs to other data, seed or packing, or points
  // outside the split.
  void set_state(const StreamState& state);

  uint64_t epoch() const { return epoch_; }
  // Fraction of the current epoch already packed, for logs.
  double epoch_progress() const;
  // Documents skipped every epoch by long_doc = "drop".
  int64_t dropped_documents() const { return dropped_; }

 private:
  void shuffle_for_epoch();

  const TokenizedSplit& split_;
  Packer packer_;
  uint64_t seed_;
  uint64_t fingerprint_;
  int64_t dropped_ = 0;
  std::vector<int64_t> order_;  // document indices of the current epoch
  uint64_t epoch_ = 0;
  uint64_t next_document_ = 0;
  uint64_t next_piece_ = 0;
};

// The first `max_batches` micro-batches of one pass over `split` in file order (all of
// them when there are fewer; none for an empty split). Fixed across calls and runs, so
// validation losses are comparable step to step; the trainer computes it once.
std::vector<HostBatch> validation_batches(const TokenizedSplit& split, const Packer& packer, int64_t max_batches);
inline std::vector<HostBatch> validation_batches(const TokenDataset& dataset, const Packer& packer, int64_t max_batches) {
  return validation_batches(dataset.split(Split::validation), packer, max_batches);
}

// Documents of `split` that the packer's long_doc policy drops (throws under "error").
int64_t count_dropped_documents(const TokenizedSplit& split, const Packer& packer);

}  // namespace kiln
