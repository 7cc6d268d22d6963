// BatchStream: the endless, shuffled sequence of training micro-batches, with a small
// position (StreamState) that saves and restores exactly; and the fixed validation set.
//
// Epoch e visits the split's documents in a Fisher-Yates shuffle seeded by
// Rng::derive(seed, e), so any epoch's order is recomputed from two integers and a run
// resumed from a StreamState produces bit-identical batches to one that never stopped.
// A document longer than max_seq_len is cut at multiples of it in epoch 0 and, with
// data.long_doc_offset = per_epoch, at an offset drawn from (seed, e, document) in each
// later epoch (data/packer.h): recomputed the same way on resume.
//
// Data parallelism: the global stream is one sequence of micro-batches B0, B1, ...; rank
// r of W receives B_r, B_{r+W}, B_{r+2W}, ... (the others are skipped without copying a
// token). Ranks get disjoint micro-batches whose union is the single-process stream, and
// every rank's StreamState is the same (the start of the next round of W batches).
//
// A mixture (a split with SplitSource ranges, from data.sources) keeps such an order,
// epoch and position per source, its epochs shuffled from (seed, source) so that sources
// of equal size do not share an order; documents are drawn from the sources by the
// weighted round-robin of data/mixture.h, and a source that runs out starts its next
// epoch alone, as a single source does. One source is the same stream as before mixtures.
//
// Prefetching (data.prefetch = K > 0): a background thread packs up to K batches ahead
// (data/prefetch.h); the batches and states are exactly those of the synchronous stream.
#pragma once

#include "data/batch.h"
#include "data/dataset.h"
#include "data/packer.h"
#include "data/stream_state.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace kiln {

class Prefetcher;

struct LoaderOptions {
  int64_t rank = 0;        // this process's data-parallel rank, in [0, world_size)
  int64_t world_size = 1;  // data-parallel ranks
  int64_t prefetch = 0;    // batches packed ahead by a background thread; 0 = synchronous
};

// From data.rank / data.world_size (world_size 0: the launcher's ranks, dist/process_env.h,
// torchrun's, Slurm's or Open MPI's, else rank 0 of 1) and data.prefetch. Throws naming the key or
// variable when a value is out of range.
LoaderOptions loader_options(const DataConfig& config);

class BatchStream {
 public:
  // Keeps a reference to `split` (it must outlive the stream) and a copy of the packer.
  // Throws when the split has no document that can be packed (empty, or all dropped).
  BatchStream(const TokenizedSplit& split, const Packer& packer, uint64_t seed, const LoaderOptions& options = {});
  BatchStream(const TokenDataset& dataset, Split split, const Packer& packer, uint64_t seed,
              const LoaderOptions& options = {})
      : BatchStream(dataset.split(split), packer, seed, options) {}
  // The training stream a run config asks for: data.seed and loader_options(config).
  BatchStream(const TokenDataset& dataset, Split split, const Packer& packer, const DataConfig& config)
      : BatchStream(dataset.split(split), packer, config.seed, loader_options(config)) {}
  ~BatchStream();
  BatchStream(const BatchStream&) = delete;
  BatchStream& operator=(const BatchStream&) = delete;

  // This rank's next micro-batch of exactly T positions, into `batch`, reusing its
  // buffers (no allocation after the first calls). Crosses epoch boundaries without a
  // seam: a batch may end one epoch and begin the next.
  void next(HostBatch& batch);

  // The position of the next batch next() returns (with prefetching too: where the
  // consumer is, not the producer).
  StreamState get_state() const;
  // Throws kiln::Error when the state belongs to other data, seed or packing, or points
  // outside the split. Discards prefetched batches.
  void set_state(const StreamState& state);

  uint64_t epoch() const { return get_state().epoch; }
  // Fraction of the current epoch already packed, for logs.
  double epoch_progress() const;
  // Documents skipped every epoch by long_doc = "drop".
  int64_t dropped_documents() const { return dropped_; }
  const LoaderOptions& options() const { return options_; }
  // Seconds next() has waited for the prefetch thread (0 when synchronous).
  double wait_seconds() const;

 private:
  // One source's documents [first, first + count) of the split, and its position.
  struct Lane {
    int64_t first = 0;
    uint64_t seed = 0;              // its epochs' shuffles and cut offsets
    std::vector<int64_t> order;     // document indices of the current epoch
    uint64_t epoch = 0;
    uint64_t next_document = 0;
  };
  bool is_mixture() const { return lanes_.size() > 1; }
  void shuffle_for_epoch(Lane& lane);
  // The lane the current document comes from (the schedule's pick at draws_).
  size_t current_lane() const;
  // Where the lane's current epoch cuts document `doc` of `num_tokens` tokens (Packer's offset).
  int64_t piece_offset(const Lane& lane, int64_t doc, int64_t num_tokens) const;
  // Packs (kEmit) or skips the next global micro-batch from the current position.
  template <bool kEmit>
  void advance(HostBatch* batch);
  // One round: skip rank batches, pack ours, skip the rest of the world's.
  void next_round(HostBatch& batch);
  StreamState position() const;

  const TokenizedSplit& split_;
  Packer packer_;
  uint64_t seed_;
  LoaderOptions options_;
  uint64_t fingerprint_;
  int64_t dropped_ = 0;
  // The producer's position (with prefetching, touched only by the prefetch thread):
  // the lanes', the documents drawn over all of them, and the current document's piece.
  std::vector<Lane> lanes_;
  std::vector<double> weights_;   // per lane
  std::vector<uint64_t> counts_;  // per lane: documents (with a piece) drawn from it
  uint64_t draws_ = 0;
  uint64_t next_piece_ = 0;
  // With prefetching: the consumer's position, and the thread (started by next()).
  StreamState consumer_;
  std::unique_ptr<Prefetcher> prefetcher_;
  double retired_wait_seconds_ = 0;
};

// The first `max_batches` micro-batches of one pass over `split` in file order (all of
// them when there are fewer; none for an empty split). Fixed across calls and runs, so
// validation losses are comparable step to step; the trainer computes it once.
// A mixture's split (SplitSource ranges): each source's documents are packed apart and
// its batches interleaved by the weights' schedule (data/mixture.h), so that a cap keeps
// the mixture's proportions and each batch has one source, which `batch_sources` (when
// given) receives per batch: the trainer reports a loss per source besides the union's.
std::vector<HostBatch> validation_batches(const TokenizedSplit& split, const Packer& packer, int64_t max_batches,
                                          std::vector<int32_t>* batch_sources = nullptr);
inline std::vector<HostBatch> validation_batches(const TokenDataset& dataset, const Packer& packer, int64_t max_batches,
                                                 std::vector<int32_t>* batch_sources = nullptr) {
  return validation_batches(dataset.split(Split::validation), packer, max_batches, batch_sources);
}

// Documents of `split` that the packer's long_doc policy drops (throws under "error").
int64_t count_dropped_documents(const TokenizedSplit& split, const Packer& packer);

}  // namespace kiln
