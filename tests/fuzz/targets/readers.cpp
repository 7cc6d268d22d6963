// Fuzz target: the text and JSONL readers (data.path of text corpora), plain or
// compressed. Byte 0 of the input picks the reader, the compression (the rest is then
// compressed bytes as a file holds them), strict or lenient, and the text separator; the
// rest is the file. Documents that come out are non-empty valid UTF-8, and the streaming
// split equals splitting the whole (decompressed) file at once.
#include "../fuzz_target.h"

#include "data/readers/compressed.h"
#include "data/readers/jsonl.h"
#include "data/readers/pieces.h"
#include "data/readers/text.h"
#include "core/utf8.h"

#include <algorithm>

namespace {

constexpr std::string_view kSeparators[] = {"\n\n", "\n", "<|endoftext|>", "\n\n\n"};
constexpr std::string_view kExtensions[] = {"", ".gz", ".zst"};
constexpr size_t kMaxExpandedBytes = size_t{32} << 20;

// The file split whole, one piece at a time (a decompressed input can hold millions).
class WholeSplit {
 public:
  WholeSplit(std::string_view text, std::string_view separator) : text_(text), separator_(separator) {}
  // The next piece and the line it starts on; false after the last.
  bool next(std::string_view& piece, int64_t& line) {
    if (done_) return false;
    const size_t at = text_.find(separator_, head_);
    piece = text_.substr(head_, at == std::string_view::npos ? std::string_view::npos : at - head_);
    line = line_;
    if (at == std::string_view::npos) {
      done_ = true;
    } else {
      line_ += std::count(piece.begin(), piece.end(), '\n') + std::count(separator_.begin(), separator_.end(), '\n');
      head_ = at + separator_.size();
    }
    return true;
  }

 private:
  std::string_view text_, separator_;
  size_t head_ = 0;
  int64_t line_ = 1;
  bool done_ = false;
};

}  // namespace

KILN_FUZZ_TARGET(readers) {
  using namespace kiln;
  if (input.empty()) return;
  const auto mode = static_cast<uint8_t>(input[0]);
  const bool jsonl = mode & 1, lenient = mode & 2;
  const std::string_view extension = kExtensions[(mode >> 2) % 3];
  const std::string_view separator = jsonl ? "\n" : kSeparators[(mode >> 4) % 4];
  const std::string path =
      fuzz::scratch_file(std::string("corpus") + (jsonl ? ".jsonl" : ".txt") + std::string(extension), input.substr(1));

  // A few KB of zstd can expand to hundreds of MB, and a reader holds one document whole;
  // past 32 MiB the input tests memory, not parsing, so it is skipped.
  size_t expanded = 0;
  fuzz::accepts([&] {
    const auto stream = open_byte_stream(path);
    std::vector<char> chunk(1 << 16);
    try {
      for (size_t got; expanded <= kMaxExpandedBytes && (got = stream->read(chunk.data(), chunk.size())) > 0;)
        expanded += got;
    } catch (const CorruptStream&) {  // bare by design: the readers report it with the file's name
    }
  });
  if (expanded > kMaxExpandedBytes) return;

  BadInputLog log(lenient);
  fuzz::accepts([&] {
    std::unique_ptr<DocumentSource> source;
    if (jsonl) source = std::make_unique<JsonlFileSource>(path, "text", log);
    else source = std::make_unique<TextFileSource>(path, std::string(separator), log);
    Document doc;
    while (source->next(doc)) {
      KILN_FUZZ_CHECK(!doc.text.empty(), "an empty document came out");
      KILN_FUZZ_CHECK(is_valid_utf8(doc.text), "a document that is not valid UTF-8 came out");
    }
  });

  std::string whole;
  if (!fuzz::accepts([&] { whole = read_all_bytes(path); })) return;
  WholeSplit expected(whole, separator);
  BadInputLog strict;
  PieceReader reader(path, std::string(separator), strict);
  std::string_view piece, want;
  int64_t line = 0, want_line = 0;
  while (reader.next(piece, line)) {
    KILN_FUZZ_CHECK(expected.next(want, want_line), "the streaming split has more pieces");
    KILN_FUZZ_CHECK(piece == want, "the streaming split differs from the whole split");
    KILN_FUZZ_CHECK(line == want_line, "the streaming split numbers lines differently");
  }
  KILN_FUZZ_CHECK(!expected.next(want, want_line), "the streaming split has fewer pieces");
}
