// `kiln loss-gap CONFIG --candidate KEY=VALUE... --out DIR`: is a change (a precision, an
// optimizer's state format) free, measured by the loss? Trains three runs of CONFIG, one
// after another, each `kiln train` in a process of its own: the baseline at seed A, the
// baseline at seed B, and the candidate (the baseline plus --candidate's keys) at seed A;
// then compares them (plot/loss_gap.h) and fails when the candidate's gap is more than
// --max-ratio times the two baselines' difference. `--runs BASE SECOND CANDIDATE` compares
// runs trained before instead. docs/loss-gap.md.
#include "cli/commands.h"
#include "cli/exec_self.h"
#include "config/config.h"
#include "core/error.h"
#include "core/printable.h"
#include "plot/loss_gap.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace kiln::cli {

namespace {

namespace fs = std::filesystem;
constexpr const char* kWhere = "loss-gap";

// Keys the command sets itself for each run.
bool reserved_key(const std::string& key) { return key == "train.seed" || key == "train.out_dir"; }

void check_override(const std::string& option, const std::string& text) {
  const size_t eq = text.find('=');
  KILN_CHECK(eq != std::string::npos && eq > 0, kWhere, "{} {}: expected KEY=VALUE, such as optim.master_weights=bf16",
             option, printable(text));
  KILN_CHECK(!reserved_key(text.substr(0, eq)), kWhere,
             "{} {}: loss-gap sets {} for each run itself (--seeds, --out)", option, printable(text), text.substr(0, eq));
}

// Runs `kiln ARGS...` (this binary) with its output in `log`; fails naming the run.
void run_kiln(const std::vector<std::string>& args, const std::string& log, const std::string& name) {
  std::fflush(stdout);
  const pid_t pid = ::fork();
  KILN_CHECK(pid >= 0, kWhere, "fork failed: {}", std::strerror(errno));
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0) {
      fmt::print(stderr, "kiln: error: [loss-gap] {}: cannot create: {}\n", log, std::strerror(errno));
      std::_Exit(127);
    }
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
    exec_self(args);
    fmt::print(stderr, "kiln: error: [loss-gap] cannot start kiln: {}\n", std::strerror(errno));
    std::_Exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    KILN_CHECK(errno == EINTR, kWhere, "waiting for run {}: {}", name, std::strerror(errno));
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
  const std::string how = WIFEXITED(status) ? fmt::format("exited with status {}", WEXITSTATUS(status))
                                            : fmt::format("was killed by signal {}", WTERMSIG(status));
  fail(kWhere, "run {} {}: its output is in {}", name, how, log);
}

struct Options {
  std::string config;
  std::vector<std::string> candidate;
  std::vector<std::string> overrides;
  std::vector<uint64_t> seeds;
  std::string out;
  std::vector<std::string> runs;
  int64_t from_step = 0;
  double max_ratio = 1.5;
  std::string json;
};

// Trains the three runs into o.out; returns their directories (baseline, second, candidate).
std::vector<std::string> train_runs(const Options& o) {
  KILN_CHECK(!o.config.empty(), kWhere, "a CONFIG to train, or --runs BASELINE SECOND_BASELINE CANDIDATE");
  KILN_CHECK(!o.candidate.empty(), kWhere, "--candidate KEY=VALUE: what the candidate run changes (repeatable)");
  KILN_CHECK(!o.out.empty(), kWhere, "--out DIR: where the three runs go");
  for (const std::string& c : o.candidate) check_override("--candidate", c);
  for (const std::string& s : o.overrides) check_override("--set", s);
  std::error_code error;
  KILN_CHECK(!fs::exists(o.out, error) || fs::is_empty(o.out, error), kWhere,
             "--out {}: exists and is not empty; name a new directory (earlier runs are kept)", o.out);

  std::vector<std::string> candidate_overrides = o.overrides;
  candidate_overrides.insert(candidate_overrides.end(), o.candidate.begin(), o.candidate.end());
  load_config(o.config, candidate_overrides);  // a bad key or value fails here, before any training
  const Config base = load_config(o.config, o.overrides);
  const uint64_t seed_a = o.seeds.empty() ? base.train.seed : o.seeds[0];
  const uint64_t seed_b = o.seeds.size() < 2 ? seed_a + 1 : o.seeds[1];
  KILN_CHECK(seed_a != seed_b, kWhere, "--seeds {},{}: the two baselines need different seeds", seed_a, seed_b);

  fs::create_directories(o.out);
  struct Run {
    std::string name;
    uint64_t seed;
    const std::vector<std::string>* overrides;
  };
  const std::vector<Run> runs = {{fmt::format("baseline-seed{}", seed_a), seed_a, &o.overrides},
                                 {fmt::format("baseline-seed{}", seed_b), seed_b, &o.overrides},
                                 {fmt::format("candidate-seed{}", seed_a), seed_a, &candidate_overrides}};
  std::vector<std::string> dirs;
  for (const Run& run : runs) {
    const std::string dir = (fs::path(o.out) / run.name).string();
    std::vector<std::string> args = {"train", o.config};
    for (const std::string& s : *run.overrides) args.insert(args.end(), {"--set", s});
    args.insert(args.end(), {"--set", fmt::format("train.seed={}", run.seed), "--set", "train.out_dir=" + dir});
    fmt::print("loss-gap: training {} ...\n", run.name);
    run_kiln(args, dir + ".log", run.name);
    dirs.push_back(dir);
  }
  return dirs;
}

