// One packed micro-batch, as the packer produces it on the host.
//
// Documents are packed whole into a fixed token budget T: each sequence is
// [BOS, bytes..., EOS] shifted by one into (tokens, targets). Positions restart at 0 in
// every sequence; cu_seqlens marks sequence starts so attention never crosses a
// document. The unused tail is PAD with ignored targets, and forms its own sequence.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kiln {

constexpr int32_t kIgnoreTarget = -1;

struct HostBatch {
  std::vector<int32_t> tokens;      // [T] input ids
  std::vector<int32_t> targets;     // [T] next-token ids, kIgnoreTarget where no loss
  std::vector<int32_t> positions;   // [T] position within its sequence
  std::vector<int32_t> cu_seqlens;  // [S+1] 0 = start of first sequence, ..., T
  int32_t max_seqlen = 0;           // longest sequence in this batch
  int64_t target_count = 0;         // number of targets != kIgnoreTarget
  int64_t document_tokens = 0;      // tokens that belong to documents (not PAD)
  // Dropout's masks for this micro-batch (ops/dropout/dropout_mask.h: stream_key); set by
  // the trainer, unused where the model has no dropout or does not train.
  uint64_t dropout_key = 0;

  int64_t size() const { return static_cast<int64_t>(tokens.size()); }
  int64_t num_seqs() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
  // Every sequence holds exactly max_seqlen tokens (unpacked rows of one length).
  bool uniform() const {
    if (num_seqs() <= 0 || max_seqlen <= 0) return false;
    for (std::size_t s = 0; s + 1 < cu_seqlens.size(); ++s)
      if (cu_seqlens[s + 1] - cu_seqlens[s] != max_seqlen) return false;
    return true;
  }
};

}  // namespace kiln
