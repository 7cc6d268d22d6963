// Streaming split of a (possibly compressed) file into pieces at a separator: lines for
// JSONL ("\n"), documents for text files ("\n\n" by default). Memory is bounded by the
// longest piece plus one read chunk, not by the file.
#pragma once

#include "data/bad_input.h"
#include "data/readers/compressed.h"

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace kiln {

class PieceReader {
 public:
  // Opens `path` (throws "[data] cannot open ..."). A corrupt or truncated compressed
  // stream is reported to `log` as BadInput::truncated; in lenient mode the reader then
  // ends, dropping the incomplete last piece.
  PieceReader(std::string path, std::string separator, BadInputLog& log);

  // The next piece (valid until the next call) and the 1-based line it starts on.
  // Returns false at the end. The piece after the last separator is returned too, even
  // when empty, exactly as splitting the whole file would.
  bool next(std::string_view& piece, int64_t& line);

  const std::string& path() const { return path_; }

 private:
  // Reads one more chunk into buf_; false at the end of the stream (or on corruption).
  bool fill();

  std::string path_;
  std::string separator_;
  BadInputLog& log_;
  std::unique_ptr<ByteStream> stream_;
  std::string buf_;
  size_t head_ = 0;          // start of the unconsumed bytes in buf_
  int64_t line_ = 1;         // line number at head_
  bool eof_ = false;
  bool done_ = false;
  bool corrupt_ = false;
};

}  // namespace kiln
