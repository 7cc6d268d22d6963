#include "train/init_from.h"

#include "core/error.h"
#include "core/json_file.h"
#include "io/checkpoint_manifest.h"
#include "io/hf_config.h"
#include "io/hf_import.h"
#include "io/model_dir.h"
#include "io/model_io.h"
#include "io/weight_check.h"
#include "train/checkpoint_state.h"

#include <filesystem>
#include <map>
#include <optional>

namespace kiln {

namespace fs = std::filesystem;

namespace {

constexpr const char* kKey = "train.init_from";

// A Hugging Face folder has config.json and no config.toml (kiln's model directories, and
// a run's hf/ exports beside them, are told apart by that file).
bool is_hugging_face_folder(const fs::path& p) {
  return fs::is_regular_file(p / "config.json") && !fs::is_regular_file(p / "config.toml");
}

InitialWeights find_hugging_face(const std::string& dir) {
  const std::string config_path = (fs::path(dir) / "config.json").string();
  const io::HfModelSpec spec = io::hf_config_to_model(read_json_file(config_path, kKey), config_path);
  InitialWeights source;
  source.dir = dir;
  source.hugging_face = true;
  source.model_type = std::string(io::hf_model_type(spec.arch));
  source.config = io::hf_import_config(spec, config_path);
  return source;
}

InitialWeights find_kiln_model(const std::string& path) {
  InitialWeights source;
  try {
    source.dir = io::resolve_model_dir(path);
  } catch (const Error&) {
    fail(kKey, "'{}' is not a kiln model directory (model.safetensors + config.toml), a checkpoint or run directory, "
         "or a Hugging Face folder (config.json + safetensors)", path);
  }
  // A checkpoint's files are believed only once their checksums match (as for sampling).
  const fs::path dir(source.dir);
  if (fs::exists(dir / "manifest.json") || fs::exists(dir / "state.json")) {
    static constexpr const char* kRequired[] = {"model.safetensors", "config.toml"};
    io::verify_checkpoint_files(source.dir, kRequired);
  }
  source.config = load_config((dir / "config.toml").string());
  return source;
}

// The model the source's configuration builds, planned but never allocated: its
// parameters' names and shapes.
std::map<std::string, Shape> source_shapes(const Config& source) {
  BuildOptions options;
  options.training = false;
  options.max_tokens = 1;
  options.loss_chunk_rows = 1;
  const Model planned(source.model, options);
  std::map<std::string, Shape> shapes;
  for (const auto& p : planned.parameters()) shapes.emplace(p->name(), p->shape());
  return shapes;
}

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

// Every parameter of the run's model in the source with its shape, and nothing more.
void check_same_tensors(const InitialWeights& source, const Config& run, const Model& model) {
  const std::vector<std::string> differences = model_differences(source.config, run);
  const std::string why = differences.empty() ? "" : " (the model differs in: " + joined(differences) + ")";
  std::map<std::string, Shape> shapes = source_shapes(source.config);
  for (const auto& p : model.parameters()) {
    const auto it = shapes.find(p->name());
    KILN_CHECK(it != shapes.end(), kKey, "{}: has no tensor '{}' of this run's model{}", source.dir, p->name(), why);
    KILN_CHECK(it->second == p->shape(), kKey, "{}: tensor '{}' is {} there, {} in this run's model{}", source.dir,
               p->name(), it->second.str(), p->shape().str(), why);
    shapes.erase(it);
  }
  KILN_CHECK(shapes.empty(), kKey, "{}: tensor '{}' has no place in this run's model{}", source.dir,
             shapes.empty() ? "" : shapes.begin()->first, why);
}

}  // namespace

std::optional<InitialWeights> find_initial_weights(const Config& run) {
  const std::string& path = run.train.init_from;
  if (path.empty()) return std::nullopt;
  std::error_code ec;
  KILN_CHECK(fs::exists(path, ec), kKey, "'{}' does not exist", path);
  if (is_hugging_face_folder(path)) return find_hugging_face(path);
  return find_kiln_model(path);
}

std::vector<std::string> model_differences(const Config& source, const Config& run) {
  std::vector<std::string> out;
  for (std::string& d : config_differences(source, run))
    if (d.starts_with("model.") && !d.starts_with("model.name ") && !d.starts_with("model.init_std "))
      out.push_back(std::move(d));
  return out;
}

std::vector<std::string> load_initial_weights(const InitialWeights& source, const Config& run, Model& model) {
  std::optional<Model> whole;  // a pipeline stage's model: the whole model it is part of, planned only
  if (model.backbone().whole()) {
    check_same_tensors(source, run, model);
  } else {
    // A pipeline stage's model (dist.pipeline_model = "stages") reads its part of the
    // source; the source is checked against the whole model it is part of.
    BuildOptions planned;
    planned.training = false;
    planned.max_tokens = 1;
    planned.loss_chunk_rows = 1;
    whole.emplace(run.model, planned);
    check_same_tensors(source, run, *whole);
  }
  if (source.hugging_face) io::load_hf_weights(source.dir, model, source.model_type, kKey, whole ? &*whole : nullptr);
  else io::load_weights(model, (fs::path(source.dir) / "model.safetensors").string());
  io::check_weights_usable(model, source.dir);
  return model_differences(source.config, run);
}

}  // namespace kiln
