#include "data/readers/parquet.h"

#include "core/error.h"

#include <arrow/chunked_array.h>
#include <arrow/io/file.h>
#include <arrow/memory_pool.h>
#include <arrow/table.h>
#include <parquet/arrow/reader.h>
#include <parquet/arrow/schema.h>
#include <parquet/exception.h>

namespace kiln {

ParquetFileSource::ParquetFileSource(std::string path, const std::string& text_key, BadInputLog& log)
    : path_(std::move(path)), log_(log), rows_(path_, text_key, log) {
  auto file = arrow::io::ReadableFile::Open(path_);
  if (!file.ok()) fail("data", "cannot open '{}': {}", path_, file.status().message());
  // Parquet's own checks throw parquet::ParquetException from inside OpenFile.
  try {
    auto reader = parquet::arrow::OpenFile(*file, arrow::default_memory_pool());
    check_arrow(reader.status(), path_, "not a readable Parquet file");
    reader_ = std::move(*reader);
  } catch (const parquet::ParquetException& e) {
    fail("data", "{}: not a readable Parquet file: {}", path_, e.what());
  }
  std::shared_ptr<arrow::Schema> schema;
  check_arrow(reader_->GetSchema(&schema), path_, "cannot read the schema");
  const int field = text_column_index(*schema, text_key, path_);
  leaf_column_ = reader_->manifest().schema_fields[static_cast<size_t>(field)].column_index;
}

ParquetFileSource::~ParquetFileSource() = default;

bool ParquetFileSource::read_row_group() {
  while (next_row_group_ < reader_->num_row_groups()) {
    const int group = next_row_group_++;
    arrow::Result<std::shared_ptr<arrow::Table>> table;
    try {
      table = reader_->ReadRowGroup(group, {leaf_column_});
    } catch (const parquet::ParquetException& e) {
      table = arrow::Status::IOError(e.what());
    }
    if (!table.ok()) {
      log_.report(BadInput::truncated, path_,
                  fmt::format("cannot read row group {}: {}", group, table.status().message()));
      next_row_group_ = reader_->num_row_groups();  // lenient: the rest of the file goes too
      return false;
    }
    column_ = (*table)->column(0);
    next_chunk_ = 0;
    return true;
  }
  return false;
}

bool ParquetFileSource::next(Document& doc) {
  for (;;) {
    if (rows_.next(doc)) {
      doc.id = next_id_++;
      return true;
    }
    if (column_ != nullptr && next_chunk_ < column_->num_chunks()) {
      rows_.start(column_->chunk(next_chunk_++));
    } else if (!read_row_group()) {
      return false;
    }
  }
}

}  // namespace kiln
