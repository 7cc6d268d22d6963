#include "data/shards/manifest.h"

#include "core/checksum.h"
#include "core/error.h"
#include "data/readers/compressed.h"

#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>

namespace kiln {

namespace {

uint64_t parse_hex(const nlohmann::json& value, const std::string& where) {
  const std::string text = value.get<std::string>();
  uint64_t v = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v, 16);
  if (text.size() != 16 || ec != std::errc() || ptr != text.data() + text.size())
    fail("data", "{}: '{}' is not a 16-digit hex hash", where, text);
  return v;
}

nlohmann::json split_json(const ManifestSplit& s) {
  nlohmann::json shards = nlohmann::json::array();
  for (const ShardInfo& i : s.shards)
    shards.push_back({{"file", i.file}, {"documents", i.documents}, {"tokens", i.tokens}, {"hash", hex64(i.hash)}});
  return {{"documents", s.documents}, {"tokens", s.tokens}, {"shards", shards}};
}

ManifestSplit split_from(const nlohmann::json& j, const std::string& where) {
  ManifestSplit s;
  s.documents = j.at("documents").get<uint64_t>();
  s.tokens = j.at("tokens").get<uint64_t>();
  uint64_t documents = 0, tokens = 0;
  for (const auto& e : j.at("shards")) {
    ShardInfo i;
    i.file = e.at("file").get<std::string>();
    i.documents = e.at("documents").get<uint64_t>();
    i.tokens = e.at("tokens").get<uint64_t>();
    i.hash = parse_hex(e.at("hash"), where);
    if (i.file.empty() || i.file.find('/') != std::string::npos || i.file.front() == '.')
      fail("data", "{}: shard file name '{}' must be a plain name in the manifest's directory", where, i.file);
    documents += i.documents;
    tokens += i.tokens;
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
  const nlohmann::json j = {
      {"format", "kiln-shards"},
      {"version", kManifestVersion},
      {"tokenizer",
       {{"name", m.tokenizer_name}, {"vocab_size", m.vocab_size}, {"hash", hex64(m.tokenizer_hash)},
        {"bos_id", m.bos_id}, {"eos_id", m.eos_id}, {"pad_id", m.pad_id}}},
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
  try {
    if (j.at("format").get<std::string>() != "kiln-shards") fail("data", "{}: not a kiln shard manifest", path);
    const int version = j.at("version").get<int>();
    if (version != kManifestVersion)
      fail("data", "{}: manifest version {} is not supported (this kiln reads {})", path, version, kManifestVersion);
    const auto& t = j.at("tokenizer");
    m.tokenizer_name = t.at("name").get<std::string>();
    m.vocab_size = t.at("vocab_size").get<uint64_t>();
    m.tokenizer_hash = parse_hex(t.at("hash"), path);
    m.bos_id = t.at("bos_id").get<int64_t>();
    m.eos_id = t.at("eos_id").get<int64_t>();
    m.pad_id = t.at("pad_id").get<int64_t>();
    m.token_bytes = j.at("token_bytes").get<int>();
    if (m.token_bytes != 2 && m.token_bytes != 4) fail("data", "{}: token_bytes must be 2 or 4, got {}", path, m.token_bytes);
    if (j.contains("source")) m.source = j.at("source");
    m.train = split_from(j.at("splits").at("train"), path);
    m.validation = split_from(j.at("splits").at("validation"), path);
    if (j.contains("skipped")) {
      for (int r = 0; r < kBadInputReasons; ++r) {
        const std::string key(bad_input_key(static_cast<BadInput>(r)));
        if (j.at("skipped").contains(key)) m.skipped.counts[static_cast<size_t>(r)] = j.at("skipped").at(key).get<int64_t>();
      }
    }
    m.fingerprint = parse_hex(j.at("fingerprint"), path);
  } catch (const nlohmann::json::exception& e) {
    fail("data", "{}: invalid manifest ({})", path, e.what());
  }
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
