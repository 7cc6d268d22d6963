#include "data/shards/manifest.h"

#include "core/checksum.h"
#include "core/error.h"
#include "core/printable.h"
#include "core/json_field.h"
#include "data/readers/compressed.h"

#include <charconv>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <fstream>

namespace kiln {

namespace {

uint64_t parse_hex(const JsonField& field) {
  const std::string& text = field.string();
  uint64_t v = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v, 16);
  if (text.size() != 16 || ec != std::errc() || ptr != text.data() + text.size())
    field.fail(fmt::format("'{}' is not a 16-digit hex hash", printable(text)));
  return v;
}

nlohmann::json split_json(const ManifestSplit& s) {
  nlohmann::json shards = nlohmann::json::array();
  for (const ShardInfo& i : s.shards)
    shards.push_back({{"file", i.file}, {"documents", i.documents}, {"tokens", i.tokens}, {"hash", hex64(i.hash)}});
  return {{"documents", s.documents}, {"tokens", s.tokens}, {"shards", shards}};
}

// a + b, or an error: totals that wrap around 2^64 could be made to match any split.
uint64_t checked_sum(uint64_t a, uint64_t b, const JsonField& field) {
  uint64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) field.fail("makes the split's total overflow 64 bits");
  return sum;
}

ManifestSplit split_from(const JsonField& j, const std::string& where) {
  ManifestSplit s;
  s.documents = j.member("documents").unsigned_integer();
  s.tokens = j.member("tokens").unsigned_integer();
  uint64_t documents = 0, tokens = 0;
  const JsonField shards = j.member("shards");
  for (size_t k = 0; k < shards.array_size(); ++k) {
    const JsonField e = shards.element(k);
    ShardInfo i;
    const JsonField file = e.member("file");
    i.file = file.string();
    i.documents = e.member("documents").unsigned_integer();
    i.tokens = e.member("tokens").unsigned_integer();
    i.hash = parse_hex(e.member("hash"));
    if (i.file.empty() || i.file.find('/') != std::string::npos || i.file.find('\0') != std::string::npos ||
        i.file.front() == '.')
      fail("data", "{}: shard file name '{}' must be a plain name in the manifest's directory", where, printable(i.file));
    documents = checked_sum(documents, i.documents, e.member("documents"));
    tokens = checked_sum(tokens, i.tokens, e.member("tokens"));
    s.shards.push_back(std::move(i));
  }
  if (documents != s.documents || tokens != s.tokens)
    fail("data", "{}: manifest mismatch: its shards hold {} documents / {} tokens, the split says {} / {}", where,
         documents, tokens, s.documents, s.tokens);
  return s;
}

}  // namespace

uint64_t Manifest::compute_fingerprint() const {
  Xxh64 h(0x6b696c6e /* "kiln" */);
  h.update(&tokenizer_hash, sizeof(tokenizer_hash));
  for (const ManifestSplit* s : {&train, &validation}) {
    const uint64_t n = s->shards.size();
    h.update(&n, sizeof(n));
    for (const ShardInfo& i : s->shards) {
      h.update(&i.hash, sizeof(i.hash));
      h.update(&i.documents, sizeof(i.documents));
      h.update(&i.tokens, sizeof(i.tokens));
    }
  }
  return h.digest();
}

void write_manifest(const std::string& path, const Manifest& m) {
  nlohmann::json skipped = nlohmann::json::object();
  for (int r = 0; r < kBadInputReasons; ++r)
    skipped[std::string(bad_input_key(static_cast<BadInput>(r)))] = m.skipped[static_cast<BadInput>(r)];
  nlohmann::json tokenizer = {{"name", m.tokenizer_name}, {"vocab_size", m.vocab_size},
                               {"hash", hex64(m.tokenizer_hash)}, {"bos_id", m.bos_id},
                               {"eos_id", m.eos_id}, {"pad_id", m.pad_id}};
  if (!m.tokenizer_file.empty()) {
    tokenizer["file"] = m.tokenizer_file;
    tokenizer["file_hash"] = hex64(m.tokenizer_file_hash);
  }
  const nlohmann::json j = {
      {"format", "kiln-shards"},
      {"version", kManifestVersion},
      {"tokenizer", tokenizer},
      {"token_bytes", m.token_bytes},
      {"source", m.source},
      {"splits", {{"train", split_json(m.train)}, {"validation", split_json(m.validation)}}},
      {"skipped", skipped},
      {"fingerprint", hex64(m.fingerprint)},
  };
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail("data", "cannot write '{}'", tmp);
    out << j.dump(2) << '\n';
    out.close();  // flushes and closes: every error surfaces here
    if (!out) fail("data", "cannot write '{}'", tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) fail("data", "cannot rename '{}' to '{}': {}", tmp, path, ec.message());
}

