// Generator: continuous batching of generation requests over a Decoder's KV-cache slots.
//
// Requests wait in a queue until a slot is free. Each step() runs ONE decoder forward that
// holds a decode row for every sequence that is generating (so all of them advance by one
// token) and fills the rest of the row budget with prefill chunks of prompts (a long prompt
// takes several steps). Finished sequences free their slot at once and report through their
// callback, so new requests join between steps. `kiln sample` runs a batch of prompts with
// it; `kiln serve` drives step() from its worker thread, and the trainer's samples run
// through it too.
//
// Tokens are chosen here and only here, among the ids the tokenizer can decode: a model
// whose vocabulary is padded past the tokenizer's (model.vocab_size 4096 over a 300-token
// BPE, for faster GEMMs) never yields a padded id. Logprobs are over the same ids.
#pragma once

#include "data/tokenizer.h"
#include "infer/decoder.h"
#include "infer/sampling.h"

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kiln {

struct GenerationResult;

struct GenerationRequest {
  std::vector<int32_t> prompt;     // token ids, at least one (BOS first if the caller wants it)
  int64_t max_tokens = 16;         // tokens to generate; 0 = score the prompt only
  SamplingParams sampling;
  uint64_t seed = 0;
  std::vector<std::string> stop;   // stop strings: generation ends when the text contains one
  bool stop_at_eos = true;
  bool prompt_logprobs = false;    // logprob of each prompt token given those before it
  // ...from this prompt position on: the earlier positions' logprobs stay NaN and their rows
  // compute no logits (a scorer's context, whose tokens it does not score).
  int64_t prompt_logprobs_from = 1;
  bool logprobs = false;           // logprob of each generated token (raw model distribution)
  int64_t top_logprobs = 0;        // alternatives recorded with every logprob above
  // Streaming: called from step() after each generated token that did not end the sequence,
  // with the result so far (text cut at stop strings as it stands); `done` reports the end.
  std::function<void(const GenerationResult&)> on_token;
  // Set from any thread to end the sequence at the next step() and free its slot at once
  // (a streaming client that went away); it ends with finish_reason "cancelled".
  std::shared_ptr<const std::atomic<bool>> cancelled;
  // One of several sequences of one prompt (OpenAI's n, best_of): this request shares the
  // prefill of the request submitted just before it (no step() between), whose prompt must
  // be the same. The group is admitted when there is a slot for each of its sequences; the
  // first runs the prompt, and when its last prompt row has run, each other sequence takes
  // a copy of its cached prompt (Decoder::copy_slot) and draws its first token from that
  // same row's logits with its own seed. So each sequence is exactly what it would be
  // alone, and the prompt runs once.
  bool shares_prefill = false;
};

struct TokenLogprob {
  int32_t token = 0;
  double logprob = 0;  // NaN for the first prompt token (nothing predicts it)
  std::vector<std::pair<int32_t, double>> top;
};

struct GenerationResult {
  std::vector<int32_t> tokens;         // generated ids (an ending EOS is not included)
  std::string text;                    // their text, cut before a stop string
  std::string finish_reason;           // "stop" (EOS or a stop string) | "length" | "error" | "cancelled"
  std::vector<TokenLogprob> prompt_logprobs;  // one per prompt token when asked
  std::vector<TokenLogprob> logprobs;         // one per generated token when asked
  // The EOS that ended the sequence (finish_reason "stop" by EOS), when logprobs were asked:
  // not a generated token (no text), but OpenAI-style servers list it after them, and
  // lm-eval's local-completions drops the last entry of an echoed prompt's list as the
  // generated one.
  std::optional<TokenLogprob> eos_logprob;
  int64_t prompt_tokens = 0;
  std::string error;                   // why it failed (finish_reason "error"); empty otherwise
};

class Generator {
 public:
  using Done = std::function<void(GenerationResult&&)>;

  Generator(Decoder& decoder, const Tokenizer& tokenizer);
  ~Generator();

  // Throws kiln::Error ("[generate] ...") for an empty prompt, a prompt plus max_tokens
  // longer than the cache (decoder.max_len()), ids outside the vocabulary (the tokenizer's,
  // when the model's is padded past it) or bad sampling parameters. Reads only the
  // decoder's shape: safe to call from any thread.
  void validate(const GenerationRequest& request) const;
  // validate(), then queues the request. `done` is called from step() or abort().
  void submit(GenerationRequest request, Done done);
  // Ends every queued and running request with `why` as its error (at shutdown) and frees
  // all slots.
  void abort(const std::string& why);
  // Ends the running requests with `why` (after step() threw: the shared forward failed
  // for all of them); queued requests stay queued for the next step.
  void fail_active(const std::string& why);
  // One forward of the decoder and everything that follows from it; false when there was
  // nothing to do. A failure in one sequence's own work after the forward (sampling,
  // decoding its text) ends that sequence alone (finish_reason "error"); only a failure
  // of the forward itself throws.
  bool step();
  bool idle() const { return queue_.empty() && active_.empty(); }
  const Decoder& decoder() const { return decoder_; }
  int64_t active() const { return static_cast<int64_t>(active_.size()); }
  int64_t queued() const { return static_cast<int64_t>(queue_.size()); }
  // Prompt positions run through the decoder so far (a shared prefill counts once).
  int64_t prefilled_tokens() const { return prefilled_tokens_; }

  // Runs requests to completion; results in request order.
  std::vector<GenerationResult> run(std::vector<GenerationRequest> requests);

 private:
  struct Sequence;
  void sample_next(Sequence& s, const float* logits);
  void append(Sequence& s, int32_t token);
  bool argmax_only(const Sequence& s, int64_t position) const;
  void finish(Sequence& s, const char* reason);
  void drop_cancelled();
  void fork(Sequence& leader, const int32_t* argmax, const float* logits);
  void fail_followers(Sequence& leader, const std::string& why, bool held_slots);

  Decoder& decoder_;
  const Tokenizer& tokenizer_;
  // Ids [0, choosable_) are the ones the tokenizer can decode; the decoder's rows past them
  // (a padded vocabulary) are never sampled.
  int64_t choosable_ = 0;
  std::deque<std::unique_ptr<Sequence>> queue_;
  std::vector<std::unique_ptr<Sequence>> active_;
  std::vector<int32_t> free_slots_;
  Sampler sampler_;
  // Step scratch, reused.
  std::vector<int32_t> tokens_, slots_, positions_, logit_rows_;
  std::vector<int32_t> copied_rows_, argmax_rows_, argmax_ids_;  // logit_rows_ split by argmax_only
  std::vector<std::pair<Sequence*, int64_t>> rows_;  // each row's sequence and position
  std::vector<float> logits_, row_;
  std::vector<double> logprobs_;
  size_t rotate_ = 0;  // first sequence given a decode row when the budget is short
  int64_t prefilled_tokens_ = 0;
};

}  // namespace kiln
