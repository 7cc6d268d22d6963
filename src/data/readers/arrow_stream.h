// Arrow IPC files (.arrow): the string column data.text_key is the document, one per row.
// Hugging Face `datasets` writes its `save_to_disk` shards (data-00000-of-00002.arrow) as
// IPC streams; the IPC file format (Feather v2, "ARROW1" magic) is read too.
#pragma once

#include "data/document_reader.h"
#include "data/readers/arrow_text_column.h"

#include <memory>
#include <string>

namespace kiln {

// Reads one record batch at a time, so memory is a batch (datasets writes 1000 rows per
// batch by default), not the file. The schema is checked on open as for Parquet
// (text_column_index); rows are bad input as TextColumnRows says; an unreadable batch is
// BadInput::truncated (lenient: the rest of the file is skipped).
class ArrowStreamFileSource final : public DocumentSource {
 public:
  ArrowStreamFileSource(std::string path, const std::string& text_key, BadInputLog& log);
  ~ArrowStreamFileSource() override;
  bool next(Document& doc) override;
  const std::string& path() const override { return path_; }

 private:
  // The IPC format's two framings behind one "next batch" call (arrow_stream.cpp).
  class Batches;

  std::string path_;
  BadInputLog& log_;
  std::unique_ptr<Batches> batches_;
  int column_ = 0;
  TextColumnRows rows_;
  uint64_t next_id_ = 0;
};

}  // namespace kiln