void write_json(const std::string& path, const plot::LossGap& gap, const std::vector<std::string>& runs,
                const Options& o) {
  const auto difference = [](const plot::LossDifference& d) {
    return nlohmann::json{{"records", d.records},         {"first_step", d.first_step}, {"last_step", d.last_step},
                          {"mean_absolute", d.mean_absolute}, {"mean_signed", d.mean_signed}};
  };
  nlohmann::json j = {{"baseline", runs[0]},
                      {"second_baseline", runs[1]},
                      {"candidate", runs[2]},
                      {"candidate_keys", o.candidate},
                      {"noise", difference(gap.noise)},
                      {"gap", difference(gap.gap)},
                      {"ratio", std::isfinite(gap.ratio) ? nlohmann::json(gap.ratio) : nlohmann::json(nullptr)},
                      {"max_ratio", o.max_ratio},
                      {"inside_noise", gap.ratio <= o.max_ratio}};
  if (gap.validation)
    j["validation"] = {{"step", gap.validation->step},
                       {"baseline", gap.validation->baseline},
                       {"second_baseline", gap.validation->second_baseline},
                       {"candidate", gap.validation->candidate}};
  std::ofstream file(path, std::ios::trunc);
  file << j.dump() << "\n";
  KILN_CHECK(file.good(), kWhere, "--json {}: cannot write: {}", path, std::strerror(errno));
}

}  // namespace

void add_loss_gap_command(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "loss-gap", "train a baseline at two seeds and a candidate change, and compare the candidate's loss gap with the seeds' noise");
  cmd->add_option("config", o->config, "the run's configuration (TOML)");
  cmd->add_option("--candidate", o->candidate, "what the candidate changes: KEY=VALUE (repeatable)");
  cmd->add_option("--set", o->overrides, "a key for all three runs: --set train.steps=1000 (repeatable)");
  cmd->add_option("--seeds", o->seeds, "train.seed of the baseline (and candidate), then of the second baseline "
                                       "(default: the config's, and that + 1)")
      ->delimiter(',')
      ->expected(2);
  cmd->add_option("--out", o->out, "a new directory for the three runs and their logs");
  cmd->add_option("--runs", o->runs, "compare finished runs instead: BASELINE SECOND_BASELINE CANDIDATE (run directories "
                                     "or metrics files)")
      ->expected(3);
  cmd->add_option("--from-step", o->from_step, "compare train records from this step on")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-ratio", o->max_ratio, "fail when the gap is more than this x the noise floor")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--json", o->json, "also write the result as one JSON line to this file (default with --out: "
                                     "DIR/loss_gap.json)");
  cmd->callback([o] {
    KILN_CHECK(o->runs.empty() || (o->config.empty() && o->candidate.empty() && o->out.empty()), kWhere,
               "--runs compares finished runs: no CONFIG, --candidate or --out with it");
    const std::vector<std::string> runs = o->runs.empty() ? train_runs(*o) : o->runs;
    const plot::RunMetrics baseline = plot::read_run_metrics(runs[0]);
    const plot::RunMetrics second = plot::read_run_metrics(runs[1]);
    const plot::RunMetrics candidate = plot::read_run_metrics(runs[2]);
    const plot::LossGap gap = plot::measure_loss_gap(baseline, second, candidate, o->from_step);
    fmt::print("{}", plot::describe_loss_gap(gap, baseline, second, candidate));
    const std::string json = !o->json.empty() ? o->json : o->out.empty() ? "" : (fs::path(o->out) / "loss_gap.json").string();
    if (!json.empty()) write_json(json, gap, runs, *o);
    KILN_CHECK(gap.ratio <= o->max_ratio, kWhere, "the gap is {:.2f}x the noise floor, over --max-ratio {}: the candidate "
               "changes the loss more than a seed does", gap.ratio, o->max_ratio);
    fmt::print("loss-gap: inside run-to-run noise ({:.2f}x the noise floor, at most --max-ratio {})\n", gap.ratio,
               o->max_ratio);
  });
}

}  // namespace kiln::cli
