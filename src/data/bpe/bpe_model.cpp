#include "data/bpe/bpe_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <utility>

namespace kiln::bpe {
namespace {

constexpr size_t kShortWord = 64;
constexpr size_t kMaxCachedBytes = 255;
constexpr size_t kMaxCachedWords = 1 << 17;

std::atomic<uint64_t> next_serial{1};

struct WordCache {
  uint64_t owner = 0;
  StringMap words{1 << 12};  // value: offset into ids << 8 | count
  std::vector<int32_t> ids;
  std::vector<int32_t> scratch;
};

WordCache& word_cache() {
  thread_local WordCache cache;
  return cache;
}

}  // namespace

BpeModel::BpeModel(StringMap vocab, const std::vector<Merge>& merges, BpeModelOptions options)
    : vocab_(std::move(vocab)), merges_(merges.size()), options_(options), serial_(next_serial++) {
  for (size_t i = 0; i < merges.size(); ++i)
    merges_[pair_key(merges[i].left, merges[i].right)] = {static_cast<int32_t>(i), merges[i].merged};
  for (int b = 0; b < 256; ++b) {
    const char ch = static_cast<char>(b);
    byte_ids_[b] = find(std::string_view(&ch, 1));
    fallback_ids_[b] = options_.byte_fallback ? find(fmt::format("<0x{:02X}>", b)) : -1;
  }
}

void BpeModel::initial_symbols(std::string_view word, std::vector<int32_t>& symbols) const {
  bool pending_unk = false;  // an unknown run not yet emitted (fuse_unk)
  for (const char ch : word) {
    const auto b = static_cast<uint8_t>(ch);
    int32_t id = byte_ids_[b];
    if (id < 0) id = fallback_ids_[b];
    if (id >= 0) {
      if (pending_unk) symbols.push_back(options_.unk_id), pending_unk = false;
      symbols.push_back(id);
    } else if (options_.unk_id >= 0) {
      if (pending_unk && !options_.fuse_unk) symbols.push_back(options_.unk_id);
      pending_unk = true;
    }
  }
  if (pending_unk) symbols.push_back(options_.unk_id);
}

void BpeModel::merge_short(std::vector<int32_t>& symbols) const {
  const size_t n0 = symbols.size();
  int32_t sym[kShortWord], rank[kShortWord], merged[kShortWord];
  std::copy(symbols.begin(), symbols.end(), sym);
  size_t n = n0;
  auto set_rank = [&](size_t i) {
    const Rank* r = rank_of(sym[i], sym[i + 1]);
    rank[i] = r ? r->rank : INT_MAX;
    merged[i] = r ? r->merged : -1;
  };
  for (size_t i = 0; i + 1 < n; ++i) set_rank(i);
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i)
      if (rank[i] < rank[best]) best = i;
    if (rank[best] == INT_MAX) break;
    sym[best] = merged[best];
    for (size_t i = best + 1; i + 1 < n; ++i) {
      sym[i] = sym[i + 1];
      rank[i] = rank[i + 1];
      merged[i] = merged[i + 1];
    }
    --n;
    if (best > 0) set_rank(best - 1);
    if (best + 1 < n) set_rank(best);
  }
  symbols.assign(sym, sym + n);
}

void BpeModel::merge_long(std::vector<int32_t>& symbols) const {
  const auto n = static_cast<int32_t>(symbols.size());
  std::vector<int32_t> prev(static_cast<size_t>(n)), next(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) prev[static_cast<size_t>(i)] = i - 1, next[static_cast<size_t>(i)] = i + 1 < n ? i + 1 : -1;
  // Min-heap on (rank, position): the lowest rank first, the leftmost on ties.
  std::vector<std::pair<int32_t, int32_t>> heap;
  auto push = [&](int32_t i) {
    const int32_t j = next[static_cast<size_t>(i)];
    if (j < 0) return;
    if (const Rank* r = rank_of(symbols[static_cast<size_t>(i)], symbols[static_cast<size_t>(j)])) {
      heap.emplace_back(r->rank, i);
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const auto [rank, i] = heap.back();
    heap.pop_back();
    const int32_t j = next[static_cast<size_t>(i)];
    if (symbols[static_cast<size_t>(i)] < 0 || j < 0) continue;
    const Rank* r = rank_of(symbols[static_cast<size_t>(i)], symbols[static_cast<size_t>(j)]);
    if (!r || r->rank != rank) continue;  // stale: a neighbour changed since the push
    symbols[static_cast<size_t>(i)] = r->merged;
    symbols[static_cast<size_t>(j)] = -1;
    next[static_cast<size_t>(i)] = next[static_cast<size_t>(j)];
    if (next[static_cast<size_t>(j)] >= 0) prev[static_cast<size_t>(next[static_cast<size_t>(j)])] = i;
    if (prev[static_cast<size_t>(i)] >= 0) push(prev[static_cast<size_t>(i)]);
    push(i);
  }
  symbols.erase(std::remove(symbols.begin(), symbols.end(), -1), symbols.end());
}

void BpeModel::encode_word_uncached(std::string_view word, std::vector<int32_t>& out) const {
  if (options_.ignore_merges) {
    const int32_t id = find(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  initial_symbols(word, symbols);
  if (symbols.size() <= kShortWord) merge_short(symbols);
  else merge_long(symbols);
  out.insert(out.end(), symbols.begin(), symbols.end());
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() == 1 && byte_ids_[static_cast<uint8_t>(word[0])] >= 0) {
    out.push_back(byte_ids_[static_cast<uint8_t>(word[0])]);
    return;
  }
  if (word.size() > kMaxCachedBytes) {
    encode_word_uncached(word, out);
    return;
  }
  WordCache& cache = word_cache();
  if (cache.owner != serial_ || cache.words.size() >= kMaxCachedWords) {
    cache.words.clear();
    cache.ids.clear();
    cache.owner = serial_;
  }
  const uint64_t h = hash_bytes(word);
  const int64_t hit = cache.words.find(word, h);
  if (hit >= 0) {
    const int64_t v = cache.words.value(static_cast<size_t>(hit));
    const auto* ids = cache.ids.data() + (v >> 8);
    out.insert(out.end(), ids, ids + (v & 0xFF));
    return;
  }
  cache.scratch.clear();
  encode_word_uncached(word, cache.scratch);
  const auto offset = static_cast<int64_t>(cache.ids.size());
  cache.ids.insert(cache.ids.end(), cache.scratch.begin(), cache.scratch.end());
  cache.words.find_or_insert(word, h, (offset << 8) | static_cast<int64_t>(cache.scratch.size()));
  out.insert(out.end(), cache.scratch.begin(), cache.scratch.end());
}

}  // namespace kiln::bpe
