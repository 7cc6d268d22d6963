// Plain text files: documents separated by a separator string ("\n\n" by default).
#pragma once

#include "data/document_reader.h"
#include "data/readers/pieces.h"

namespace kiln {

// Pieces that are empty or whitespace-only are skipped: runs of blank lines are
// formatting, not text. A document that is not valid UTF-8 is bad input (reported
// with the line of the first invalid byte). Streams: memory is one document + a chunk.
class TextFileSource final : public DocumentSource {
 public:
  TextFileSource(std::string path, std::string separator, BadInputLog& log);
  bool next(Document& doc) override;
  const std::string& path() const override { return reader_.path(); }

 private:
  PieceReader reader_;
  BadInputLog& log_;
  uint64_t next_id_ = 0;
};

}  // namespace kiln
