// JSON Lines: one object per line whose string field `text_key` is the document.
#pragma once

#include "data/document_reader.h"
#include "data/readers/pieces.h"

namespace kiln {

// Blank lines are skipped (formatting). Bad input, each named "PATH:LINE": a line that
// is not valid UTF-8, a line that does not parse as JSON, an object without a string
// field `text_key`, and a document whose text is empty. Streams line by line.
class JsonlFileSource final : public DocumentSource {
 public:
  JsonlFileSource(std::string path, std::string text_key, BadInputLog& log);
  bool next(Document& doc) override;
  const std::string& path() const override { return reader_.path(); }

 private:
  PieceReader reader_;
  std::string text_key_;
  BadInputLog& log_;
  uint64_t next_id_ = 0;
};

}  // namespace kiln
