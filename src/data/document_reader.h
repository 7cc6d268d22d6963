// Documents: where training text comes from, before any tokenization.
//
// A DocumentSource yields the documents of a corpus one at a time, in a fixed order
// with stable ids, so that splits, shuffles and resume positions can name a document.
// Sources stream: a text or JSONL file (plain, .zst or .gz) is read in chunks, a Parquet
// file by row group, an Arrow IPC file (Hugging Face save_to_disk) by record batch, never
// whole. data.path may name a file, a directory (every file below it) or a glob; the
// files are read in sorted order and their documents numbered as one sequence.
//
// Bad input (a malformed line, invalid UTF-8, ...) goes to a BadInputLog
// (data/bad_input.h): an error in strict mode, a skip and a count in lenient mode.
#pragma once

#include "data/bad_input.h"
#include "data/data_format.h"
#include "config/config.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kiln {

struct Document {
  uint64_t id = 0;   // index among the documents of the source: 0, 1, 2, ...
  std::string text;  // exactly as in the file (for text files: between separators)
};

class DocumentSource {
 public:
  virtual ~DocumentSource() = default;
  // The next document into `doc` (reusing its buffer); false at the end. Throws
  // kiln::Error("[data] ...") naming the file (and line) on I/O errors and, in strict
  // mode, on bad input.
  virtual bool next(Document& doc) = 0;
  // The file or location, for messages.
  virtual const std::string& path() const = 0;

  // Every remaining document; throws "[data] 'PATH' contains no documents" when there
  // are none (also when all were skipped as bad input).
  std::vector<Document> read_all();
};

// The documents of several text/JSONL/Parquet/Arrow files in order, numbered as one
// sequence. Each file is read as data.format, or by its own extension for "auto".
class FileListSource final : public DocumentSource {
 public:
  FileListSource(std::string origin, std::vector<std::string> files, const DataConfig& config, BadInputLog& log);
  ~FileListSource() override;
  bool next(Document& doc) override;
  const std::string& path() const override { return origin_; }
  const std::vector<std::string>& files() const { return files_; }

 private:
  std::string origin_;
  std::vector<std::string> files_;
  DataConfig config_;
  BadInputLog& log_;
  size_t next_file_ = 0;
  std::unique_ptr<DocumentSource> current_;
  uint64_t next_id_ = 0;
};

// One file's documents, read as `format` (a document format: text, jsonl, parquet,
// arrow); throws for a pre-tokenized one. `log` must outlive the source.
std::unique_ptr<DocumentSource> open_document_file(const std::string& file, DataFormat format,
                                                   const DataConfig& config, BadInputLog& log);

// The format data.format selects for data.path ("text", "jsonl", "shards", "llmc",
// "raw_u16", "raw_u32"); see data/data_format.h. Throws naming data.format for an
// unknown format.
std::string resolve_format(const DataConfig& config);
// A streaming source over data.path (a file, directory or glob of document files);
// throws for a pre-tokenized format. `log` must outlive the source.
std::unique_ptr<DocumentSource> make_document_source(const DataConfig& config, BadInputLog& log);
// Every document of data.path, with bad input handled per data.lenient.
std::vector<Document> read_documents(const DataConfig& config, BadInputLog& log);
std::vector<Document> read_documents(const DataConfig& config);

// The whole file as bytes (decompressed when .zst/.gz); throws "[data] cannot open 'PATH'".
std::string read_file_bytes(const std::string& path);

}  // namespace kiln
