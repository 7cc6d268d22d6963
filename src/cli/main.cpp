// kiln: one program to train, sample and inspect decoder-only language models.
#include "cli/commands.h"
#include "core/error.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <exception>

int main(int argc, char** argv) {
  CLI::App app{"kiln: pretrain decoder-only language models from scratch"};
  app.require_subcommand(1);
  app.set_version_flag("--version", KILN_VERSION);
  kiln::cli::add_train_command(app);
  kiln::cli::add_config_command(app);
  kiln::cli::add_sample_command(app);
  kiln::cli::add_plan_command(app);
  kiln::cli::add_list_command(app);
  kiln::cli::add_bench_command(app);
  kiln::cli::add_bench_decode_command(app);
  kiln::cli::add_bench_kda_command(app);
  kiln::cli::add_train_tokenizer_command(app);
  kiln::cli::add_export_command(app);
  kiln::cli::add_import_command(app);
  kiln::cli::add_eval_quant_command(app);
  kiln::cli::add_serve_command(app);
  kiln::cli::add_score_command(app);
  kiln::cli::add_eval_command(app);
  kiln::cli::add_tokenize_command(app);
  kiln::cli::add_launch_command(app);
  kiln::cli::add_plot_command(app);
  kiln::cli::add_loss_gap_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const kiln::Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "kiln: error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "kiln: internal error: {}\n", e.what());
    return 2;
  }
  return 0;
}
