#include "infer/generator.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kiln {

struct Generator::Sequence {
  GenerationRequest request;
  Done done;
  Rng rng{0};
  int32_t slot = -1;
  int64_t cached = 0;             // positions of `context` already in the cache
  std::vector<int32_t> context;   // prompt, then generated tokens
  GenerationResult result;
  bool finished = false;
  // The sequences sharing this one's prefill (GenerationRequest::shares_prefill) until they
  // fork from it: they hold slots from admission on but run no rows before.
  std::vector<std::unique_ptr<Sequence>> followers;
};

Generator::Generator(Decoder& decoder, const Tokenizer& tokenizer)
    : decoder_(decoder),
      tokenizer_(tokenizer),
      choosable_(std::min<int64_t>(decoder.vocab_size(), tokenizer.vocab_size())) {
  for (int32_t s = static_cast<int32_t>(decoder.slots()); s-- > 0;) free_slots_.push_back(s);
}

Generator::~Generator() = default;

void Generator::validate(const GenerationRequest& request) const {
  const int64_t n = static_cast<int64_t>(request.prompt.size());
  KILN_CHECK(n > 0, "generate", "the prompt is empty (at least one token, e.g. BOS, is needed)");
  KILN_CHECK(request.max_tokens >= 0, "generate", "max_tokens must be >= 0, got {}", request.max_tokens);
  KILN_CHECK(n + request.max_tokens <= decoder_.max_len(), "generate",
             "the prompt ({} tokens) plus max_tokens ({}) exceeds the context of {} tokens", n, request.max_tokens,
             decoder_.max_len());
  for (const int32_t id : request.prompt)
    KILN_CHECK(id >= 0 && id < choosable_, "generate", "token id {} is outside the vocabulary [0, {})", id, choosable_);
  KILN_CHECK(request.top_logprobs >= 0, "generate", "top_logprobs must be >= 0");
  KILN_CHECK(request.prompt_logprobs_from >= 1, "generate", "prompt_logprobs_from must be >= 1, got {}",
             request.prompt_logprobs_from);
  request.sampling.validate();
}

void Generator::submit(GenerationRequest request, Done done) {
  validate(request);
  const auto n = static_cast<int64_t>(request.prompt.size());
  auto s = std::make_unique<Sequence>();
  s->rng = Rng(request.seed);
  s->context = request.prompt;
  s->result.prompt_tokens = n;
  if (request.prompt_logprobs) {
    // Positions before prompt_logprobs_from (the first always: nothing predicts it) keep
    // their token and a NaN logprob.
    s->result.prompt_logprobs.resize(static_cast<size_t>(n));
    const int64_t unscored = std::min(n, request.prompt_logprobs_from);
    for (int64_t p = 0; p < unscored; ++p)
      s->result.prompt_logprobs[static_cast<size_t>(p)] = {request.prompt[static_cast<size_t>(p)],
                                                           std::numeric_limits<double>::quiet_NaN(), {}};
  }
  const bool follows = request.shares_prefill;
  s->request = std::move(request);
  s->done = std::move(done);
  if (!follows) return queue_.push_back(std::move(s));
  KILN_CHECK(!queue_.empty() && queue_.back()->request.prompt == s->request.prompt, "generate",
             "a request sharing a prefill must follow one with the same prompt, still queued");
  Sequence& leader = *queue_.back();
  // A group larger than the cache would wait for its slots forever.
  KILN_CHECK(static_cast<int64_t>(leader.followers.size()) + 2 <= decoder_.slots(), "generate",
             "{} sequences sharing one prefill need as many slots; the decoder has {}", leader.followers.size() + 2,
             decoder_.slots());
  leader.followers.push_back(std::move(s));
}

