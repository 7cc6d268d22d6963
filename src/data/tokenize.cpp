#include "data/tokenize.h"

#include "core/error.h"
#include "data/dataset.h"
#include "data/document_reader.h"
#include "data/shards/kiln_shard.h"
#include "data/shards/shard_tokenizer.h"

#include <fmt/format.h>
#include <omp.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <filesystem>
#include <mutex>
#include <optional>
#include <thread>

namespace kiln {

namespace fs = std::filesystem;

namespace {

// Documents read ahead by a background thread, at most `capacity` chunks.
class ChunkReader {
 public:
  ChunkReader(DocumentSource& source, int64_t chunk_bytes, size_t capacity)
      : source_(source), chunk_bytes_(chunk_bytes), capacity_(capacity), thread_([this] { run(); }) {}
  ~ChunkReader() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }

  // The next chunk; empty at the end. Rethrows the reader's error.
  std::vector<Document> next() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return !chunks_.empty() || done_; });
    if (chunks_.empty()) {
      if (error_) std::rethrow_exception(error_);
      return {};
    }
    std::vector<Document> chunk = std::move(chunks_.front());
    chunks_.pop_front();
    lock.unlock();
    changed_.notify_all();
    return chunk;
  }

 private:
  void run() {
    try {
      for (;;) {
        std::vector<Document> chunk;
        int64_t bytes = 0;
        Document doc;
        while (bytes < chunk_bytes_ && source_.next(doc)) {
          bytes += static_cast<int64_t>(doc.text.size());
          chunk.push_back(std::move(doc));
        }
        std::unique_lock lock(mutex_);
        if (chunk.empty()) break;
        changed_.wait(lock, [&] { return stop_ || chunks_.size() < capacity_; });
        if (stop_) break;
        chunks_.push_back(std::move(chunk));
        lock.unlock();
        changed_.notify_all();
      }
    } catch (...) {
      const std::lock_guard lock(mutex_);
      error_ = std::current_exception();
    }
    {
      const std::lock_guard lock(mutex_);
      done_ = true;
    }
    changed_.notify_all();
  }

  DocumentSource& source_;
  int64_t chunk_bytes_;
  size_t capacity_;
  std::deque<std::vector<Document>> chunks_;
  bool stop_ = false;
  bool done_ = false;
  std::exception_ptr error_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::thread thread_;  // last: starts once the members above exist
};

// The shards of one split, rolled over at shard_tokens.
class SplitWriter {
 public:
  SplitWriter(std::string dir, std::string prefix, ManifestSplit& split, const Manifest& manifest, int64_t shard_tokens)
      : dir_(std::move(dir)), prefix_(std::move(prefix)), split_(split), manifest_(manifest), shard_tokens_(shard_tokens) {}

  void add(const std::vector<int32_t>& tokens) {
    if (writer_ == nullptr) {
      const std::string name = fmt::format("{}_{:06d}.kiln", prefix_, split_.shards.size());
      writer_ = std::make_unique<ShardWriter>((fs::path(dir_) / name).string(), manifest_.token_bytes,
                                              manifest_.vocab_size, manifest_.tokenizer_hash);
    }
    writer_->add_document(tokens);
    split_.documents += 1;
    split_.tokens += tokens.size();
    if (static_cast<int64_t>(writer_->tokens()) >= shard_tokens_) close();
  }
  void close() {
    if (writer_ == nullptr) return;
    split_.shards.push_back(writer_->finish());
    writer_.reset();
  }

 private:
  std::string dir_;
  std::string prefix_;
  ManifestSplit& split_;
  const Manifest& manifest_;
  int64_t shard_tokens_;
  std::unique_ptr<ShardWriter> writer_;
};

void prepare_out_dir(const std::string& dir) {
  KILN_CHECK(!dir.empty(), "tokenize", "no output directory (--out)");
  std::error_code ec;
  fs::create_directories(dir, ec);
  KILN_CHECK(!ec && fs::is_directory(dir, ec), "tokenize", "cannot create '{}'", dir);
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    KILN_CHECK(name != kManifestName && entry.path().extension() != ".kiln", "tokenize",
               "'{}' already holds shards ({}); remove them or choose another output directory", dir, name);
  }
}

}  // namespace

TokenizeReport tokenize_to_shards(const TokenizeOptions& options, const Tokenizer& tokenizer,
                                  const std::function<void(const TokenizeReport&)>& progress) {
  const auto start = std::chrono::steady_clock::now();
  const DataConfig& data = options.data;
  KILN_CHECK(data.val_fraction >= 0.0 && data.val_fraction < 1.0, "data.val_fraction", "must be in [0, 1), got {}",
             data.val_fraction);
  KILN_CHECK(options.shard_tokens > 0, "tokenize", "--shard-tokens must be positive, got {}", options.shard_tokens);
  KILN_CHECK(options.chunk_bytes > 0, "tokenize", "chunk size must be positive, got {}", options.chunk_bytes);
  BadInputLog log(data.lenient);
  const std::unique_ptr<DocumentSource> source = make_document_source(data, log);  // checks the input first
  prepare_out_dir(options.out_dir);

  TokenizeReport report;
  Manifest& m = report.manifest;
  m.tokenizer_name = tokenizer.name();
  m.vocab_size = static_cast<uint64_t>(tokenizer.vocab_size());
  m.tokenizer_hash = tokenizer_fingerprint(tokenizer);
  m.bos_id = tokenizer.bos_id();
  m.eos_id = tokenizer.eos_id();
  m.pad_id = tokenizer.pad_id();
  m.token_bytes = shard_token_bytes(tokenizer.vocab_size());
  m.source = {{"path", data.path}, {"format", data.format}, {"text_key", data.text_key},
              {"doc_separator", data.doc_separator}, {"val_fraction", data.val_fraction}, {"lenient", data.lenient}};
  SplitWriter train(options.out_dir, "train", m.train, m, options.shard_tokens);
  SplitWriter validation(options.out_dir, "val", m.validation, m, options.shard_tokens);

  const int threads = options.threads > 0 ? static_cast<int>(options.threads) : omp_get_max_threads();
  ChunkReader reader(*source, options.chunk_bytes, 2);
  std::vector<std::vector<int32_t>> tokens;
  std::vector<char> to_validation;
  for (std::vector<Document> chunk = reader.next(); !chunk.empty(); chunk = reader.next()) {
    const auto n = static_cast<int64_t>(chunk.size());
    tokens.assign(chunk.size(), {});
    to_validation.assign(chunk.size(), 0);
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) {
      const Document& doc = chunk[static_cast<size_t>(i)];
      tokens[static_cast<size_t>(i)] = tokenizer.encode(doc.text);
      to_validation[static_cast<size_t>(i)] = is_validation_document(doc.text, data.val_fraction);
    }
    for (size_t i = 0; i < chunk.size(); ++i) {
      (to_validation[i] ? validation : train).add(tokens[i]);
      report.input_bytes += chunk[i].text.size();
    }
    report.input_documents += chunk.size();
    if (progress) {
      report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      progress(report);
    }
  }
  train.close();
  validation.close();
  if (report.input_documents == 0) fail("data", "'{}' contains no documents", data.path);

  m.skipped = log.counts();
  m.fingerprint = m.compute_fingerprint();
  store_shard_tokenizer(data.tokenizer, tokenizer, options.out_dir, m);  // the shards carry their tokenizer
  write_manifest((fs::path(options.out_dir) / kManifestName).string(), m);
  report.skipped_summary = log.summary();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace kiln
