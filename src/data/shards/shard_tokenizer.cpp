#include "data/shards/shard_tokenizer.h"

#include "core/checksum.h"
#include "core/error.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <vector>

namespace kiln {

namespace fs = std::filesystem;

namespace {

// The tokenizer.json a data.tokenizer setting names; empty for one that needs no file.
fs::path tokenizer_json_of(const std::string& setting) {
  const std::vector<std::string> names = tokenizer_names();
  if (setting != "bpe" && setting != "hf" && std::find(names.begin(), names.end(), setting) != names.end()) return {};
  fs::path path(setting);
  if (fs::is_directory(path)) path /= kShardTokenizerFile;
  return path;
}

// One shard set a run reads, and the data.tokenizer setting that loads its tokenizer
// ("" where the manifest cannot say: a BPE tokenizer in shards made before the file).
struct ShardSet {
  std::string origin;  // "data.path" or "data.sources[1] ('web')"
  std::string manifest_path;
  Manifest manifest;
  std::string setting;
};

// The manifest of `path` when it names kiln shards (as data.format auto or shards reads them).
std::optional<std::string> manifest_of(const std::string& path, const std::string& format) {
  if (path.empty() || (format != "auto" && format != "shards")) return std::nullopt;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path m = fs::path(path) / kManifestName;
    if (fs::is_regular_file(m, ec)) return m.string();
    return std::nullopt;
  }
  if (fs::path(path).filename() == kManifestName && fs::is_regular_file(path, ec)) return path;
  return std::nullopt;
}

std::string describe(const Manifest& m) {
  return fmt::format("'{}', vocab {}, hash {}", m.tokenizer_name, m.vocab_size, hex64(m.tokenizer_hash));
}

ShardSet open_set(std::string origin, const std::string& manifest_path) {
  ShardSet set{std::move(origin), manifest_path, read_manifest(manifest_path), ""};
  const Manifest& m = set.manifest;
  if (!m.tokenizer_file.empty()) {
    const std::string file = (fs::path(manifest_path).parent_path() / m.tokenizer_file).string();
    const uint64_t hash = xxh64_file(file).hash;
    KILN_CHECK(hash == m.tokenizer_file_hash, "data", "{}: content hash {} is not the {} that {} records for it",
               file, hex64(hash), hex64(m.tokenizer_file_hash), manifest_path);
    set.setting = file;
  } else if (tokenizer_json_of(m.tokenizer_name).empty()) {
    set.setting = m.tokenizer_name;  // "byte": its name is all it takes
  }
  return set;
}

std::vector<ShardSet> shard_sets(const DataConfig& data) {
  std::vector<ShardSet> sets;
  if (data.sources.empty()) {
    if (const auto m = manifest_of(data.path, data.format)) sets.push_back(open_set("data.path", *m));
    return sets;
  }
  for (size_t i = 0; i < data.sources.size(); ++i) {
    const DataSource& s = data.sources[i];
    const auto m = manifest_of(s.path, data.format);
    if (!m) continue;
    const std::string name = s.name.empty() ? fs::path(s.path).filename().string() : s.name;
    sets.push_back(open_set(fmt::format("data.sources[{}] ('{}')", i, name), *m));
  }
  return sets;
}

}  // namespace

void store_shard_tokenizer(const std::string& setting, const Tokenizer& tokenizer, const std::string& dir,
                           Manifest& manifest) {
  const fs::path json = tokenizer_json_of(setting);
  if (json.empty()) return;
  const fs::path target = fs::path(dir) / kShardTokenizerFile;
  std::error_code ec;
  fs::copy_file(json, target, fs::copy_options::overwrite_existing, ec);
  KILN_CHECK(!ec, "tokenize", "cannot copy the tokenizer '{}' to '{}': {}", json.string(), target.string(),
             ec.message());
  // The special ids come from tokenizer_config.json beside the file: they travel with it.
  for (const char* f : {"tokenizer_config.json", "special_tokens_map.json"}) {
    const fs::path source = json.parent_path() / f;
    if (!fs::exists(source)) continue;
    fs::copy_file(source, fs::path(dir) / f, fs::copy_options::overwrite_existing, ec);
    KILN_CHECK(!ec, "tokenize", "cannot copy '{}' to '{}': {}", source.string(), dir, ec.message());
  }
  const uint64_t want = tokenizer_fingerprint(tokenizer);
  const uint64_t copy = tokenizer_fingerprint(*tokenizer_from_config(target.string()));
  KILN_CHECK(copy == want, "tokenize", "the tokenizer copied to '{}' encodes unlike '{}' (hash {} vs {})",
             target.string(), setting, hex64(copy), hex64(want));
  manifest.tokenizer_file = kShardTokenizerFile;
  manifest.tokenizer_file_hash = xxh64_file(target.string()).hash;
}

void adopt_shard_tokenizer(Config& config) {
  const std::vector<ShardSet> sets = shard_sets(config.data);
  if (sets.empty()) return;
  const ShardSet& first = sets.front();
  for (const ShardSet& other : sets)
    KILN_CHECK(other.manifest.tokenizer_hash == first.manifest.tokenizer_hash, "data.sources",
               "{} ({}: {}) and {} ({}: {}) were tokenized with different tokenizers; a mixture trains with one, so "
               "tokenize them with the same", first.origin, first.manifest_path, describe(first.manifest),
               other.origin, other.manifest_path, describe(other.manifest));
  const Manifest& m = first.manifest;
  if (!config.was_chosen("data.tokenizer")) {
    if (!first.setting.empty()) config.data.tokenizer = first.setting;
  } else {
    const std::string& chosen = config.data.tokenizer;
    const uint64_t hash = tokenizer_fingerprint(*tokenizer_from_config(chosen));
    KILN_CHECK(hash == m.tokenizer_hash, "data.tokenizer",
               "'{}' (hash {}) is not the tokenizer of the shards in {} ({}); leave data.tokenizer unset to train "
               "with theirs", chosen, hex64(hash), first.manifest_path, describe(m));
  }
  if (!config.was_chosen("model.vocab_size")) {
    config.model.vocab_size = static_cast<int64_t>(m.vocab_size);
  } else {
    KILN_CHECK(config.model.vocab_size >= static_cast<int64_t>(m.vocab_size), "model.vocab_size",
               "{} is smaller than the vocabulary of the shards' tokenizer in {} ({}); leave model.vocab_size unset "
               "to take theirs", config.model.vocab_size, first.manifest_path, m.vocab_size);
  }
}

}  // namespace kiln