// The leader's last prompt row has run (its logits `logits`, or only their argmax): each
// follower takes the cached prompt and draws its first token from the same row.
void Generator::fork(Sequence& leader, const int32_t* argmax, const float* logits) {
  const auto prompt = static_cast<int64_t>(leader.request.prompt.size());
  for (auto& f : leader.followers) {
    decoder_.copy_slot(leader.slot, f->slot, prompt);
    f->cached = prompt;
    f->result.prompt_logprobs = leader.result.prompt_logprobs;
    try {
      if (f->request.max_tokens > 0 && argmax) append(*f, *argmax);
      else if (f->request.max_tokens > 0 && logits) sample_next(*f, logits);
    } catch (const std::exception& e) {
      f->result.error = e.what();
      finish(*f, "error");
    }
    active_.push_back(std::move(f));
  }
  leader.followers.clear();
}

// A leader that ends before its followers forked (it failed in its prompt, or was
// cancelled) ends them too, freeing the slots they held.
void Generator::fail_followers(Sequence& leader, const std::string& why, bool held_slots) {
  for (auto& f : leader.followers) {
    if (held_slots) free_slots_.push_back(f->slot);
    f->result.error = why;
    f->result.finish_reason = why.empty() ? "cancelled" : "error";
    if (f->done) f->done(std::move(f->result));
  }
  leader.followers.clear();
}

void Generator::finish(Sequence& s, const char* reason) {
  s.finished = true;
  s.result.finish_reason = reason;
}

// Samples the token after s.context from `logits` (the row predicting it) and applies the
// stop rules.
void Generator::sample_next(Sequence& s, const float* logits) {
  const auto vocab = static_cast<size_t>(choosable_);  // a padded vocabulary's tail is never drawn
  if (s.request.logprobs) log_softmax({logits, vocab}, logprobs_);
  row_.assign(logits, logits + vocab);
  const int32_t token =
      sampler_.sample(row_, s.context, s.request.sampling, s.rng, static_cast<size_t>(s.result.prompt_tokens));
  if (s.request.logprobs) {
    TokenLogprob lp{token, logprobs_[static_cast<size_t>(token)], top_logprobs(logprobs_, s.request.top_logprobs)};
    if (s.request.stop_at_eos && token == tokenizer_.eos_id()) s.result.eos_logprob = std::move(lp);
    else s.result.logprobs.push_back(std::move(lp));
  }
  append(s, token);
}

// The row at `position` of s needs only its argmax: it predicts a generated token, greedily
// (temperature 0), with no penalty or bias to apply and no logprobs to report. Its logits then stay
// on the device (Decoder::greedy: one id per row comes back), unless the vocabulary is
// padded: the device's argmax would see the padded ids too.
bool Generator::argmax_only(const Sequence& s, int64_t position) const {
  const GenerationRequest& r = s.request;
  return choosable_ == decoder_.vocab_size() && position + 1 >= static_cast<int64_t>(r.prompt.size()) &&
         r.sampling.temperature == 0.0 && !r.sampling.changes_logits() && !r.logprobs;
}

// Takes `token` as the next of s (an EOS ends it instead when asked) and applies the stop
// rules.
void Generator::append(Sequence& s, int32_t token) {
  if (s.request.stop_at_eos && token == tokenizer_.eos_id()) return finish(s, "stop");
  s.context.push_back(token);
  s.result.tokens.push_back(token);
  s.result.text = tokenizer_.decode(s.result.tokens);
  size_t cut = std::string::npos;
  for (const std::string& stop : s.request.stop)
    if (!stop.empty()) cut = std::min(cut, s.result.text.find(stop));
  if (cut != std::string::npos) {
    s.result.text.resize(cut);
    return finish(s, "stop");
  }
  if (static_cast<int64_t>(s.result.tokens.size()) >= s.request.max_tokens) return finish(s, "length");
  if (s.request.on_token) s.request.on_token(s.result);
}

// Ends the sequences whose `cancelled` flag is set, queued or running, before a step puts
// them in its forward: a running one's slot goes to the next in the queue this step.
void Generator::drop_cancelled() {
  auto is_cancelled = [](const std::unique_ptr<Sequence>& s) {
    return s->request.cancelled && s->request.cancelled->load(std::memory_order_relaxed);
  };
  std::vector<std::unique_ptr<Sequence>> dropped;
  for (auto it = active_.begin(); it != active_.end();) {
    if (!is_cancelled(*it)) {
      ++it;
      continue;
    }
    free_slots_.push_back((*it)->slot);
    fail_followers(**it, "", true);
    dropped.push_back(std::move(*it));
    it = active_.erase(it);
  }
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (!is_cancelled(*it)) {
      ++it;
      continue;
    }
    fail_followers(**it, "", false);
    dropped.push_back(std::move(*it));
    it = queue_.erase(it);
  }
  for (auto& s : dropped) {
    finish(*s, "cancelled");
    if (s->done) s->done(std::move(s->result));
  }
}

