#include "serve/token_feed.h"

#include <algorithm>

namespace kiln::serve {

size_t settled_length(std::string_view text, const std::vector<std::string>& stops) {
  size_t n = text.size();
  // A trailing lead byte whose character is not complete yet (a byte-level model emits a
  // multi-byte character a token at a time).
  for (size_t back = 1; back <= std::min<size_t>(3, text.size()); ++back) {
    const auto c = static_cast<unsigned char>(text[text.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if (need > back) n = text.size() - back;
    break;
  }
  // The longest end of the text that a stop string starts with (the generator has already
  // cut the text at any whole stop string).
  for (const std::string& stop : stops) {
    if (stop.empty()) continue;
    for (size_t k = std::min(stop.size() - 1, text.size()); k > 0; --k)
      if (text.substr(text.size() - k) == std::string_view(stop).substr(0, k)) {
        n = std::min(n, text.size() - k);
        break;
      }
  }
  return n;
}

namespace {

// Copies the logprobs of `result` that `s` has not taken yet into its pending lists.
template <class Sequence>
void take_logprobs(Sequence& s, const GenerationResult& result) {
  if (!s.prompt_taken) {
    s.prompt_logprobs = result.prompt_logprobs;
    s.prompt_taken = true;
  }
  for (; s.logprobs_taken < result.logprobs.size(); ++s.logprobs_taken)
    s.logprobs.push_back(result.logprobs[s.logprobs_taken]);
}

}  // namespace

BatchWorker::Done TokenFeed::connect(const std::shared_ptr<TokenFeed>& feed, std::vector<GenerationRequest>& sequences) {
  {
    std::lock_guard lock(feed->mutex_);
    feed->sequences_.resize(sequences.size());
    for (size_t i = 0; i < sequences.size(); ++i) feed->sequences_[i].stops = sequences[i].stop;
  }
  for (size_t i = 0; i < sequences.size(); ++i) {
    sequences[i].cancelled = feed->cancelled_;
    // The feed is held by these callbacks, not the other way round: a handler that gave up
    // (its client gone) leaves, and the sequences still end into a live feed.
    sequences[i].on_token = [feed, i](const GenerationResult& partial) {
      {
        std::lock_guard lock(feed->mutex_);
        Sequence& s = feed->sequences_[i];
        s.latest = partial.text;
        take_logprobs(s, partial);
        s.fresh = true;
      }
      feed->changed_.notify_one();
    };
  }
  return [feed](size_t i, GenerationResult&& result) {
    {
      std::lock_guard lock(feed->mutex_);
      Sequence& s = feed->sequences_[i];
      take_logprobs(s, result);
      s.result = std::move(result);
      s.ended = s.fresh = true;
    }
    feed->changed_.notify_one();
  };
}

std::vector<TokenFeed::Update> TokenFeed::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  changed_.wait_for(lock, timeout, [&] {
    return std::any_of(sequences_.begin(), sequences_.end(), [](const Sequence& s) { return s.fresh; });
  });
  std::vector<Update> updates;
  for (size_t i = 0; i < sequences_.size(); ++i) {
    Sequence& s = sequences_[i];
    if (!s.fresh || s.reported) continue;
    s.fresh = false;
    Update u;
    u.index = i;
    const std::string& text = s.ended ? s.result.text : s.latest;
    const size_t settled = s.ended ? text.size() : settled_length(text, s.stops);
    // Decoding more tokens could in principle rewrite text already sent (a tokenizer whose
    // decode is not prefix-stable); what was sent stands, and only text after it goes on.
    if (settled > s.sent.size() && text.compare(0, s.sent.size(), s.sent) == 0)
      u.text = text.substr(s.sent.size(), settled - s.sent.size());
    s.sent += u.text;
    u.prompt_logprobs = std::move(s.prompt_logprobs);
    u.logprobs = std::move(s.logprobs);
    s.prompt_logprobs.clear();
    s.logprobs.clear();
    if (s.ended) {
      s.reported = true;
      u.finish_reason = s.result.finish_reason;
      u.error = s.result.error;
      u.eos_logprob = s.result.eos_logprob;
    } else if (u.text.empty() && u.logprobs.empty() && u.prompt_logprobs.empty()) {
      continue;
    }
    updates.push_back(std::move(u));
  }
  return updates;
}

bool TokenFeed::finished() const {
  std::lock_guard lock(mutex_);
  return std::all_of(sequences_.begin(), sequences_.end(), [](const Sequence& s) { return s.reported; });
}

int64_t TokenFeed::completion_tokens() const {
  std::lock_guard lock(mutex_);
  int64_t n = 0;
  for (const Sequence& s : sequences_) n += static_cast<int64_t>(s.result.tokens.size());
  return n;
}

}  // namespace kiln::serve
