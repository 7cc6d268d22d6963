#include "io/model_dir.h"

#include "core/error.h"
#include "core/small_file.h"
#include "data/bpe/bpe_tokenizer.h"
#include "io/checkpoint_manifest.h"
#include "io/weight_check.h"

#include <algorithm>
#include <cctype>
#include <filesystem>

namespace kiln::io {

namespace fs = std::filesystem;

namespace {
bool is_model_dir(const fs::path& p) {
  return fs::is_regular_file(p / "config.toml") && fs::is_regular_file(p / "model.safetensors");
}

// root/latest names a step directory ("step-00000100"); empty if there is none.
std::string latest_checkpoint(const fs::path& root) {
  if (!fs::is_regular_file(root / "latest")) return "";
  std::string name;
  try {  // bounded: a corrupt or odd `latest` is not read without end
    name = read_small_file((root / "latest").string(), 4096, "checkpoint 'latest' file", "load");
  } catch (const Error&) {
    return "";
  }
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
  if (name.empty() || name.find('/') != std::string::npos || name.find("..") != std::string::npos) return "";
  return is_model_dir(root / name) ? (root / name).string() : "";
}

}  // namespace

std::string resolve_model_dir(const std::string& path) {
  const fs::path p(path);
  if (is_model_dir(p)) return p.string();
  if (std::string latest = latest_checkpoint(p); !latest.empty()) return latest;
  if (is_model_dir(p / "model")) return (p / "model").string();
  if (std::string latest = latest_checkpoint(p / "checkpoints"); !latest.empty()) return latest;
  fail("load", "'{}' is not a kiln model directory (model.safetensors + config.toml), a checkpoint directory or a run "
       "directory with either", path);
}

namespace {

// Loads the model in `path` (a model, checkpoint or run directory) for use: a checkpoint's
// files are believed only once their checksums match (state.json without a manifest is a
// checkpoint whose save never finished), and broken weights (NaN/Inf, all zeros) are
// refused before anything samples or exports them.
LoadedModel load_checked(const std::string& path, const BuildOptions& options) {
  const std::string dir = resolve_model_dir(path);
  if (fs::exists(fs::path(dir) / "manifest.json") || fs::exists(fs::path(dir) / "state.json")) {
    static constexpr const char* kRequired[] = {"model.safetensors", "config.toml"};
    verify_checkpoint_files(dir, kRequired);
  }
  LoadedModel loaded = load_model(dir, options);
  check_weights_usable(*loaded.model, (fs::path(dir) / "model.safetensors").string());
  return loaded;
}

}  // namespace

LoadedModel load_for_inference(const std::string& path, int64_t max_tokens, Device device) {
  BuildOptions options;
  options.device = device;
  options.training = false;
  options.max_tokens = std::max<int64_t>(1, max_tokens);
  options.loss_chunk_rows = std::min<int64_t>(options.max_tokens, 256);
  return load_checked(path, options);
}

LoadedModel load_for_decoding(const std::string& path, Device device) {
  BuildOptions options;
  options.device = device;
  options.dtype = device == Device::cuda ? DType::bf16 : DType::f32;
  options.training = false;
  options.max_tokens = 1;
  options.loss_chunk_rows = 1;
  return load_checked(path, options);
}

namespace {

// The tokenizer.json data.tokenizer = `setting` names (a file, or the folder holding one;
// not checked to exist); empty for a tokenizer that needs no file ("byte", ...).
fs::path tokenizer_json_of(const std::string& setting) {
  const std::vector<std::string> names = tokenizer_names();
  if (setting != "bpe" && std::find(names.begin(), names.end(), setting) != names.end()) return {};
  fs::path path(setting);
  if (fs::is_directory(path)) path /= "tokenizer.json";
  return path;
}

}  // namespace

std::string model_tokenizer_json(const std::string& model_dir) {
  const fs::path saved = fs::path(model_dir) / "tokenizer.json";
  if (fs::exists(saved)) return saved.string();
  const std::string setting = load_config((fs::path(model_dir) / "config.toml").string()).data.tokenizer;
  const fs::path path = tokenizer_json_of(setting);
  if (path.empty()) return "";
  KILN_CHECK(fs::exists(path), "load",
             "{} was trained with data.tokenizer = '{}', which is not there; copy that tokenizer.json into the model "
             "directory",
             model_dir, setting);
  return path.string();
}

std::unique_ptr<Tokenizer> model_tokenizer(const std::string& model_dir) {
  const std::string config_path = (fs::path(model_dir) / "config.toml").string();
  const Config config = load_config(config_path);
  const std::string json = model_tokenizer_json(model_dir);
  if (json.empty()) return tokenizer_from_config(config.data.tokenizer);
  // Every id the tokenizer can produce must have a row in the model's embedding.
  return bpe::load_tokenizer_json(
      json, bpe::TokenIdLimit::of_model(config.model.vocab_size, "model.vocab_size in " + config_path));
}

void copy_tokenizer_files(const std::string& from, const std::string& to) {
  for (const char* f : kTokenizerFiles) {
    const fs::path source = fs::path(from) / f, target = fs::path(to) / f;
    if (!fs::exists(source)) continue;
    std::error_code ec;
    if (fs::exists(target) && fs::equivalent(source, target, ec)) continue;
    fs::copy_file(source, target, fs::copy_options::overwrite_existing, ec);
    KILN_CHECK(!ec, "save", "cannot copy '{}' to '{}': {}", source.string(), target.string(), ec.message());
  }
}

bool save_tokenizer_with_model(const std::string& setting, const std::string& model_dir) {
  const fs::path path = tokenizer_json_of(setting);
  if (path.empty()) {  // a tokenizer file left by an earlier run would override this one
    for (const char* f : kTokenizerFiles) fs::remove(fs::path(model_dir) / f);
    return true;
  }
  if (!fs::exists(path)) return false;
  copy_tokenizer_files(path.parent_path().empty() ? "." : path.parent_path().string(), model_dir);
  return true;
}

}  // namespace kiln::io