bool Generator::step() {
  drop_cancelled();
  // A group sharing a prefill takes a slot for each of its sequences at once (the first in
  // line waits for them, so a group is not passed over for ever by single requests).
  // Each slot taken starts a new sequence: its decode state is reset (a recurrent mixer's
  // would otherwise carry the previous sequence's; a follower's is then copied over).
  auto take_slot = [&] {
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    decoder_.reset_slot(slot);
    return slot;
  };
  while (!queue_.empty() && free_slots_.size() >= 1 + queue_.front()->followers.size()) {
    Sequence& s = *queue_.front();
    s.slot = take_slot();
    for (auto& f : s.followers) f->slot = take_slot();
    active_.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  if (active_.empty()) return false;

  // Rows: one decode token per generating sequence, then prefill chunks.
  tokens_.clear(), slots_.clear(), positions_.clear(), logit_rows_.clear(), rows_.clear();
  const int64_t budget = decoder_.max_rows();
  auto add_row = [&](Sequence& s, int64_t position, bool wants_logits) {
    if (wants_logits) logit_rows_.push_back(static_cast<int32_t>(tokens_.size()));
    tokens_.push_back(s.context[static_cast<size_t>(position)]);
    slots_.push_back(s.slot);
    positions_.push_back(static_cast<int32_t>(position));
    rows_.emplace_back(&s, position);
  };
  const size_t count = active_.size();
  for (size_t i = 0; i < count && static_cast<int64_t>(tokens_.size()) < budget; ++i) {
    Sequence& s = *active_[(i + rotate_) % count];
    const auto prompt = static_cast<int64_t>(s.request.prompt.size());
    if (s.cached >= prompt) add_row(s, s.cached, true);
  }
  rotate_ = count ? (rotate_ + 1) % count : 0;
  for (size_t i = 0; i < count && static_cast<int64_t>(tokens_.size()) < budget; ++i) {
    Sequence& s = *active_[i];
    const auto prompt = static_cast<int64_t>(s.request.prompt.size());
    if (s.cached >= prompt) continue;
    const int64_t take = std::min(prompt - s.cached, budget - static_cast<int64_t>(tokens_.size()));
    prefilled_tokens_ += take;
    for (int64_t p = s.cached; p < s.cached + take; ++p) {
      const bool last = p == prompt - 1;
      const bool scored = s.request.prompt_logprobs && p + 1 < prompt && p + 1 >= s.request.prompt_logprobs_from;
      add_row(s, p, scored || (last && s.request.max_tokens > 0));
    }
  }

  decoder_.forward(tokens_, slots_, positions_);
  copied_rows_.clear(), argmax_rows_.clear();
  for (const int32_t r : logit_rows_) {
    const auto& [s, p] = rows_[static_cast<size_t>(r)];
    (argmax_only(*s, p) ? argmax_rows_ : copied_rows_).push_back(r);
  }
  if (!copied_rows_.empty()) decoder_.logits(copied_rows_, logits_);
  if (!argmax_rows_.empty()) decoder_.greedy(argmax_rows_, argmax_ids_);

  const auto vocab = static_cast<size_t>(decoder_.vocab_size());
  size_t next_copied = 0, next_argmax = 0;
  for (size_t r = 0; r < rows_.size(); ++r) {
    Sequence& s = *rows_[r].first;
    const int64_t p = rows_[r].second;
    s.cached = p + 1;
    const auto row_index = static_cast<int32_t>(r);
    const bool has_argmax = next_argmax < argmax_rows_.size() && argmax_rows_[next_argmax] == row_index;
    const bool has_logits = !has_argmax && next_copied < copied_rows_.size() && copied_rows_[next_copied] == row_index;
    const int32_t argmax = has_argmax ? argmax_ids_[next_argmax++] : -1;
    const float* row = has_logits ? logits_.data() + next_copied++ * vocab : nullptr;
    if (!s.result.error.empty()) continue;  // failed at an earlier row of this step
    // What follows the forward is one sequence's own work (sampling, decoding its text,
    // stop strings, logprobs): when it throws, that sequence alone ends with the error and
    // the others of the step go on.
    const auto prompt = static_cast<int64_t>(s.request.prompt.size());
    try {
      if (has_argmax) {
        if (!s.finished && s.request.max_tokens > 0) append(s, argmax);
      } else if (has_logits) {
        if (s.request.prompt_logprobs && p + 1 < prompt && p + 1 >= s.request.prompt_logprobs_from) {
          log_softmax({row, static_cast<size_t>(choosable_)}, logprobs_);  // over the ids the tokenizer has
          const int32_t next = s.request.prompt[static_cast<size_t>(p + 1)];
          s.result.prompt_logprobs[static_cast<size_t>(p + 1)] = {next, logprobs_[static_cast<size_t>(next)],
                                                                  top_logprobs(logprobs_, s.request.top_logprobs)};
        }
        if (p + 1 >= prompt && !s.finished && s.request.max_tokens > 0) sample_next(s, row);
      }
    } catch (const std::exception& e) {
      s.result.error = e.what();
      finish(s, "error");
    }
    // The prompt is whole in the leader's cache: its followers fork from it (only while it
    // has no error: a failed prompt row leaves their prompt logprobs incomplete).
    if (p + 1 == prompt && !s.followers.empty() && s.result.error.empty())
      fork(s, has_argmax ? &argmax : nullptr, has_logits ? row : nullptr);
  }
  // Scoring-only requests end with their prompt.
  for (auto& s : active_)
    if (!s->finished && s->request.max_tokens == 0 && s->cached >= static_cast<int64_t>(s->request.prompt.size()))
      finish(*s, "length");

  for (size_t i = 0; i < active_.size();) {
    if (!active_[i]->finished) {
      ++i;
      continue;
    }
    std::unique_ptr<Sequence> s = std::move(active_[i]);
    active_.erase(active_.begin() + static_cast<std::ptrdiff_t>(i));
    free_slots_.push_back(s->slot);
    fail_followers(*s, s->result.error.empty() ? "the shared prompt ended" : s->result.error, true);
    if (s->done) s->done(std::move(s->result));
  }
  return true;
}

void Generator::fail_active(const std::string& why) {
  for (auto& s : active_) {
    free_slots_.push_back(s->slot);
    fail_followers(*s, why, true);
    s->result.error = why;
    s->result.finish_reason = "error";
    if (s->done) s->done(std::move(s->result));
  }
  active_.clear();
}

void Generator::abort(const std::string& why) {
  std::vector<std::unique_ptr<Sequence>> all = std::move(active_);
  active_.clear();
  for (auto& s : queue_) all.push_back(std::move(s));
  queue_.clear();
  for (size_t i = 0, n = all.size(); i < n; ++i) {  // followers not yet forked are ended too
    for (auto& f : all[i]->followers) all.push_back(std::move(f));
    all[i]->followers.clear();
  }
  free_slots_.clear();
  for (int32_t s = static_cast<int32_t>(decoder_.slots()); s-- > 0;) free_slots_.push_back(s);
  for (auto& s : all) {
    s->result.error = why;
    s->result.finish_reason = "error";
    if (s->done) s->done(std::move(s->result));
  }
}

std::vector<GenerationResult> Generator::run(std::vector<GenerationRequest> requests) {
  std::vector<GenerationResult> results(requests.size());
  for (size_t i = 0; i < requests.size(); ++i)
    submit(std::move(requests[i]), [&results, i](GenerationResult&& r) { results[i] = std::move(r); });
  while (step()) {
  }
  return results;
}

}  // namespace kiln
