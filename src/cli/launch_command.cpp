// kiln launch --nproc N -- train CONFIG ...: starts N local ranks of a kiln command with
// torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT), forwards SIGTERM/SIGINT to them (a coordinated checkpoint and exit 0),
// and exits with the first failing rank's status after the others have ended; a rank
// that outlives a failed one by more than --grace seconds is killed.
#include "cli/commands.h"
#include "cli/exec_self.h"
#include "core/error.h"
#include "dist/free_port.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

namespace kiln::cli {

namespace {

volatile sig_atomic_t forwarded_signal = 0;

void remember_signal(int sig) { forwarded_signal = sig; }

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return "stopped";
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

[[noreturn]] void exec_rank(int rank, int nproc, int port, const std::vector<std::string>& args) {
  // A group of its own, so a Ctrl-C at the terminal reaches the launcher alone, which
  // passes it on once (kiln's stop handler is one-shot: a second signal ends a rank at
  // once); and SIGTERM when the launcher dies, so no rank outlives it.
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  const std::string r = std::to_string(rank), n = std::to_string(nproc), p = std::to_string(port);
  setenv("RANK", r.c_str(), 1);
  setenv("LOCAL_RANK", r.c_str(), 1);
  setenv("WORLD_SIZE", n.c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", n.c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", p.c_str(), 1);
  exec_self(args);
  fmt::print(stderr, "kiln: error: [launch] rank {}: cannot start kiln: {}\n", rank, std::strerror(errno));
  std::_Exit(127);
}

int launch(int nproc, int port, double grace_seconds, const std::vector<std::string>& args) {
  KILN_CHECK(!args.empty(), "launch", "no command to run: kiln launch --nproc N -- train CONFIG ...");
  if (port == 0) port = dist::free_loopback_port();
  struct sigaction action {};
  action.sa_handler = remember_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  std::fflush(stdout);
  std::map<pid_t, int> ranks;  // running children
  for (int rank = 0; rank < nproc; ++rank) {
    const pid_t pid = ::fork();
    KILN_CHECK(pid >= 0, "launch", "fork failed: {}", std::strerror(errno));
    if (pid == 0) exec_rank(rank, nproc, port, args);
    ranks[pid] = rank;
  }
  fmt::print(stderr, "kiln launch: {} ranks on this host, rendezvous at 127.0.0.1:{}\n", nproc, port);

  int first_failure = 0, forwarded = 0;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  while (!ranks.empty()) {
    if (forwarded_signal != 0 && forwarded != forwarded_signal) {
      forwarded = forwarded_signal;
      for (const auto& [pid, rank] : ranks) ::kill(pid, forwarded);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      for (const auto& [pid, rank] : ranks) {
        fmt::print(stderr, "kiln launch: rank {} still runs {:.0f} s after a rank failed: killing it\n", rank,
                   grace_seconds);
        ::kill(pid, SIGKILL);
      }
      deadline = std::chrono::steady_clock::time_point::max();
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    const int rank = ranks[pid];
    ranks.erase(pid);
    if (exit_code(status) == 0) continue;
    fmt::print(stderr, "kiln launch: rank {} {}\n", rank, describe_status(status));
    if (first_failure == 0) {
      first_failure = exit_code(status);
      if (!ranks.empty())
        deadline = std::chrono::steady_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000));
    }
  }
  return first_failure;
}

}  // namespace

void add_launch_command(CLI::App& app) {
  struct Options {
    int nproc = 1;
    int port = 0;
    double grace = 60;
    std::vector<std::string> args;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("launch", "run N local ranks of a kiln command: kiln launch --nproc 2 -- train CONFIG");
  cmd->add_option("--nproc", options->nproc, "ranks to start on this host")->check(CLI::Range(1, 1024))->capture_default_str();
  cmd->add_option("--master-port", options->port, "rank 0's rendezvous port (0: a free one)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  cmd->add_option("--grace", options->grace, "seconds the other ranks may run on after one failed, then are killed")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("command", options->args, "the kiln command and its arguments, after --")->required();
  cmd->callback([options] {
    const int code = launch(options->nproc, options->port, options->grace, options->args);
    if (code != 0) std::exit(code);
  });
}

}  // namespace kiln::cli
