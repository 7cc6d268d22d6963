#include "io/checkpoint_manifest.h"

#include "core/checksum.h"
#include "core/error.h"
#include "io/durable_io.h"

#include <filesystem>
#include <vector>

namespace kiln::io {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::string_view kWhere = "checkpoint";

}  // namespace

uint64_t checkpoint_manifest_hash(json manifest) {
  manifest.erase("manifest_xxh64");
  return xxh64_string(manifest.dump());
}

int64_t verify_checkpoint_files(const std::string& dir, std::span<const char* const> required) {
  const std::string manifest_path = (fs::path(dir) / "manifest.json").string();
  KILN_CHECK(fs::exists(manifest_path), kWhere, "{}: incomplete checkpoint (no manifest.json)", dir);
  struct Entry {
    std::string file;
    uint64_t bytes;
    std::string hash;
  };
  std::vector<Entry> entries;
  int64_t version = -1, step = -1;
  try {
    const json manifest = json::parse(read_file_bytes(manifest_path, kWhere));
    KILN_CHECK(manifest.is_object() && manifest.value("format", "") == "kiln-checkpoint", kWhere,
               "{}: not a kiln checkpoint manifest", manifest_path);
    const uint64_t saved = parse_hex64(manifest.at("manifest_xxh64").get<std::string>(), "checkpoint");
    KILN_CHECK(saved == checkpoint_manifest_hash(manifest), kWhere, "{}: checksum mismatch: the manifest is corrupt",
               manifest_path);
    version = manifest.at("format_version").get<int64_t>();
    step = manifest.at("step").get<int64_t>();
    for (const char* name : required)
      KILN_CHECK(manifest.at("files").contains(name), kWhere, "{}: does not list {}", manifest_path, name);
    for (const auto& [name, e] : manifest.at("files").items()) {  // the required and any others listed
      KILN_CHECK(fs::path(name).filename() == name && name != ".." && name != ".", kWhere,
                 "{}: lists '{}', which is not a file of the checkpoint's folder", manifest_path, name);
      entries.push_back({(fs::path(dir) / name).string(), e.at("bytes").get<uint64_t>(), e.at("xxh64").get<std::string>()});
    }
  } catch (const json::exception& e) {
    fail(kWhere, "{}: corrupt manifest: {}", manifest_path, e.what());
  }
  KILN_CHECK(version == kCheckpointFormatVersion, kWhere,
             "{}: checkpoint format version {} (this kiln reads version {})", manifest_path, version,
             kCheckpointFormatVersion);
  for (const Entry& e : entries) {
    KILN_CHECK(fs::exists(e.file), kWhere, "{}: missing", e.file);
    const FileDigest d = xxh64_file(e.file);
    if (d.bytes != e.bytes)
      fail(kWhere, "{}: {} ({} bytes, the manifest says {})", e.file, d.bytes < e.bytes ? "truncated" : "wrong size",
           d.bytes, e.bytes);
    KILN_CHECK(hex64(d.hash) == e.hash, kWhere, "{}: checksum mismatch (xxh64 {}, the manifest says {}): corrupt",
               e.file, hex64(d.hash), e.hash);
  }
  return step;
}

}  // namespace kiln::io
