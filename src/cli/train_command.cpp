#include "cli/commands.h"
#include "core/error.h"
#include "data/shards/shard_tokenizer.h"
#include "train/trainer.h"

#include <filesystem>

namespace kiln::cli {

namespace {

namespace fs = std::filesystem;

// The config file `kiln train` reads. With --resume, a run directory (a train.out_dir)
// stands for the configuration that run saved, so a resume needs none of its --set
// repeated; --set still applies on top. The run must be that directory's own: a model or
// checkpoint directory also holds a config.toml, of the run around it.
std::string train_config_path(const std::string& given, bool resume) {
  if (!fs::is_directory(given)) return given;
  const fs::path saved = fs::path(given) / "config.toml";
  // Without --resume, load_config refuses a directory; one holding a run gets the command.
  KILN_CHECK(resume || !fs::is_regular_file(saved), "config",
             "{}: is a directory, not a config file; to continue the run in it: kiln train {} --resume", given, given);
  if (!resume) return given;
  KILN_CHECK(fs::is_regular_file(saved), "train",
             "{} holds no config.toml: kiln train DIR --resume takes a run's train.out_dir", given);
  return saved.string();
}

void check_own_run_directory(const std::string& given, const std::string& config_path, const Config& config) {
  if (config_path == given) return;
  std::error_code ec;
  KILN_CHECK(fs::equivalent(given, config.train.out_dir, ec), "train",
             "{} is not a run's train.out_dir: its config.toml names train.out_dir = '{}' (a model or checkpoint "
             "directory? a moved run: --set train.out_dir={})",
             given, config.train.out_dir, given);
}

}  // namespace

void add_train_command(CLI::App& app) {
  struct Options {
    std::string config;
    std::vector<std::string> overrides;
    std::string resume;
    bool allow_data_change = false;
    bool overwrite = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("train", "train a model from a TOML config");
  cmd->add_option("config", options->config, "TOML config file (e.g. configs/default.toml)")->required();
  cmd->add_option("--set", options->overrides, "override a key: --set model.layers=8 (repeatable)")
      ->take_all()
      ->allow_extra_args(false);
  CLI::Option* resume =
      cmd->add_option("--resume", options->resume,
                      "continue from the latest checkpoint in checkpoint.dir (none yet: start fresh), or from "
                      "PATH (a checkpoint, or a directory of them)")
          ->expected(0, 1);
  cmd->add_flag("--allow-data-change", options->allow_data_change,
                "resume although the training data changed (the new data is read from its start)");
  cmd->add_flag("--overwrite", options->overwrite,
                "start afresh in a train.out_dir that holds an earlier run, removing that run's files");
  cmd->callback([options, resume] {
    KILN_CHECK(!options->overwrite || resume->count() == 0, "train",
               "--overwrite starts afresh and --resume continues a run: pass one of them");
    const std::string config_path = train_config_path(options->config, resume->count() > 0);
    Config config = load_config(config_path, options->overrides);
    adopt_shard_tokenizer(config);  // data.path's shards name their tokenizer and vocabulary
    check_own_run_directory(options->config, config_path, config);
    TrainOptions train;
    if (resume->count() > 0) train.resume = options->resume.empty() ? "latest" : options->resume;
    train.allow_data_change = options->allow_data_change;
    train.overwrite = options->overwrite;
    Trainer trainer(config, train);
    trainer.run();
  });
}

}  // namespace kiln::cli
