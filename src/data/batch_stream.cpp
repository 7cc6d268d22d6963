#include "data/batch_stream.h"

#include "core/error.h"
#include "core/rng.h"
#include "data/mixture.h"
#include "data/prefetch.h"
#include "dist/process_env.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <memory>
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
  // One lane for a single source, with the seed and order it always had; a mixture's
  // lanes shuffle from (seed, source).
  const std::vector<SplitSource>& sources = split_.sources();
  if (sources.empty()) {
    lanes_.push_back(Lane{0, seed_, std::vector<int64_t>(static_cast<size_t>(split_.num_documents()))});
    weights_.push_back(1.0);
  }
  for (size_t s = 0; s < sources.size(); ++s) {
    const SplitSource& source = sources[s];
    int64_t dropped = 0;
    for (int64_t i = source.first; i < source.first + source.count; ++i)
      if (packer_.num_pieces(static_cast<int64_t>(split_.document(i).size()), split_.document_id(i)) == 0) ++dropped;
    KILN_CHECK(source.count > dropped, "data",
               "data.sources[{}] ('{}'): no document to train on: {} documents, {} longer than model.max_seq_len {} "
               "dropped (data.long_doc)", s, source.name, source.count, dropped, packer_.options().max_seq_len);
    lanes_.push_back(Lane{source.first, mix(mix(seed_, 0x6d6978), s), std::vector<int64_t>(static_cast<size_t>(source.count))});
    weights_.push_back(source.weight);
  }
  counts_.assign(lanes_.size(), 0);
  for (Lane& lane : lanes_) shuffle_for_epoch(lane);
  consumer_ = position();
}

BatchStream::~BatchStream() = default;

int64_t BatchStream::piece_offset(const Lane& lane, int64_t doc, int64_t num_tokens) const {
  const int64_t L = packer_.options().max_seq_len;
  if (lane.epoch == 0 || !packer_.options().offset_per_epoch || num_tokens + 1 <= L) return 0;
  Rng rng = Rng::derive(mix(lane.seed, lane.epoch), static_cast<uint64_t>(doc));
  return static_cast<int64_t>(rng.below(static_cast<uint64_t>(L)));
}

void BatchStream::shuffle_for_epoch(Lane& lane) {
  std::iota(lane.order.begin(), lane.order.end(), lane.first);
  Rng rng = Rng::derive(lane.seed, lane.epoch);
  for (size_t i = lane.order.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(rng.below(i));
    std::swap(lane.order[i - 1], lane.order[j]);
  }
}

size_t BatchStream::current_lane() const { return is_mixture() ? mixture_pick(weights_, draws_, counts_) : 0; }

StreamState BatchStream::position() const {
  if (!is_mixture()) return StreamState{lanes_[0].epoch, lanes_[0].next_document, next_piece_, fingerprint_, {}};
  StreamState state{0, draws_, next_piece_, fingerprint_, {}};
  for (size_t s = 0; s < lanes_.size(); ++s) {
    state.sources.push_back(SourcePosition{lanes_[s].epoch, lanes_[s].next_document, counts_[s]});
    state.epoch = std::max(state.epoch, lanes_[s].epoch);
  }
  return state;
}

