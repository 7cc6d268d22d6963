// Documents: where training text comes from, before any tokenization.
//
// A DocumentSource yields the documents of a corpus in a fixed order with stable ids,
// so that splits, shuffles and resume positions can name a document. The sources here
// read a whole file into memory (the default corpus is ~1 MB); streaming and sharded
// sources (a later issue) implement the same interface and register a format name.
#pragma once

#include "train/config.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kiln {

struct Document {
  uint64_t id = 0;   // index among the documents of its file: 0, 1, 2, ...
  std::string text;  // exactly as in the file (for text files: between separators)
};

class DocumentSource {
 public:
  virtual ~DocumentSource() = default;
  // All documents in file order; throws kiln::Error("[data] ...") naming the file (and
  // line for line-based formats) on any problem, and when there are no documents.
  virtual std::vector<Document> read_all() = 0;
  // The file or location, for messages.
  virtual const std::string& path() const = 0;
};

// Plain text: documents separated by `separator` ("\n\n" by default). Pieces that are
// empty or whitespace-only are skipped: runs of blank lines are formatting, not text.
class TextFileSource final : public DocumentSource {
 public:
  TextFileSource(std::string path, std::string separator);
  std::vector<Document> read_all() override;
  const std::string& path() const override { return path_; }

 private:
  std::string path_;
  std::string separator_;
};

// JSON Lines: one object per line whose string field `text_key` is the document.
// Blank lines are allowed (and skipped); so are documents whose text is empty.
class JsonlFileSource final : public DocumentSource {
 public:
  JsonlFileSource(std::string path, std::string text_key);
  std::vector<Document> read_all() override;
  const std::string& path() const override { return path_; }

 private:
  std::string path_;
  std::string text_key_;
};

// The format a DataConfig selects: "text", "jsonl", or "auto" (.jsonl/.json -> jsonl,
// anything else -> text). Throws naming data.format for an unknown format.
std::string resolve_format(const DataConfig& config);
std::unique_ptr<DocumentSource> make_document_source(const DataConfig& config);
// Shorthand: make_document_source(config)->read_all().
std::vector<Document> read_documents(const DataConfig& config);

// The whole file as bytes; throws "[data] cannot open 'PATH'".
std::string read_file_bytes(const std::string& path);

}  // namespace kiln
