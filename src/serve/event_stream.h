// A generation streamed to its client as server-sent events (serve/sse.h), shared by the
// endpoints that stream: each shapes its chunks with a ChunkFormat (completions:
// serve/completion_stream.h; chat: serve/chat_stream.h), the loop here is the same for all.
#pragma once

#include "serve/batch_worker.h"
#include "serve/token_feed.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace kiln::serve {

class RequestStream;

class ChunkFormat {
 public:
  virtual ~ChunkFormat() = default;
  // Chunks sent before any text, once the stream has begun (chat's delta.role); none by default.
  virtual std::vector<nlohmann::json> opening() { return {}; }
  // The chunk of one update of choice u.index: its new text, the logprobs that came with it
  // (when asked), finish_reason null but on its last.
  virtual nlohmann::json chunk(const TokenFeed::Update& u) = 0;
  // The same for text alone; `finish_reason` null but on its last.
  nlohmann::json chunk(size_t index, const std::string& text, const std::string* finish_reason);
  // The chunk after the last choice's: usage, and no choices (stream_options.include_usage).
  virtual nlohmann::json usage_chunk(int64_t prompt_tokens, int64_t completion_tokens) = 0;
};

struct EventStreamOptions {
  bool chunked = true;         // HTTP/1.1 chunked framing; false: ended by closing (HTTP/1.0)
  bool close = false;          // close the connection after the stream
  bool include_usage = false;  // stream_options.include_usage
};

// Submits `sequences` to `worker` (throws as BatchWorker::submit does, before any byte is
// written, so the caller answers as for any request), then writes the event stream on
// `stream`: each sequence's text as it settles, its last chunk with its finish_reason,
// usage when asked, [DONE]. A sequence that fails ends the stream with an error event and
// [DONE]. A client that goes away (a write fails, or it closes while the model works)
// cancels the sequences: their slots are free at the model's next step. Returns false
// then (the connection is not to be reused).
bool stream_generation(RequestStream& stream, BatchWorker& worker, std::vector<GenerationRequest> sequences,
                       ChunkFormat& format, const EventStreamOptions& options);

}  // namespace kiln::serve
