// The `kiln` subcommands. Each add_* registers its options and a callback on the app;
// callbacks throw kiln::Error, which main() prints as one line and exits 1.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace kiln::cli {

// --device auto|cpu|cuda of the inference commands (sample, serve): where the model runs.
inline CLI::Option* add_device_option(CLI::App* cmd, std::string& device) {
  return cmd->add_option("--device", device, "auto (the GPU when there is one) | cpu | cuda")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
}

void add_train_command(CLI::App& app);
void add_config_command(CLI::App& app);
void add_sample_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_list_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_bench_decode_command(CLI::App& app);
void add_bench_kda_command(CLI::App& app);
void add_train_tokenizer_command(CLI::App& app);
void add_export_command(CLI::App& app);
void add_import_command(CLI::App& app);
void add_eval_quant_command(CLI::App& app);
void add_serve_command(CLI::App& app);
void add_score_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_tokenize_command(CLI::App& app);
void add_launch_command(CLI::App& app);
void add_plot_command(CLI::App& app);
void add_loss_gap_command(CLI::App& app);

}  // namespace kiln::cli
