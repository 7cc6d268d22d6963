#include "data/batch_stream.h"

#include "core/error.h"
#include "core/rng.h"
#include "data/prefetch.h"
#include "dist/process_env.h"

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string_view>

namespace kiln {

namespace {

uint64_t mix(uint64_t hash, uint64_t value) {
  char bytes[sizeof(value)];
  std::memcpy(bytes, &value, sizeof(value));
  return fnv1a64(std::string_view(bytes, sizeof(bytes)), hash);
}

}  // namespace

LoaderOptions loader_options(const DataConfig& config) {
  LoaderOptions o;
  KILN_CHECK(config.prefetch >= 0, "data.prefetch", "must be >= 0, got {}", config.prefetch);
  o.prefetch = config.prefetch;
  if (config.world_size > 0) {
    o.world_size = config.world_size;
    o.rank = config.rank;
    KILN_CHECK(o.rank >= 0 && o.rank < o.world_size, "data.rank", "must be in [0, data.world_size = {}), got {}",
               o.world_size, o.rank);
  } else {
    KILN_CHECK(config.rank == 0, "data.rank", "is used only with data.world_size > 0 (0 takes RANK/WORLD_SIZE from the "
               "environment), got {}", config.rank);
    // The launcher's ranks (torchrun, Slurm or Open MPI; dist/process_env.h).
    if (const std::optional<dist::ProcessPlacement> placement = dist::process_placement()) {
      o.world_size = placement->world_size;
      o.rank = placement->rank;
    }
  }
  return o;
}

int64_t count_dropped_documents(const TokenizedSplit& split, const Packer& packer) {
  int64_t dropped = 0;
  for (int64_t i = 0; i < split.num_documents(); ++i) {
    const auto n = static_cast<int64_t>(split.document(i).size());
    if (packer.num_pieces(n, split.document_id(i)) == 0) ++dropped;
  }
  return dropped;
}

BatchStream::BatchStream(const TokenizedSplit& split, const Packer& packer, uint64_t seed, const LoaderOptions& options)
    : split_(split), packer_(packer), seed_(seed), options_(options) {
  KILN_CHECK(options_.world_size > 0 && options_.rank >= 0 && options_.rank < options_.world_size, "data.rank",
             "rank {} is not in [0, {})", options_.rank, options_.world_size);
  KILN_CHECK(options_.prefetch >= 0, "data.prefetch", "must be >= 0, got {}", options_.prefetch);
  // Checks every document against long_doc now, so "error" fails before training starts
  // rather than hours in.
  dropped_ = count_dropped_documents(split_, packer_);
  KILN_CHECK(split_.num_documents() > dropped_, "data",
             "no document to train on: {} documents, {} longer than model.max_seq_len {} dropped (data.long_doc)",
             split_.num_documents(), dropped_, packer_.options().max_seq_len);
  const PackerOptions& o = packer_.options();
  // Rank and world size are not part of it: the state names a place in the global
  // stream, valid for any data-parallel layout.
  uint64_t h = mix(split_.fingerprint(), seed_);
  for (const int64_t v : {o.micro_batch_tokens, o.max_seq_len, static_cast<int64_t>(o.long_doc),
                          int64_t{o.bos_id}, int64_t{o.eos_id}, int64_t{o.pad_id}}) {
    h = mix(h, static_cast<uint64_t>(v));
  }
  // Only when on: a stream cut at multiples of L keeps the fingerprint it had before the
  // choice existed, so such a checkpoint resumes with data.long_doc_offset = "zero".
  if (o.offset_per_epoch) h = mix(h, 0x0ffe75e7);
  fingerprint_ = h;
  order_.resize(static_cast<size_t>(split_.num_documents()));
  shuffle_for_epoch();
  consumer_ = position();
}

BatchStream::~BatchStream() = default;

int64_t BatchStream::piece_offset(int64_t doc, int64_t num_tokens) const {
  const int64_t L = packer_.options().max_seq_len;
  if (epoch_ == 0 || !packer_.options().offset_per_epoch || num_tokens + 1 <= L) return 0;
  Rng rng = Rng::derive(mix(seed_, epoch_), static_cast<uint64_t>(doc));
  return static_cast<int64_t>(rng.below(static_cast<uint64_t>(L)));
}

void BatchStream::shuffle_for_epoch() {
  std::iota(order_.begin(), order_.end(), int64_t{0});
  Rng rng = Rng::derive(seed_, epoch_);
  for (size_t i = order_.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(rng.below(i));
    std::swap(order_[i - 1], order_[j]);
  }
}

template <bool kEmit>
void BatchStream::advance(HostBatch* batch) {
  if constexpr (kEmit) packer_.begin(*batch);
  const int64_t budget = packer_.budget();
  int64_t used = 0;
  // Terminates: the constructor guaranteed at least one packable document, and every
  // piece fits an empty batch (L <= T), so each pass over an epoch adds something.
  for (;;) {
    if (next_document_ == order_.size()) {
      ++epoch_;
      next_document_ = 0;
      next_piece_ = 0;
      shuffle_for_epoch();
    }
    const int64_t doc = order_[next_document_];
    const TokenSpan tokens = split_.document(doc);
    const auto n = static_cast<int64_t>(tokens.size());
    const int64_t offset = piece_offset(doc, n);
    if (static_cast<int64_t>(next_piece_) >= packer_.num_pieces(n, split_.document_id(doc), offset)) {
      ++next_document_;
      next_piece_ = 0;
      continue;
    }
    const auto piece = static_cast<int64_t>(next_piece_);
    const int64_t positions = packer_.piece_positions(n, piece, offset);
    if (used + positions > budget) break;
    if constexpr (kEmit) packer_.append(*batch, tokens, piece, offset);
    used += positions;
    ++next_piece_;
  }
  if constexpr (kEmit) packer_.finish(*batch);
}

void BatchStream::next_round(HostBatch& batch) {
  for (int64_t r = 0; r < options_.rank; ++r) advance<false>(nullptr);
  advance<true>(&batch);
  for (int64_t r = options_.rank + 1; r < options_.world_size; ++r) advance<false>(nullptr);
}

void BatchStream::next(HostBatch& batch) {
  if (options_.prefetch == 0) {
    next_round(batch);
    consumer_ = position();
    return;
  }
  if (prefetcher_ == nullptr) {
    prefetcher_ = std::make_unique<Prefetcher>(options_.prefetch, [this](HostBatch& b) {
      next_round(b);
      return position();
    });
  }
  consumer_ = prefetcher_->next(batch);
}

StreamState BatchStream::get_state() const { return consumer_; }

void BatchStream::set_state(const StreamState& state) {
  KILN_CHECK(state.fingerprint == fingerprint_, "data",
             "saved stream position is for different data, data.seed or packing (fingerprint {:016x}, expected {:016x})",
             state.fingerprint, fingerprint_);
  KILN_CHECK(state.next_document <= order_.size(), "data", "saved stream position {} is past the {} documents",
             state.next_document, order_.size());
  if (prefetcher_ != nullptr) {
    retired_wait_seconds_ += prefetcher_->wait_seconds();
    prefetcher_.reset();  // joins the thread; its batches were for the old position
  }
  epoch_ = state.epoch;
  next_document_ = state.next_document;
  next_piece_ = state.next_piece;
  shuffle_for_epoch();
  consumer_ = position();
}

double BatchStream::epoch_progress() const {
  return order_.empty() ? 0.0 : static_cast<double>(consumer_.next_document) / static_cast<double>(order_.size());
}

double BatchStream::wait_seconds() const {
  return retired_wait_seconds_ + (prefetcher_ != nullptr ? prefetcher_->wait_seconds() : 0.0);
}

std::vector<HostBatch> validation_batches(const TokenizedSplit& split, const Packer& packer, int64_t max_batches) {
  std::vector<HostBatch> batches;
  HostBatch batch;
  packer.begin(batch);
  for (int64_t doc = 0; doc < split.num_documents() && static_cast<int64_t>(batches.size()) < max_batches; ++doc) {
    const TokenSpan tokens = split.document(doc);
    const auto n = static_cast<int64_t>(tokens.size());
    const int64_t pieces = packer.num_pieces(n, split.document_id(doc));
    for (int64_t piece = 0; piece < pieces; ++piece) {
      if (!packer.fits(batch, packer.piece_positions(n, piece))) {
        packer.finish(batch);
        batches.push_back(std::move(batch));
        if (static_cast<int64_t>(batches.size()) == max_batches) break;
        batch = HostBatch{};
        packer.begin(batch);
      }
      packer.append(batch, tokens, piece);
    }
  }
  if (static_cast<int64_t>(batches.size()) < max_batches && batch.num_seqs() > 0) {
    packer.finish(batch);
    batches.push_back(std::move(batch));
  }
  return batches;
}

}  // namespace kiln
