// The text column of Arrow data (a Parquet file, an Arrow IPC stream): the string column
// named data.text_key, found in the schema and walked row by row into documents. Shared
// by the Parquet and Arrow IPC readers, which differ only in how they get the batches.
#pragma once

#include "data/bad_input.h"
#include "data/document_reader.h"

#include <arrow/type_fwd.h>

#include <cstdint>
#include <memory>
#include <string>

namespace kiln {

// The index of `text_key` among the top-level fields of `schema`. Throws one line naming
// the file, the column and the columns there are when there is no such field, or when it
// is not a string (utf8 or large_utf8):
//   [data] a.parquet: no column 'text' (columns: id: int64, content: string); set data.text_key
int text_column_index(const arrow::Schema& schema, const std::string& text_key, const std::string& path);

// Throws "[data] PATH: WHAT: <Arrow's message>" for a failed Arrow status.
void check_arrow(const arrow::Status& status, const std::string& path, const std::string& what);

// The documents of the text column, one chunk (array) at a time, each row numbered across
// the file (0-based, as pyarrow and pandas count them). Bad input, each named "PATH:row N":
// a null (missing_text_key), an empty string (empty_document), invalid UTF-8 (Parquet
// does not check it on read).
class TextColumnRows {
 public:
  TextColumnRows(const std::string& path, std::string text_key, BadInputLog& log);
  ~TextColumnRows();
  // The next chunk of the column (a StringArray or LargeStringArray); its rows follow the
  // previous chunk's.
  void start(std::shared_ptr<arrow::Array> chunk);
  // The next good document of the current chunk into `doc` (id left to the caller); false
  // when the chunk is used up.
  bool next(Document& doc);

 private:
  std::string path_;
  std::string text_key_;
  BadInputLog& log_;
  std::shared_ptr<arrow::Array> chunk_;
  int64_t index_ = 0;      // next row within chunk_
  int64_t first_row_ = 0;  // file row of chunk_'s row 0
};

}  // namespace kiln
