#include "train/run_paths.h"

#include "core/error.h"
#include "data/readers/glob.h"
#include "eval/eval_suite.h"
#include "io/output_path.h"
#include "train/checkpoint.h"

#include <filesystem>
#include <optional>

namespace kiln {

namespace fs = std::filesystem;

namespace {

struct RunInput {
  std::string path;
  std::string key;
};

// A glob reads below its first component holding a pattern character: that directory.
std::string data_root(const std::string& path) {
  if (!is_glob_pattern(path) || fs::exists(path)) return path;
  fs::path root;
  for (const fs::path& part : fs::path(path)) {
    if (is_glob_pattern(part.string())) break;
    root /= part;
  }
  return root.empty() ? std::string(".") : root.string();
}

std::vector<RunInput> data_inputs(const Config& config) {
  std::vector<RunInput> inputs;
  if (!config.data.path.empty()) inputs.push_back({data_root(config.data.path), "data.path"});
  for (size_t i = 0; i < config.data.sources.size(); ++i)
    inputs.push_back({data_root(config.data.sources[i].path), fmt::format("data.sources[{}].path", i)});
  if (!config.data.val_path.empty()) inputs.push_back({data_root(config.data.val_path), "data.val_path"});
  return inputs;
}

// Every file the run reads: its data, a tokenizer file, the [eval] lists' files, the
// train.init_from weights.
std::vector<RunInput> all_inputs(const Config& config) {
  std::vector<RunInput> inputs = data_inputs(config);
  std::error_code ec;
  if (fs::exists(config.data.tokenizer, ec)) inputs.push_back({config.data.tokenizer, "data.tokenizer"});
  // The weights a run starts from: overwriting them (out_dir = the source run) would lose them.
  if (!config.train.init_from.empty() && fs::exists(config.train.init_from, ec))
    inputs.push_back({config.train.init_from, "train.init_from"});
  for (const std::string& file : eval::split_file_list(config.eval.tasks)) inputs.push_back({file, "eval.tasks"});
  for (const std::string& file : eval::split_file_list(config.eval.texts)) inputs.push_back({file, "eval.texts"});
  return inputs;
}

// A path named by `key` relative to train.out_dir must stay inside it.
void check_inside_out_dir(const std::string& relative, const char* key) {
  const fs::path p = fs::path(relative).lexically_normal();
  KILN_CHECK(!relative.empty() && p.is_relative() && p != "." && *p.begin() != "..", key,
             "'{}' must be a path inside train.out_dir (relative, without '..')", relative);
}

}  // namespace

std::vector<RunOutput> run_outputs(const Config& config) {
  const fs::path out = config.train.out_dir;
  auto in_out_dir = [&](const std::string& name) { return (out / name).string(); };
  std::vector<RunOutput> outputs = {
      {in_out_dir("config.toml"), "the run's config.toml"},
      {in_out_dir("summary.json"), "the run's summary.json"},
      {in_out_dir("plot.png"), "the run's plot.png"},
      {in_out_dir("model"), "the run's model/"},
      {in_out_dir("hf"), "the run's hf/ exports"},
      {in_out_dir(kRunLockFile), "the run's lock file"},
      {in_out_dir(kRunIdFile), "the run's run_id"},
      {checkpoint_root(config), config.checkpoint.dir.empty() ? "the run's checkpoints/" : "checkpoint.dir"},
      {in_out_dir(config.log.metrics_file), "log.metrics_file"},
  };
  if (config.log.tensorboard) outputs.push_back({in_out_dir(config.log.tensorboard_dir), "log.tensorboard_dir"});
  return outputs;
}

void check_run_paths(const Config& config) {
  // Every input is there, named by its key, before anything is created (a relative path
  // in a config file is relative to the file's directory: the error shows where it looked).
  for (const RunInput& input : all_inputs(config)) {
    std::error_code ec;
    KILN_CHECK(fs::exists(input.path, ec), input.key, "'{}': no such file or directory", input.path);
  }
  // The run directory and the checkpoint directory apart from the data they train on: a
  // run written into its data would read its own files as data at the next start.
  for (const RunInput& data : data_inputs(config)) {
    if (const auto relation = io::path_overlap(config.train.out_dir, data.path))
      fail("train.out_dir", "{} {} {} {}: the run would write among its training data; choose a train.out_dir apart "
           "from it", config.train.out_dir, *relation, data.key, data.path);
    if (config.checkpoint.dir.empty()) continue;
    if (const auto relation = io::path_overlap(config.checkpoint.dir, data.path))
      fail("checkpoint.dir", "{} {} {} {}: checkpoints would be written among the training data; choose a "
           "checkpoint.dir apart from it", config.checkpoint.dir, *relation, data.key, data.path);
  }
  check_inside_out_dir(config.log.metrics_file, "log.metrics_file");
  if (config.log.tensorboard) check_inside_out_dir(config.log.tensorboard_dir, "log.tensorboard_dir");

  // No output overlaps another (the metrics file may not be config.toml or
  // checkpoints/latest), nor is or holds an input.
  const std::vector<RunOutput> outputs = run_outputs(config);
  const std::vector<RunInput> inputs = all_inputs(config);
  for (size_t i = 0; i < outputs.size(); ++i) {
    const RunOutput& a = outputs[i];
    for (size_t j = 0; j < i; ++j) {
      const RunOutput& b = outputs[j];
      if (const auto relation = io::path_overlap(a.path, b.path))
        fail(a.name.starts_with("the run's") ? b.name : a.name, "{} ({}) {} {} ({}): kiln's own files are never "
             "another output; choose another path", a.path, a.name, *relation, b.name, b.path);
    }
    for (const RunInput& input : inputs) {
      const auto relation = io::path_overlap(a.path, input.path);
      if (relation && *relation != std::string_view("lies inside"))
        fail(a.name.starts_with("the run's") ? input.key : a.name,
             "{} ({}) {} {} {}: writing it would destroy an input; choose another path", a.path, a.name, *relation,
             input.key, input.path);
    }
  }
}

}  // namespace kiln
