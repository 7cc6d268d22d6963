#include "data/readers/arrow_stream.h"

#include "core/error.h"

#include <arrow/io/file.h>
#include <arrow/ipc/reader.h>
#include <arrow/record_batch.h>

#include <cstring>

namespace kiln {

namespace {
// An IPC file (not a stream) starts with this magic, padded to 8 bytes.
constexpr char kFileMagic[] = "ARROW1";
}  // namespace

// Stream: batches in order until the end-of-stream marker. File: a footer indexes them.
class ArrowStreamFileSource::Batches {
 public:
  explicit Batches(const std::string& path) {
    auto file = arrow::io::ReadableFile::Open(path);
    if (!file.ok()) fail("data", "cannot open '{}': {}", path, file.status().message());
    char magic[sizeof(kFileMagic) - 1] = {};
    auto read = (*file)->ReadAt(0, sizeof(magic), magic);
    if (read.ok() && *read == static_cast<int64_t>(sizeof(magic)) && std::memcmp(magic, kFileMagic, sizeof(magic)) == 0) {
      auto reader = arrow::ipc::RecordBatchFileReader::Open(*file);
      check_arrow(reader.status(), path, "not a readable Arrow IPC file");
      file_reader_ = *reader;
      schema_ = file_reader_->schema();
    } else {
      // ReadAt leaves the position undefined; a stream is read from its position.
      check_arrow((*file)->Seek(0), path, "cannot seek");
      auto reader = arrow::ipc::RecordBatchStreamReader::Open(*file);
      check_arrow(reader.status(), path, "not a readable Arrow IPC stream");
      stream_reader_ = *reader;
      schema_ = stream_reader_->schema();
    }
  }

  const arrow::Schema& schema() const { return *schema_; }

  // The next batch, null at the end.
  arrow::Result<std::shared_ptr<arrow::RecordBatch>> next() {
    if (stream_reader_ != nullptr) {
      std::shared_ptr<arrow::RecordBatch> batch;
      ARROW_RETURN_NOT_OK(stream_reader_->ReadNext(&batch));
      return batch;
    }
    if (next_batch_ == file_reader_->num_record_batches()) return std::shared_ptr<arrow::RecordBatch>();
    return file_reader_->ReadRecordBatch(next_batch_++);
  }

 private:
  std::shared_ptr<arrow::Schema> schema_;
  std::shared_ptr<arrow::ipc::RecordBatchStreamReader> stream_reader_;
  std::shared_ptr<arrow::ipc::RecordBatchFileReader> file_reader_;
  int next_batch_ = 0;
};

ArrowStreamFileSource::ArrowStreamFileSource(std::string path, const std::string& text_key, BadInputLog& log)
    : path_(std::move(path)), log_(log), batches_(std::make_unique<Batches>(path_)), rows_(path_, text_key, log) {
  column_ = text_column_index(batches_->schema(), text_key, path_);
}

ArrowStreamFileSource::~ArrowStreamFileSource() = default;

bool ArrowStreamFileSource::next(Document& doc) {
  while (batches_ != nullptr) {
    if (rows_.next(doc)) {
      doc.id = next_id_++;
      return true;
    }
    auto batch = batches_->next();
    if (!batch.ok()) {
      log_.report(BadInput::truncated, path_, fmt::format("cannot read a record batch: {}", batch.status().message()));
      batches_.reset();  // lenient: the rest of the file goes too
    } else if (*batch == nullptr) {
      batches_.reset();
    } else {
      rows_.start((*batch)->column(column_));
    }
  }
  return false;
}

}  // namespace kiln
