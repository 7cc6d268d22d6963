#include "data/packer.h"

#include "core/error.h"
#include "core/printable.h"
#include "data/tokenizer.h"

#include <algorithm>

namespace kiln {

LongDocPolicy parse_long_doc_policy(const std::string& name) {
  if (name == "split") return LongDocPolicy::split;
  if (name == "drop") return LongDocPolicy::drop;
  if (name == "error") return LongDocPolicy::error;
  fail("data.long_doc", "unknown policy '{}' (known: split, drop, error)", printable(name));
}

PackerOptions packer_options(const Config& config, const Tokenizer& tokenizer) {
  PackerOptions o;
  o.micro_batch_tokens = config.train.micro_batch_tokens;
  o.max_seq_len = config.model.max_seq_len;
  o.long_doc = parse_long_doc_policy(config.data.long_doc);
  KILN_CHECK(config.data.long_doc_offset == "per_epoch" || config.data.long_doc_offset == "zero",
             "data.long_doc_offset", "unknown choice '{}' (known: per_epoch, zero)", printable(config.data.long_doc_offset));
  o.offset_per_epoch = config.data.long_doc_offset == "per_epoch";
  o.bos_id = tokenizer.bos_id();
  o.eos_id = tokenizer.eos_id();
  o.pad_id = tokenizer.pad_id();
  return o;
}

Packer::Packer(const PackerOptions& options) : options_(options) {
  KILN_CHECK(options_.max_seq_len > 0, "model.max_seq_len", "must be positive, got {}", options_.max_seq_len);
  KILN_CHECK(options_.micro_batch_tokens >= options_.max_seq_len, "train.micro_batch_tokens",
             "must be at least model.max_seq_len ({}) so every sequence fits one micro-batch, got {}",
             options_.max_seq_len, options_.micro_batch_tokens);
  // int32 positions and cu_seqlens are what attention kernels take.
  KILN_CHECK(options_.micro_batch_tokens < (int64_t{1} << 31), "train.micro_batch_tokens", "must be below 2^31, got {}",
             options_.micro_batch_tokens);
}

int64_t Packer::num_pieces(int64_t num_tokens, uint64_t document_id, int64_t offset) const {
  const int64_t positions = num_tokens + 1;
  const int64_t L = options_.max_seq_len;
  if (positions <= L) return 1;
  switch (options_.long_doc) {
    case LongDocPolicy::split:
      KILN_CHECK(offset >= 0 && offset < L, "data", "piece offset {} is not in [0, {})", offset, L);
      return offset == 0 ? (positions + L - 1) / L : 1 + (positions - offset + L - 1) / L;
    case LongDocPolicy::drop: return 0;
    case LongDocPolicy::error: break;
  }
  fail("data", "document {} has {} tokens ({} positions with BOS/EOS), more than model.max_seq_len {} "
       "(data.long_doc = \"error\"; use \"split\" or \"drop\")", document_id, num_tokens, positions, L);
}

int64_t Packer::piece_positions(int64_t num_tokens, int64_t piece, int64_t offset) const {
  const int64_t positions = num_tokens + 1;
  if (positions <= options_.max_seq_len) return positions;  // not split: the offset does not apply
  return std::min(piece_start(piece + 1, offset), positions) - piece_start(piece, offset);
}

void Packer::begin(HostBatch& batch) const {
  const auto T = static_cast<size_t>(options_.micro_batch_tokens);
  batch.tokens.clear();
  batch.targets.clear();
  batch.positions.clear();
  batch.cu_seqlens.clear();
  batch.tokens.reserve(T);
  batch.targets.reserve(T);
  batch.positions.reserve(T);
  batch.cu_seqlens.reserve(T + 1);  // worst case: every sequence one position long
  batch.cu_seqlens.push_back(0);
  batch.max_seqlen = 0;
  batch.target_count = 0;
  batch.document_tokens = 0;
}

namespace {

// Appends positions [first, first + count) of the sequence [BOS, t1..tn, EOS] (length
// n+2) as (input, target) pairs; the inner loop is branch-free over the stored tokens.
template <typename T>
void append_piece(HostBatch& batch, std::span<const T> t, int64_t first, int64_t count, int32_t bos, int32_t eos) {
  const auto n = static_cast<int64_t>(t.size());
  auto at = [&](int64_t i) -> int32_t {
    if (i == 0) return bos;
    if (i == n + 1) return eos;
    return static_cast<int32_t>(t[static_cast<size_t>(i - 1)]);
  };
  const size_t base = batch.tokens.size();
  batch.tokens.resize(base + static_cast<size_t>(count));
  batch.targets.resize(base + static_cast<size_t>(count));
  batch.positions.resize(base + static_cast<size_t>(count));
  int32_t* tokens = batch.tokens.data() + base;
  int32_t* targets = batch.targets.data() + base;
  int32_t* positions = batch.positions.data() + base;
  // Input i is element first+i, target i is element first+i+1 (the true next token,
  // across piece borders too). Only the first input and the last target can be BOS/EOS.
  for (int64_t p = 0; p < count; ++p) positions[p] = static_cast<int32_t>(p);
  int64_t p = 0;
  if (first == 0 && count > 0) {
    tokens[0] = bos;
    p = 1;
  }
  for (; p < count; ++p) tokens[p] = static_cast<int32_t>(t[static_cast<size_t>(first + p - 1)]);
  const int64_t last = count > 0 && first + count == n + 1 ? count - 1 : count;  // target EOS
  for (int64_t q = 0; q < last; ++q) targets[q] = static_cast<int32_t>(t[static_cast<size_t>(first + q)]);
  for (int64_t q = last; q < count; ++q) targets[q] = at(first + q + 1);
}

}  // namespace

void Packer::append(HostBatch& batch, TokenSpan tokens, int64_t piece, int64_t offset) const {
  const auto n = static_cast<int64_t>(tokens.size());
  // Index into [BOS, t1..tn, EOS].
  const int64_t first = n + 1 <= options_.max_seq_len ? 0 : piece_start(piece, offset);
  const int64_t count = piece_positions(n, piece, offset);
  tokens.visit([&](auto span) { append_piece(batch, span, first, count, options_.bos_id, options_.eos_id); });
  batch.cu_seqlens.push_back(static_cast<int32_t>(batch.tokens.size()));
  batch.max_seqlen = std::max(batch.max_seqlen, static_cast<int32_t>(count));
  batch.target_count += count;
  batch.document_tokens += count;
}

void Packer::finish(HostBatch& batch) const {
  const int64_t T = options_.micro_batch_tokens;
  while (batch.size() < T) {
    const int64_t count = std::min(options_.max_seq_len, T - batch.size());
    for (int64_t p = 0; p < count; ++p) {
      batch.tokens.push_back(options_.pad_id);
      batch.targets.push_back(kIgnoreTarget);
      batch.positions.push_back(static_cast<int32_t>(p));
    }
    batch.cu_seqlens.push_back(static_cast<int32_t>(batch.tokens.size()));
    batch.max_seqlen = std::max(batch.max_seqlen, static_cast<int32_t>(count));
  }
}

}  // namespace kiln
