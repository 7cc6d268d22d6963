#include "data/bpe/bpe_trainer.h"

#include "core/error.h"
#include "data/bpe/added_tokens.h"
#include "data/bpe/bpe_tokenizer.h"
#include "data/bpe/byte_unicode.h"
#include "data/bpe/normalizer.h"
#include "data/bpe/pretokenizer.h"

#include <omp.h>

#include <algorithm>
#include <fstream>
#include <memory>

namespace kiln::bpe {
namespace {

constexpr size_t kChunkBytes = 1 << 20;

// The first chunk boundary at or after `pos`: just after a newline that is followed by
// printable ASCII; npos when there is none.
size_t next_boundary(std::string_view text, size_t pos) {
  size_t p = text.find('\n', pos);
  while (p != std::string_view::npos && p + 1 < text.size() &&
         !(text[p + 1] > ' ' && static_cast<uint8_t>(text[p + 1]) < 0x7F))
    p = text.find('\n', p + 1);
  return p == std::string_view::npos || p + 1 >= text.size() ? std::string_view::npos : p + 1;
}

std::vector<size_t> chunk_ends(std::string_view text) {
  std::vector<size_t> ends;
  for (size_t pos = kChunkBytes; pos < text.size();) {
    const size_t end = next_boundary(text, pos);
    if (end == std::string_view::npos) break;
    ends.push_back(end);
    pos = end + kChunkBytes;
  }
  ends.push_back(text.size());
  return ends;
}

struct HeapEntry {
  int64_t count;
  int32_t a, b;
  // Max-heap order: higher count first, then the smaller (a, b).
  bool operator<(const HeapEntry& o) const {
    if (count != o.count) return count < o.count;
    if (a != o.a) return a > o.a;
    return b > o.b;
  }
};

}  // namespace

BpeTrainer::BpeTrainer(BpeTrainerOptions options) : options_(std::move(options)) {
  if (options_.pattern.empty()) options_.pattern = std::string(named_pattern("qwen2"));
  const int64_t base = static_cast<int64_t>(options_.special_tokens.size()) + 256;
  KILN_CHECK(options_.vocab_size >= base, "train-tokenizer", "--vocab-size {} is below the {} special tokens + 256 bytes",
             options_.vocab_size, options_.special_tokens.size());
  // Checked before the tables sized by it are made (a huge value was a bad_alloc), and so
  // that the tokenizer.json written at the end loads again.
  KILN_CHECK(options_.vocab_size <= kMaxTokenizerIds, "train-tokenizer",
             "--vocab-size {} is above kiln's limit of {} ids for a tokenizer.json", options_.vocab_size,
             kMaxTokenizerIds);
  for (const std::string& s : options_.special_tokens)
    KILN_CHECK(!s.empty(), "train-tokenizer", "a special token is empty");
}

void BpeTrainer::add_text(std::string_view text) {
  std::vector<AddedToken> specials(options_.special_tokens.size());
  std::vector<const AddedToken*> special_ptrs;
  for (size_t i = 0; i < specials.size(); ++i) {
    specials[i].content = options_.special_tokens[i];
    specials[i].id = static_cast<int32_t>(i);
    special_ptrs.push_back(&specials[i]);
  }
  const AddedTokenMatcher matcher(special_ptrs, options_.special_tokens);
  Normalizer normalizer;
  if (options_.nfc) normalizer.add(NormalForm::nfc);
  PreTokenizer pretokenizer;
  pretokenizer.add_split(std::make_shared<Regex>(options_.pattern, false, "--pattern"), SplitBehavior::isolated);

  const std::vector<size_t> ends = chunk_ends(text);
  const auto chunks = static_cast<int64_t>(ends.size());
  int64_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    StringMap local(1 << 14);
    std::vector<AddedTokenMatcher::Match> matches;
    std::string normalized;
    auto count_plain = [&](std::string_view segment) {
      if (normalizer.apply(segment, normalized)) segment = normalized;
      pretokenizer.run(segment, [&](std::string_view piece) {
        ++local.value(local.find_or_insert(piece));
        ++total;
      });
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; ++c) {
      const size_t begin = c == 0 ? 0 : ends[static_cast<size_t>(c) - 1];
      const std::string_view chunk = text.substr(begin, ends[static_cast<size_t>(c)] - begin);
      matches.clear();
      matcher.find_all(chunk, matches);
      size_t last = 0;
      for (const auto& m : matches) {
        count_plain(chunk.substr(last, m.begin - last));
        last = m.end;
      }
      count_plain(chunk.substr(last));
    }
#pragma omp critical(kiln_bpe_counts)
    for (size_t i = 0; i < local.size(); ++i)
      counts_.value(counts_.find_or_insert(local.key(i), local.hash_of(i), 0)) += local.value(i);
  }
  total_words_ += total;
}

