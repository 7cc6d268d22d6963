#include "data/batch_stream.h"

#include "core/error.h"
#include "core/rng.h"

#include <cstring>
#include <numeric>

namespace kiln {

namespace {

uint64_t mix(uint64_t hash, uint64_t value) {
  char bytes[sizeof(value)];
  std::memcpy(bytes, &value, sizeof(value));
  return fnv1a64(std::string_view(bytes, sizeof(bytes)), hash);
}

}  // namespace

int64_t count_dropped_documents(const TokenizedSplit& split, const Packer& packer) {
  int64_t dropped = 0;
  for (int64_t i = 0; i < split.num_documents(); ++i) {
    const auto n = static_cast<int64_t>(split.document(i).size());
    if (packer.num_pieces(n, split.document_id(i)) == 0) ++dropped;
  }
  return dropped;
}

BatchStream::BatchStream(const TokenizedSplit& split, const Packer& packer, uint64_t seed)
    : split_(split), packer_(packer), seed_(seed) {
  // Checks every document against long_doc now, so "error" fails before training starts
  // rather than hours in.
  dropped_ = count_dropped_documents(split_, packer_);
  KILN_CHECK(split_.num_documents() > dropped_, "data",
             "no document to train on: {} documents, {} longer than model.max_seq_len {} dropped (data.long_doc)",
             split_.num_documents(), dropped_, packer_.options().max_seq_len);
  const PackerOptions& o = packer_.options();
  uint64_t h = mix(split_.fingerprint(), seed_);
  for (const int64_t v : {o.micro_batch_tokens, o.max_seq_len, static_cast<int64_t>(o.long_doc),
                          int64_t{o.bos_id}, int64_t{o.eos_id}, int64_t{o.pad_id}}) {
    h = mix(h, static_cast<uint64_t>(v));
  }
  fingerprint_ = h;
  order_.resize(static_cast<size_t>(split_.num_documents()));
  shuffle_for_epoch();
}

void BatchStream::shuffle_for_epoch() {
  std::iota(order_.begin(), order_.end(), int64_t{0});
  Rng rng = Rng::derive(seed_, epoch_);
  for (size_t i = order_.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(rng.below(i));
    std::swap(order_[i - 1], order_[j]);
  }
}

void BatchStream::next(HostBatch& batch) {
  packer_.begin(batch);
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
    const std::span<const int32_t> tokens = split_.document(doc);
    const auto n = static_cast<int64_t>(tokens.size());
    if (static_cast<int64_t>(next_piece_) >= packer_.num_pieces(n, split_.document_id(doc))) {
      ++next_document_;
      next_piece_ = 0;
      continue;
    }
    const auto piece = static_cast<int64_t>(next_piece_);
    if (!packer_.fits(batch, packer_.piece_positions(n, piece))) break;
    packer_.append(batch, tokens, piece);
    ++next_piece_;
  }
  packer_.finish(batch);
}

StreamState BatchStream::get_state() const { return StreamState{epoch_, next_document_, next_piece_, fingerprint_}; }

void BatchStream::set_state(const StreamState& state) {
  KILN_CHECK(state.fingerprint == fingerprint_, "data",
             "saved stream position is for different data, data.seed or packing (fingerprint {:016x}, expected {:016x})",
             state.fingerprint, fingerprint_);
  KILN_CHECK(state.next_document <= order_.size(), "data", "saved stream position {} is past the {} documents",
             state.next_document, order_.size());
  epoch_ = state.epoch;
  next_document_ = state.next_document;
  next_piece_ = state.next_piece;
  shuffle_for_epoch();
}

double BatchStream::epoch_progress() const {
  return order_.empty() ? 0.0 : static_cast<double>(next_document_) / static_cast<double>(order_.size());
}

std::vector<HostBatch> validation_batches(const TokenizedSplit& split, const Packer& packer, int64_t max_batches) {
  std::vector<HostBatch> batches;
  HostBatch batch;
  packer.begin(batch);
  for (int64_t doc = 0; doc < split.num_documents() && static_cast<int64_t>(batches.size()) < max_batches; ++doc) {
    const std::span<const int32_t> tokens = split.document(doc);
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
