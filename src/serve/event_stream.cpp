#include "serve/event_stream.h"

#include "serve/completion_api.h"
#include "serve/request_stream.h"
#include "serve/sse.h"
#include "serve/token_feed.h"

namespace kiln::serve {

namespace {

// How often a stream with no news checks that its client is still there: a client that
// leaves while its request waits for a slot or its prompt fills is noticed within this.
constexpr auto kQuietCheck = std::chrono::milliseconds(50);

}  // namespace

nlohmann::json ChunkFormat::chunk(size_t index, const std::string& text, const std::string* finish_reason) {
  TokenFeed::Update u;
  u.index = index;
  u.text = text;
  if (finish_reason) u.finish_reason = *finish_reason;
  return chunk(u);
}

bool stream_generation(RequestStream& stream, BatchWorker& worker, std::vector<GenerationRequest> sequences,
                       ChunkFormat& format, const EventStreamOptions& options) {
  const int64_t prompt = prompt_tokens(sequences);  // each prompt once, however many choices share it
  auto feed = std::make_shared<TokenFeed>();
  BatchWorker::Done done = TokenFeed::connect(feed, sequences);
  worker.submit(std::move(sequences), std::move(done));

  SseWriter out(stream, options.chunked, options.close || !options.chunked);
  if (options.close || !options.chunked) stream.set_close(true);
  stream.discard_further_writes();  // from here the answer is this stream, not httplib's
  auto gone = [&] {
    feed->cancel();
    stream.fail();
    return false;
  };
  if (!out.begin()) return gone();
  for (const nlohmann::json& chunk : format.opening())
    if (!out.event(chunk)) return gone();
  while (!feed->finished()) {
    const std::vector<TokenFeed::Update> updates = feed->wait(kQuietCheck);
    if (updates.empty() && out.client_gone()) return gone();
    for (const TokenFeed::Update& u : updates) {
      if (!u.error.empty()) {  // one sequence failed: the stream ends with why
        feed->cancel();
        return out.event(error_body(500, "generation failed: " + u.error)) && out.done();
      }
      if (!out.event(format.chunk(u))) return gone();
    }
  }
  if (options.include_usage && !out.event(format.usage_chunk(prompt, feed->completion_tokens())))
    return gone();
  return out.done();
}

}  // namespace kiln::serve