size_t BpeTrainer::add_file(const std::string& path, size_t block_bytes) {
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in.good(), "train-tokenizer", "{}: cannot open", path);
  const size_t kBlock = std::max<size_t>(block_bytes, 2);
  std::string buffer;
  size_t total = 0;
  while (true) {
    const size_t kept = buffer.size();
    buffer.resize(kept + kBlock);
    in.read(buffer.data() + kept, static_cast<std::streamsize>(kBlock));
    const auto got = static_cast<size_t>(in.gcount());
    buffer.resize(kept + got);
    total += got;
    if (got == 0 || !in) break;
    // Count up to the last boundary; the tail waits for the next block.
    size_t cut = std::string_view::npos;
    for (size_t b = next_boundary(buffer, buffer.size() > kBlock / 2 ? buffer.size() - kBlock / 2 : 0);
         b != std::string_view::npos; b = next_boundary(buffer, b))
      cut = b;
    if (cut == std::string_view::npos) continue;  // no boundary yet: read more
    add_text(std::string_view(buffer).substr(0, cut));
    buffer.erase(0, cut);
  }
  add_text(buffer);
  return total;
}

TrainedBpe BpeTrainer::train() const {
  TrainedBpe out;
  out.pattern = options_.pattern;
  out.nfc = options_.nfc;
  out.num_special = options_.special_tokens.size();
  const auto k = static_cast<int32_t>(out.num_special);
  // Token strings as written in tokenizer.json (mapped), for de-duplication.
  StringMap spelled(static_cast<size_t>(options_.vocab_size));
  for (const std::string& s : options_.special_tokens) {
    KILN_CHECK(spelled.find(s) < 0, "train-tokenizer", "special token '{}' is given twice", s);
    spelled.find_or_insert(s, static_cast<int64_t>(out.tokens.size()));
    out.tokens.push_back(s);
  }
  for (int b = 0; b < 256; ++b) {
    const std::string byte(1, static_cast<char>(b));
    const std::string mapped = bytes_to_token(byte);
    KILN_CHECK(spelled.find(mapped) < 0, "train-tokenizer", "special token '{}' spells a byte token", mapped);
    spelled.find_or_insert(mapped, static_cast<int64_t>(out.tokens.size()));
    out.tokens.push_back(byte);
  }

  // Words of two or more bytes, as symbol ids in one flat array.
  std::vector<int32_t> sym;
  std::vector<size_t> begin;
  std::vector<uint32_t> length;
  std::vector<int64_t> count;
  for (size_t i = 0; i < counts_.size(); ++i) {
    const std::string_view w = counts_.key(i);
    if (w.size() < 2) continue;
    begin.push_back(sym.size());
    length.push_back(static_cast<uint32_t>(w.size()));
    count.push_back(counts_.value(i));
    for (const char ch : w) sym.push_back(k + static_cast<uint8_t>(ch));
  }
  const size_t num_words = begin.size();

  // Pair statistics: index per pair, its count and the words that (may) contain it.
  PairMap<int32_t> pair_index(1 << 16);
  std::vector<int64_t> pair_count;
  std::vector<std::vector<int32_t>> pair_words;
  std::vector<std::pair<int32_t, int32_t>> pair_ids;
  auto index_of = [&](int32_t a, int32_t b) -> size_t {
    int32_t& slot = pair_index[pair_key(a, b)];
    if (slot == 0) {
      pair_count.push_back(0);
      pair_words.emplace_back();
      pair_ids.emplace_back(a, b);
      slot = static_cast<int32_t>(pair_count.size());  // stored + 1: 0 means absent
    }
    return static_cast<size_t>(slot - 1);
  };
  auto add = [&](int32_t a, int32_t b, int64_t delta, int32_t word) {
    const size_t p = index_of(a, b);
    pair_count[p] += delta;
    if (delta > 0 && (pair_words[p].empty() || pair_words[p].back() != word)) pair_words[p].push_back(word);
    return p;
  };
  for (size_t w = 0; w < num_words; ++w)
    for (size_t i = 0; i + 1 < length[w]; ++i) add(sym[begin[w] + i], sym[begin[w] + i + 1], count[w], static_cast<int32_t>(w));

  std::vector<HeapEntry> heap;
  for (size_t p = 0; p < pair_count.size(); ++p)
    if (pair_count[p] >= options_.min_frequency) heap.push_back({pair_count[p], pair_ids[p].first, pair_ids[p].second});
  std::make_heap(heap.begin(), heap.end());
  auto push = [&](const HeapEntry& e) {
    heap.push_back(e);
    std::push_heap(heap.begin(), heap.end());
  };

  std::vector<uint32_t> word_stamp(num_words, 0);
  std::vector<uint32_t> pair_stamp;
  std::vector<char> banned;
  std::vector<size_t> touched;
  uint32_t stamp = 0;
  const int64_t min_count = std::max<int64_t>(1, options_.min_frequency);
  while (static_cast<int64_t>(out.tokens.size()) < options_.vocab_size && !heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const HeapEntry top = heap.back();
    heap.pop_back();
    const size_t p = index_of(top.a, top.b);
    if (p < banned.size() && banned[p]) continue;
    if (pair_count[p] != top.count) {  // stale: the count fell since this entry was pushed
      if (pair_count[p] < top.count && pair_count[p] >= min_count) push({pair_count[p], top.a, top.b});
      continue;
    }
    if (top.count < min_count) break;
    const std::string merged_bytes = out.tokens[static_cast<size_t>(top.a)] + out.tokens[static_cast<size_t>(top.b)];
    const std::string mapped = bytes_to_token(merged_bytes);
    int64_t existing = spelled.find(mapped);
    if (existing >= 0 && spelled.value(static_cast<size_t>(existing)) < k) {
      if (banned.size() <= p) banned.resize(p + 1, 0);
      banned[p] = 1;  // would spell a special token: never merge this pair
      continue;
    }
    int32_t id;
    if (existing >= 0) {
      id = static_cast<int32_t>(spelled.value(static_cast<size_t>(existing)));
    } else {
      id = static_cast<int32_t>(out.tokens.size());
      spelled.find_or_insert(mapped, id);
      out.tokens.push_back(merged_bytes);
    }
    out.merges.emplace_back(top.a, top.b);

    ++stamp;
    touched.clear();
    const std::vector<int32_t> words = std::move(pair_words[p]);
    pair_words[p] = {};
    const int32_t A = top.a, B = top.b;
    for (const int32_t w : words) {
      if (word_stamp[static_cast<size_t>(w)] == stamp) continue;
      word_stamp[static_cast<size_t>(w)] = stamp;
      int32_t* s = sym.data() + begin[static_cast<size_t>(w)];
      const size_t n = length[static_cast<size_t>(w)];
      const int64_t c = count[static_cast<size_t>(w)];
      size_t j = 0;  // output length; s[0..j) is the rewritten prefix
      for (size_t i = 0; i < n;) {
        if (i + 1 < n && s[i] == A && s[i + 1] == B) {
          if (j > 0) {
            touched.push_back(add(s[j - 1], A, -c, w));
            touched.push_back(add(s[j - 1], id, c, w));
          }
          if (i + 2 < n) {
            touched.push_back(add(B, s[i + 2], -c, w));
            touched.push_back(add(id, s[i + 2], c, w));
          }
          pair_count[p] -= c;
          s[j++] = id;
          i += 2;
        } else {
          s[j++] = s[i++];
        }
      }
      length[static_cast<size_t>(w)] = static_cast<uint32_t>(j);
    }
    pair_count[p] = 0;
    if (pair_stamp.size() < pair_count.size()) pair_stamp.resize(pair_count.size() * 2, 0);
    for (const size_t q : touched) {
      if (pair_stamp[q] == stamp || q == p) continue;
      pair_stamp[q] = stamp;
      if (pair_count[q] >= min_count) push({pair_count[q], pair_ids[q].first, pair_ids[q].second});
    }
  }
  return out;
}

}  // namespace kiln::bpe
