// Parquet files (.parquet): the string column data.text_key is the document, one per row.
#pragma once

#include "data/document_reader.h"
#include "data/readers/arrow_text_column.h"

#include <memory>
#include <string>

namespace parquet::arrow {
class FileReader;
}

namespace kiln {

// Reads one row group at a time, only the text column: memory is a row group's text, not
// the file's. The file's schema is checked on open (text_column_index: a missing or
// non-string column is an error naming the file and its columns); rows are bad input as
// TextColumnRows says; an unreadable row group is BadInput::truncated (lenient: the rest
// of the file is skipped).
class ParquetFileSource final : public DocumentSource {
 public:
  ParquetFileSource(std::string path, const std::string& text_key, BadInputLog& log);
  ~ParquetFileSource() override;
  bool next(Document& doc) override;
  const std::string& path() const override { return path_; }

 private:
  // Reads row group next_row_group_ into rows_; false when none is left.
  bool read_row_group();

  std::string path_;
  BadInputLog& log_;
  std::unique_ptr<parquet::arrow::FileReader> reader_;
  int leaf_column_ = 0;  // the text column's index among the file's leaf columns
  int next_row_group_ = 0;
  std::shared_ptr<arrow::ChunkedArray> column_;  // the current row group's text
  int next_chunk_ = 0;
  TextColumnRows rows_;
  uint64_t next_id_ = 0;
};

}  // namespace kiln