template <bool kEmit>
void BatchStream::advance(HostBatch* batch) {
  if constexpr (kEmit) packer_.begin(*batch);
  const int64_t budget = packer_.budget();
  int64_t used = 0;
  // Terminates: the constructor guaranteed at least one packable document, and every
  // piece fits an empty batch (L <= T), so each pass over an epoch adds something.
  for (;;) {
    const size_t l = current_lane();
    Lane& lane = lanes_[l];
    if (lane.next_document == lane.order.size()) {  // this source's epoch ends alone
      ++lane.epoch;
      lane.next_document = 0;
      next_piece_ = 0;
      shuffle_for_epoch(lane);
    }
    const int64_t doc = lane.order[lane.next_document];
    const TokenSpan tokens = split_.document(doc);
    const auto n = static_cast<int64_t>(tokens.size());
    const int64_t offset = piece_offset(lane, doc, n);
    if (static_cast<int64_t>(next_piece_) >= packer_.num_pieces(n, split_.document_id(doc), offset)) {
      // A document done is a draw; a dropped one (no piece) is passed over, so the
      // schedule counts only documents that train.
      if (next_piece_ > 0) {
        ++counts_[l];
        ++draws_;
      }
      ++lane.next_document;
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
  KILN_CHECK(state.sources.size() == (is_mixture() ? lanes_.size() : 0), "data",
             "saved stream position has {} sources, the data has {}", state.sources.size(),
             is_mixture() ? lanes_.size() : 1);
  uint64_t draws = 0;
  for (size_t s = 0; s < state.sources.size(); ++s) {
    KILN_CHECK(state.sources[s].next_document <= lanes_[s].order.size(), "data",
               "saved stream position {} of data.sources[{}] is past its {} documents", state.sources[s].next_document, s,
               lanes_[s].order.size());
    draws += state.sources[s].draws;
  }
  KILN_CHECK(!is_mixture() || draws == state.next_document, "data",
             "saved mixture position draws {} documents, its sources {}", state.next_document, draws);
  KILN_CHECK(is_mixture() || state.next_document <= lanes_[0].order.size(), "data",
             "saved stream position {} is past the {} documents", state.next_document, lanes_[0].order.size());
  if (prefetcher_ != nullptr) {
    retired_wait_seconds_ += prefetcher_->wait_seconds();
    prefetcher_.reset();  // joins the thread; its batches were for the old position
  }
  if (is_mixture()) {
    for (size_t s = 0; s < lanes_.size(); ++s) {
      lanes_[s].epoch = state.sources[s].epoch;
      lanes_[s].next_document = state.sources[s].next_document;
      counts_[s] = state.sources[s].draws;
    }
    draws_ = state.next_document;
  } else {
    lanes_[0].epoch = state.epoch;
    lanes_[0].next_document = state.next_document;
  }
  next_piece_ = state.next_piece;
  for (Lane& lane : lanes_) shuffle_for_epoch(lane);
  consumer_ = position();
}

double BatchStream::epoch_progress() const {
  // A mixture: the source furthest through its epochs (the one repeating soonest).
  double progress = 0;
  for (size_t s = 0; s < lanes_.size(); ++s) {
    const uint64_t next = is_mixture() ? consumer_.sources[s].next_document : consumer_.next_document;
    const uint64_t epoch = is_mixture() ? consumer_.sources[s].epoch : consumer_.epoch;
    if (lanes_[s].order.empty() || epoch != consumer_.epoch) continue;
    progress = std::max(progress, static_cast<double>(next) / static_cast<double>(lanes_[s].order.size()));
  }
  return progress;
}

double BatchStream::wait_seconds() const {
  return retired_wait_seconds_ + (prefetcher_ != nullptr ? prefetcher_->wait_seconds() : 0.0);
}

namespace {

// Documents [first, end) of `split` packed in order, up to `max_batches` batches.
std::vector<HostBatch> pack_in_order(const TokenizedSplit& split, int64_t first, int64_t end, const Packer& packer,
                                     int64_t max_batches) {
  std::vector<HostBatch> batches;
  HostBatch batch;
  packer.begin(batch);
  for (int64_t doc = first; doc < end && static_cast<int64_t>(batches.size()) < max_batches; ++doc) {
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

}  // namespace

std::vector<HostBatch> validation_batches(const TokenizedSplit& split, const Packer& packer, int64_t max_batches,
                                          std::vector<int32_t>* batch_sources) {
  if (batch_sources) batch_sources->clear();
  const std::vector<SplitSource>& sources = split.sources();
  if (sources.empty()) return pack_in_order(split, 0, split.num_documents(), packer, max_batches);
  std::vector<std::vector<HostBatch>> per_source;
  std::vector<double> weights;
  for (const SplitSource& s : sources) {
    per_source.push_back(pack_in_order(split, s.first, s.first + s.count, packer, max_batches));
    weights.push_back(s.weight);
  }
  std::vector<uint64_t> taken(sources.size(), 0);
  std::unique_ptr<bool[]> active(new bool[sources.size()]);
  int64_t left = 0;
  for (size_t s = 0; s < sources.size(); ++s) {
    active[s] = !per_source[s].empty();
    left += static_cast<int64_t>(per_source[s].size());
  }
  std::vector<HostBatch> batches;
  for (uint64_t draw = 0; left > 0 && static_cast<int64_t>(batches.size()) < max_batches; ++draw, --left) {
    const size_t s = mixture_pick(weights, draw, taken, std::span<const bool>(active.get(), sources.size()));
    batches.push_back(std::move(per_source[s][taken[s]]));
    if (batch_sources) batch_sources->push_back(static_cast<int32_t>(s));
    if (++taken[s] == per_source[s].size()) active[s] = false;
  }
  return batches;
}

}  // namespace kiln
