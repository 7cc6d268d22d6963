// `kiln serve CHECKPOINT --port P`: the completions server (serve/server.h), loopback by
// default. SIGINT/SIGTERM stop it gracefully: no new connections, requests in progress
// finish within --shutdown-grace seconds (a second signal cuts them off at once), exit 0. On the GPU (--device, default auto) the decoder
// is the bf16, graph-captured one that `kiln sample` uses.
#include "cli/commands.h"
#include "core/error.h"
#include "io/durable_io.h"
#include "io/model_dir.h"
#include "ops/parallel.h"
#include "serve/server.h"
#include "core/device_choice.h"

#include <fmt/format.h>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <cstdio>
#include <pthread.h>
#include <thread>

namespace kiln::cli {

namespace {

// "runs/default/model/" -> "model": what a client names the model by default.
std::string folder_name(const std::string& dir) {
  std::filesystem::path p(dir);
  if (p.filename().empty()) p = p.parent_path();
  const std::string name = std::filesystem::absolute(p).lexically_normal().filename().string();
  return name.empty() ? "kiln" : name;
}

// Where the model's tokenizer_config.json (and so its chat template) is: the model folder
// (export and import put the tokenizer files there), else beside the tokenizer.json its
// config names; "" for a byte-level model without one.
std::string chat_template_dir(const std::string& dir) {
  if (std::filesystem::exists(std::filesystem::path(dir) / "tokenizer_config.json")) return dir;
  const std::string json = io::model_tokenizer_json(dir);
  return json.empty() ? "" : std::filesystem::path(json).parent_path().string();
}

}  // namespace

void add_serve_command(CLI::App& app) {
  struct Options {
    std::string model;
    std::string model_name;
    serve::ServeOptions serve;
    int64_t slots = 8, max_rows = 256, threads = 0;
    int64_t graph_rows = DecoderOptions{}.graph_rows;
    bool no_bos = false, no_access_log = false;
    std::string port_file;
    std::string device = "auto";
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("serve", "serve an OpenAI-compatible /v1/completions endpoint (for eval harnesses)");
  cmd->add_option("checkpoint", o->model, "kiln model directory (or a checkpoint or run directory)")->required();
  cmd->add_option("--host", o->serve.host, "address to listen on (loopback by default)")->capture_default_str();
  cmd->add_option("--port", o->serve.port, "TCP port, 1-65535 (0 = any free port, printed at start)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--port-file", o->port_file, "also write the bound port to this file");
  cmd->add_option("--model-name", o->model_name,
                  "model id the API serves (default: the model folder's name); requests may also name it 'kiln'");
  cmd->add_option("--slots", o->slots, "sequences decoded at once (KV-cache slots)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-rows", o->max_rows, "token rows per model step (prefill chunk + decode tokens)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  // At 64 busy slots of the 0.6B shape a decode step (64 rows, past the default 16) took 8 ms
  // uncaptured on an H100; whether capturing it helps is not yet measured.
  cmd->add_option("--graph-rows", o->graph_rows,
                  "GPU: model steps of at most this many rows run as CUDA graphs (at most 64; 0 = none)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{64}));
  cmd->add_option("--api-key", o->serve.api_key,
                  "require 'Authorization: Bearer KEY' on every endpoint but /health (or set KILN_API_KEY)")
      ->envname("KILN_API_KEY");
  cmd->add_option("--http-threads", o->serve.threads, "HTTP handler threads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--http-queue", o->serve.queue, "requests waiting for a handler thread before 503")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-connections", o->serve.max_connections, "connections open at once before 503")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-body-bytes", o->serve.max_body_bytes, "largest request body (413 above)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--request-timeout", o->serve.request_timeout_s,
                  "seconds a client has to send one whole request, headers and body (408 after)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-prompts", o->serve.limits.max_prompts, "prompts per request")->capture_default_str();
  cmd->add_option("--max-pending", o->serve.max_pending, "sequences queued or running before 503")
      ->capture_default_str();
  cmd->add_flag("--no-bos", o->no_bos, "do not put BOS before string prompts");
  cmd->add_option("--shutdown-grace", o->serve.shutdown_grace_s,
                  "seconds requests in progress get to finish after SIGTERM/SIGINT before they are cut off")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--no-access-log", o->no_access_log, "no line per request on stderr");
  cmd->add_option("--threads", o->threads, "CPU threads for the model (0 = all)")->capture_default_str();
  add_device_option(cmd, o->device);
  cmd->callback([o] {
    // Signals go to one thread (blocked everywhere else). Blocked before anything starts a
    // thread: the CUDA runtime and OpenMP start their own, which inherit this mask; a thread
    // started earlier could take SIGTERM's default action and end the process uncleanly.
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGINT);
    sigaddset(&signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    set_cpu_threads(o->threads);
    o->serve.limits.add_bos = !o->no_bos;
    o->serve.access_log = !o->no_access_log;
    if (o->serve.api_key.empty() && !serve::is_loopback_host(o->serve.host))
      warn("serve", fmt::format("listening on {} with no API key: anyone who can reach it can use the model "
                                "(--api-key or KILN_API_KEY)",
                                o->serve.host));
    const std::string dir = io::resolve_model_dir(o->model);
    o->serve.model_name = o->model_name.empty() ? folder_name(dir) : o->model_name;
    // Before the model loads, so a template that does not parse stops the server at once.
    o->serve.chat_template = std::make_shared<const serve::ChatTemplate>(
        serve::ChatTemplate::for_model(chat_template_dir(dir)));
    io::LoadedModel loaded = io::load_for_decoding(dir, resolve_device(o->device));
    DecoderOptions d;
    d.slots = o->slots;
    d.max_rows = std::max(o->max_rows, o->slots);
    d.graph_rows = o->graph_rows;
    Decoder decoder(*loaded.model, d);
    const auto tokenizer = io::model_tokenizer(dir);
    Generator generator(decoder, *tokenizer);

    serve::CompletionServer server(generator, *tokenizer, o->serve);
    const int port = server.bind();
    // Checked: whoever waits on the port file (a test, a script) would otherwise wait forever.
    if (!o->port_file.empty()) io::replace_file_atomically(o->port_file, fmt::format("{}\n", port), "serve");
    fmt::print("kiln serve: {} as '{}' ({} layers, context {}) on http://{}:{} ({} slots, {:.1f} MB KV cache, {}{})\n",
               dir, o->serve.model_name,
               loaded.config.model.layers, decoder.max_len(), o->serve.host, port, decoder.slots(),
               static_cast<double>(decoder.state_bytes()) / 1e6, device_name(loaded.model->options().device),
               o->serve.api_key.empty() ? "" : ", API key required");
    std::fflush(stdout);
    std::atomic<bool> listening{true};
    std::thread waiter([&] {
      for (int signals_seen = 0; listening; ++signals_seen) {
        int sig = 0;
        sigwait(&signals, &sig);
        if (!listening) break;
        if (signals_seen == 0) {
          fmt::print(stderr, "kiln serve: {}: stopping; requests in progress get up to {} s to finish (a second "
                             "signal cuts them off)\n", sig == SIGINT ? "SIGINT" : "SIGTERM", o->serve.shutdown_grace_s);
          server.stop();
        } else {
          server.stop_now();
        }
      }
    });
    const int64_t cut = server.listen();
    listening = false;
    pthread_kill(waiter.native_handle(), SIGTERM);  // wakes the waiter
    waiter.join();
    fmt::print("kiln serve: stopped after {} model steps{}\n", server.worker().steps(),
               cut == 0 ? std::string()
                        : fmt::format("; {} request{} in progress cut off at the shutdown bound", cut, cut == 1 ? "" : "s"));
  });
}

}  // namespace kiln::cli
