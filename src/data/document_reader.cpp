#include "data/document_reader.h"

#include "core/error.h"
#include "data/data_format.h"
#include "data/readers/compressed.h"
#include "data/readers/arrow_stream.h"
#include "data/readers/glob.h"
#include "data/readers/jsonl.h"
#include "data/readers/parquet.h"
#include "data/readers/text.h"

namespace kiln {

std::vector<Document> DocumentSource::read_all() {
  std::vector<Document> docs;
  Document doc;
  while (next(doc)) docs.push_back(std::move(doc));
  if (docs.empty()) fail("data", "'{}' contains no documents", path());
  return docs;
}

FileListSource::FileListSource(std::string origin, std::vector<std::string> files, const DataConfig& config,
                               BadInputLog& log)
    : origin_(std::move(origin)), files_(std::move(files)), config_(config), log_(log) {
  KILN_CHECK(!config_.doc_separator.empty(), "data.doc_separator", "must not be empty");
}

FileListSource::~FileListSource() = default;

bool FileListSource::next(Document& doc) {
  for (;;) {
    if (current_ == nullptr) {
      if (next_file_ == files_.size()) return false;
      const std::string& file = files_[next_file_++];
      const DataFormat format = config_.format == "auto" ? format_of_file(file) : resolve_data_format(file, config_.format);
      current_ = open_document_file(file, format, config_, log_);
    }
    if (current_->next(doc)) {
      doc.id = next_id_++;
      return true;
    }
    current_.reset();
  }
}

std::unique_ptr<DocumentSource> open_document_file(const std::string& file, DataFormat format,
                                                   const DataConfig& config, BadInputLog& log) {
  switch (format) {
    case DataFormat::jsonl: return std::make_unique<JsonlFileSource>(file, config.text_key, log);
    case DataFormat::parquet: return std::make_unique<ParquetFileSource>(file, config.text_key, log);
    case DataFormat::arrow: return std::make_unique<ArrowStreamFileSource>(file, config.text_key, log);
    case DataFormat::text: return std::make_unique<TextFileSource>(file, config.doc_separator, log);
    default: fail("data", "'{}' holds pre-tokenized data (format {}), not documents", file, format_name(format));
  }
}

std::string resolve_format(const DataConfig& config) { return std::string(format_name(resolve_data_format(config))); }

std::unique_ptr<DocumentSource> make_document_source(const DataConfig& config, BadInputLog& log) {
  const DataFormat format = resolve_data_format(config);
  if (is_token_format(format))
    fail("data", "'{}' holds pre-tokenized data (format {}), not documents", config.path, format_name(format));
  return std::make_unique<FileListSource>(config.path, expand_data_path(config.path), config, log);
}

std::vector<Document> read_documents(const DataConfig& config, BadInputLog& log) {
  return make_document_source(config, log)->read_all();
}

std::vector<Document> read_documents(const DataConfig& config) {
  BadInputLog log(config.lenient);
  return read_documents(config, log);
}

std::string read_file_bytes(const std::string& path) { return read_all_bytes(path); }

}  // namespace kiln
