#include "data/readers/pieces.h"

#include "core/error.h"

#include <algorithm>

namespace kiln {

namespace {
constexpr size_t kReadChunk = size_t{1} << 20;

int64_t count_newlines(std::string_view s) { return static_cast<int64_t>(std::count(s.begin(), s.end(), '\n')); }
}  // namespace

PieceReader::PieceReader(std::string path, std::string separator, BadInputLog& log)
    : path_(std::move(path)), separator_(std::move(separator)), log_(log) {
  KILN_CHECK(!separator_.empty(), "data.doc_separator", "must not be empty");
  stream_ = open_byte_stream(path_);
}

bool PieceReader::fill() {
  if (eof_) return false;
  // Drop consumed bytes before growing, so the buffer stays near one piece + one chunk.
  if (head_ > 0 && head_ >= buf_.size() / 2) {
    buf_.erase(0, head_);
    head_ = 0;
  }
  const size_t old = buf_.size();
  buf_.resize(old + kReadChunk);
  size_t got = 0;
  try {
    got = stream_->read(buf_.data() + old, kReadChunk);
  } catch (const CorruptStream& e) {
    buf_.resize(old);
    eof_ = true;
    corrupt_ = true;
    log_.report(BadInput::truncated, path_, e.what());  // throws in strict mode
    return false;
  }
  buf_.resize(old + got);
  if (got == 0) eof_ = true;
  return got > 0;
}

bool PieceReader::next(std::string_view& piece, int64_t& line) {
  if (done_) return false;
  size_t search_from = head_;
  for (;;) {
    const size_t at = buf_.find(separator_, search_from);
    if (at != std::string::npos) {
      piece = std::string_view(buf_).substr(head_, at - head_);
      line = line_;
      line_ += count_newlines(piece) + count_newlines(separator_);
      head_ = at + separator_.size();
      return true;
    }
    // Resume the search where a separator could still start, relative to head_.
    const size_t scanned = buf_.size() - head_;
    const size_t keep = std::min(scanned, separator_.size() - 1);
    const size_t resume = scanned - keep;
    if (!fill()) break;
    search_from = head_ + resume;
  }
  done_ = true;
  if (corrupt_) return false;  // the tail of a cut stream is not a whole piece
  piece = std::string_view(buf_).substr(head_);
  line = line_;
  return true;
}

}  // namespace kiln
