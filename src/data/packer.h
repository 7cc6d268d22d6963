// Packer: token sequences -> fixed-budget micro-batches (HostBatch, data/batch.h).
//
// A document of n tokens is the sequence [BOS, t1..tn, EOS]: n+1 (input, target)
// positions, inputs [BOS, t1..tn], targets [t1..tn, EOS]. Every micro-batch holds exactly
// T = micro_batch_tokens positions, so the step has static shapes (CUDA graphs); whole
// sequences are packed greedily and the unused tail is PAD with ignored targets.
//
// A sequence longer than L = max_seq_len positions is cut into "pieces" of at most L
// positions (policy split), skipped (drop) or rejected (error). Pieces are the unit of
// packing, and (document, piece) is the resume position a BatchStream saves. A split
// document is cut at multiples of L, or `offset` positions in and then every L after
// (offset in [0, L); 0: no head piece): the stream draws a fresh offset per epoch.
//
// The Packer holds no stream state: callers drive begin() / fits() / append() / finish(),
// so the same code packs the shuffled training stream and the fixed validation set.
#pragma once

#include "data/batch.h"
#include "data/token_span.h"
#include "config/config.h"

#include <cstdint>
#include <span>
#include <string>

namespace kiln {

class Tokenizer;

enum class LongDocPolicy { split, drop, error };

// "split" | "drop" | "error"; anything else throws naming data.long_doc.
LongDocPolicy parse_long_doc_policy(const std::string& name);

struct PackerOptions {
  int64_t micro_batch_tokens = 0;  // T: positions per micro-batch
  int64_t max_seq_len = 0;         // L: longest sequence (piece) attention sees; L <= T
  LongDocPolicy long_doc = LongDocPolicy::split;
  int32_t bos_id = 0;
  int32_t eos_id = 0;
  int32_t pad_id = 0;
  bool offset_per_epoch = true;    // data.long_doc_offset: the stream cuts split documents anew each epoch
};

// From the run config (train.micro_batch_tokens, model.max_seq_len, data.long_doc) and
// the tokenizer's special ids.
PackerOptions packer_options(const Config& config, const Tokenizer& tokenizer);

class Packer {
 public:
  // Throws naming train.micro_batch_tokens when L > T (a piece must fit an empty batch).
  explicit Packer(const PackerOptions& options);

  const PackerOptions& options() const { return options_; }
  int64_t budget() const { return options_.micro_batch_tokens; }

  // Pieces of a document of `num_tokens` tokens: 1 when it fits in L positions; else for
  // split ceil((n+1)/L) cut at multiples of L, 1 + ceil((n+1-offset)/L) cut `offset`
  // positions in; 0 for drop, and for error a throw naming `document_id`.
  int64_t num_pieces(int64_t num_tokens, uint64_t document_id, int64_t offset = 0) const;
  // Positions of piece `piece` (the head piece of a nonzero offset and the last piece may
  // be short).
  int64_t piece_positions(int64_t num_tokens, int64_t piece, int64_t offset = 0) const;

  // Empties the batch and reserves T (T+1 for cu_seqlens) once, so later batches reuse
  // the same buffers and nothing reallocates in the step loop.
  void begin(HostBatch& batch) const;
  // True when `positions` more positions fit in the batch's remaining budget.
  bool fits(const HostBatch& batch, int64_t positions) const {
    return batch.size() + positions <= options_.micro_batch_tokens;
  }
  // Appends piece `piece` of document `tokens` as one sequence (positions from 0).
  // The caller checks fits() first.
  // `tokens` may be int32 or uint16 storage (TokenSpan).
  void append(HostBatch& batch, TokenSpan tokens, int64_t piece, int64_t offset = 0) const;
  // Fills the tail with PAD (target ignored) up to T. The tail is its own sequence in
  // cu_seqlens, cut into segments of at most L so positions stay < max_seq_len (RoPE
  // tables) and max_seqlen <= L; a training batch's tail is always shorter than L.
  void finish(HostBatch& batch) const;

 private:
  // The first position of piece `piece` of a split sequence cut `offset` positions in.
  int64_t piece_start(int64_t piece, int64_t offset) const {
    const int64_t L = options_.max_seq_len;
    return offset == 0 ? piece * L : piece == 0 ? 0 : offset + (piece - 1) * L;
  }

  PackerOptions options_;
};

}  // namespace kiln