Manifest read_manifest(const std::string& path) {
  const std::string text = read_all_bytes(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("data", "{}: malformed manifest JSON ({})", path, e.what());
  }
  Manifest m;
  const JsonField root(j, "data", path);
  if (root.member("format").string() != "kiln-shards") fail("data", "{}: not a kiln shard manifest", path);
  const uint64_t version = root.member("version").unsigned_integer();
  if (version != kManifestVersion)
    fail("data", "{}: manifest version {} is not supported (this kiln reads {})", path, version, kManifestVersion);
  const JsonField t = root.member("tokenizer");
  m.tokenizer_name = t.member("name").string();
  m.vocab_size = t.member("vocab_size").unsigned_integer(INT32_MAX);
  m.tokenizer_hash = parse_hex(t.member("hash"));
  m.bos_id = t.member("bos_id").integer(-1, INT32_MAX);
  m.eos_id = t.member("eos_id").integer(-1, INT32_MAX);
  m.pad_id = t.member("pad_id").integer(-1, INT32_MAX);
  if (const auto file = t.find("file")) {  // optional: shards made before it carry no tokenizer file
    m.tokenizer_file = file->string();
    if (m.tokenizer_file.empty() || m.tokenizer_file.find('/') != std::string::npos ||
        m.tokenizer_file.find('\0') != std::string::npos || m.tokenizer_file.front() == '.')
      fail("data", "{}: tokenizer file name '{}' must be a plain name in the manifest's directory", path,
           printable(m.tokenizer_file));
    m.tokenizer_file_hash = parse_hex(t.member("file_hash"));
  }
  const uint64_t token_bytes = root.member("token_bytes").unsigned_integer();
  if (token_bytes != 2 && token_bytes != 4) fail("data", "{}: token_bytes must be 2 or 4, got {}", path, token_bytes);
  m.token_bytes = static_cast<int>(token_bytes);
  if (const auto source = root.find("source")) m.source = source->value();
  const JsonField splits = root.member("splits");
  m.train = split_from(splits.member("train"), path);
  m.validation = split_from(splits.member("validation"), path);
  if (const auto skipped = root.find("skipped")) {
    for (int r = 0; r < kBadInputReasons; ++r) {
      const std::string key(bad_input_key(static_cast<BadInput>(r)));
      if (const auto count = skipped->find(key)) m.skipped.counts[static_cast<size_t>(r)] = count->integer(0, INT64_MAX);
    }
  }
  m.fingerprint = parse_hex(root.member("fingerprint"));
  const uint64_t computed = m.compute_fingerprint();
  if (computed != m.fingerprint)
    fail("data", "{}: manifest mismatch: fingerprint {} does not match its shards and tokenizer ({})", path,
         hex64(m.fingerprint), hex64(computed));
  return m;
}

uint64_t tokenizer_fingerprint(const Tokenizer& tokenizer) {
  Xxh64 h(0x746f6b /* "tok" */);
  auto add_u64 = [&](uint64_t v) { h.update(&v, sizeof(v)); };
  auto add_bytes = [&](const std::string& s) {
    add_u64(s.size());
    h.update(s.data(), s.size());
  };
  add_bytes(tokenizer.name());
  add_u64(static_cast<uint64_t>(tokenizer.vocab_size()));
  add_u64(static_cast<uint64_t>(tokenizer.bos_id()));
  add_u64(static_cast<uint64_t>(tokenizer.eos_id()));
  add_u64(static_cast<uint64_t>(tokenizer.pad_id()));
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    try {
      add_bytes(tokenizer.decode(std::span<const int32_t>(&id, 1)));
    } catch (const std::exception&) {
      add_u64(~uint64_t{0});  // ids a tokenizer refuses to decode alone still count
    }
  }
  const std::string probe = "Hello, world! 1234 \xC3\xA9t\xC3\xA9  \t\n the quick brown fox jumps over the lazy dog.";
  for (const int32_t id : tokenizer.encode(probe)) add_u64(static_cast<uint64_t>(static_cast<uint32_t>(id)));
  return h.digest();
}

}  // namespace kiln
