#include "data/shards/token_corpus.h"

#include "core/checksum.h"
#include "core/error.h"
#include "data/readers/glob.h"
#include "data/shards/kiln_shard.h"
#include "data/shards/llmc_bin.h"
#include "data/shards/manifest.h"
#include "data/shards/raw_tokens.h"

#include <filesystem>
#include <map>

namespace kiln {

namespace fs = std::filesystem;

namespace {

int32_t resolve_eot(const DataConfig& config, const Tokenizer& tokenizer) {
  KILN_CHECK(config.eot_id >= -1, "data.eot_id", "must be -1 (the tokenizer's BOS) or a token id, got {}", config.eot_id);
  return config.eot_id == -1 ? tokenizer.bos_id() : static_cast<int32_t>(config.eot_id);
}

std::vector<TokenFile> open_delimited(const std::string& path, DataFormat format, const DataConfig& config,
                                      const Tokenizer& tokenizer, BadInputLog& log) {
  const int32_t eot = resolve_eot(config, tokenizer);
  const int64_t vocab = tokenizer.vocab_size();
  const std::vector<std::string> paths = expand_data_path(path);
  return open_token_files(
      paths,
      [&](const std::string& file, BadInputLog& file_log) {
        if (format == DataFormat::llmc) return open_llmc_file(file, eot, vocab, file_log);
        return open_raw_token_file(file, format == DataFormat::raw_u16 ? 2 : 4, eot, vocab, file_log);
      },
      log);
}

struct ShardSet {
  Manifest manifest;
  std::vector<TokenFile> train;
  std::vector<TokenFile> validation;
};

ShardSet open_shards(const std::string& path, const Tokenizer& tokenizer, BadInputLog& log) {
  const std::string dir = shard_directory(path);
  const std::string manifest_path = (fs::path(dir) / kManifestName).string();
  ShardSet set;
  set.manifest = read_manifest(manifest_path);
  const Manifest& m = set.manifest;
  const uint64_t want = tokenizer_fingerprint(tokenizer);
  KILN_CHECK(m.tokenizer_hash == want && m.vocab_size == static_cast<uint64_t>(tokenizer.vocab_size()), "data",
             "{}: shards were made with tokenizer '{}' (vocab {}, hash {}), this run uses '{}' (vocab {}, hash {}); "
             "tokenize again or use the same tokenizer", manifest_path, m.tokenizer_name, m.vocab_size,
             hex64(m.tokenizer_hash), tokenizer.name(), tokenizer.vocab_size(), hex64(want));
  for (auto [split, files] : {std::pair{&m.train, &set.train}, std::pair{&m.validation, &set.validation}}) {
    std::vector<std::string> paths;
    std::map<std::string, const ShardInfo*> info;
    for (const ShardInfo& s : split->shards) {
      paths.push_back((fs::path(dir) / s.file).string());
      info[paths.back()] = &s;
    }
    *files = open_token_files(
        paths,
        [&](const std::string& file, BadInputLog& file_log) {
          return open_kiln_shard(file, *info.at(file), m, tokenizer.vocab_size(), file_log);
        },
        log);
  }
  return set;
}

// Adds every kept document of `files` to `train` or `validation` (nullptr: all to train)
// by the hash of its stored tokens; ids count documents across the files.
void add_documents(const std::vector<TokenFile>& files, TokenizedSplit& train, TokenizedSplit* validation,
                   double val_fraction, uint64_t& next_id) {
  for (const TokenFile& f : files) {
    if (f.skipped) continue;
    const uint32_t train_segment = train.add_segment(f.tokens, f.file);
    const uint32_t val_segment = validation != nullptr ? validation->add_segment(f.tokens, f.file) : 0;
    const auto* bytes = static_cast<const unsigned char*>(f.tokens.data());
    const auto width = static_cast<size_t>(f.tokens.width());
    for (const DocRange& d : f.docs) {
      const bool to_val = validation != nullptr && val_fraction > 0.0 &&
                          is_validation_hash(hash_bytes(bytes + d.begin * width, (d.end - d.begin) * width), val_fraction);
      if (to_val) {
        validation->add_document(val_segment, d.begin, d.end, next_id++);
      } else {
        train.add_document(train_segment, d.begin, d.end, next_id++);
      }
    }
  }
}

uint64_t files_hash(const std::vector<TokenFile>& files, uint64_t seed) {
  Xxh64 h(seed);
  for (const TokenFile& f : files) {
    const uint64_t v[2] = {f.content_hash, f.skipped ? 1u : 0u};
    h.update(v, sizeof(v));
  }
  return h.digest();
}

void finish(TokenizedSplit& split, const std::vector<TokenFile>& files, uint64_t seed) {
  split.set_fingerprint(split.layout_hash(files_hash(files, seed)));
}

}  // namespace

std::string shard_directory(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (!fs::exists(fs::path(path) / kManifestName, ec))
      fail("data", "'{}' has no {} (make shards with `kiln tokenize`)", path, kManifestName);
    return path;
  }
  if (fs::path(path).filename() == kManifestName) return fs::path(path).parent_path().string();
  fail("data", "'{}': kiln shards are read through their manifest; set data.path to the directory holding {}", path,
       kManifestName);
}

TokenSplits load_token_splits(const std::string& path, DataFormat format, const DataConfig& config, double val_fraction,
                              const Tokenizer& tokenizer, BadInputLog& log) {
  TokenSplits out;
  uint64_t next_id = 0;
  if (format == DataFormat::shards) {
    const ShardSet set = open_shards(path, tokenizer, log);
    add_documents(set.train, out.train, nullptr, 0.0, next_id);
    add_documents(set.validation, out.validation, nullptr, 0.0, next_id);
    finish(out.train, set.train, set.manifest.fingerprint);
    finish(out.validation, set.validation, set.manifest.fingerprint ^ 1);
    return out;
  }
  KILN_CHECK(is_token_format(format), "data", "'{}' is not pre-tokenized (format {})", path, format_name(format));
  const std::vector<TokenFile> files = open_delimited(path, format, config, tokenizer, log);
  add_documents(files, out.train, &out.validation, val_fraction, next_id);
  const uint64_t seed = static_cast<uint64_t>(format) * 0x9e3779b97f4a7c15ull + resolve_eot(config, tokenizer);
  finish(out.train, files, seed);
  finish(out.validation, files, seed ^ 1);
  return out;
}

TokenizedSplit load_token_documents(const std::string& path, DataFormat format, const DataConfig& config,
                                    const Tokenizer& tokenizer, BadInputLog& log) {
  TokenizedSplit all;
  uint64_t next_id = 0;
  if (format == DataFormat::shards) {
    ShardSet set = open_shards(path, tokenizer, log);
    std::vector<TokenFile> files = std::move(set.train);
    for (TokenFile& f : set.validation) files.push_back(std::move(f));
    add_documents(files, all, nullptr, 0.0, next_id);
    finish(all, files, set.manifest.fingerprint ^ 2);
    return all;
  }
  return load_token_splits(path, format, config, 0.0, tokenizer, log).train;
}

}  // namespace kiln
