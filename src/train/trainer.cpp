#include "train/trainer.h"

#include "core/device_memory.h"
#include "core/printable.h"
#include "infer/sampler.h"
#include "io/model_dir.h"
#include "io/model_io.h"
#include "nn/modules.h"
#include "ops/parallel.h"
#include "train/memory_check.h"
#include "train/signals.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>

namespace kiln {

namespace fs = std::filesystem;

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Creates the run directory and proves it is writable before any work starts.
void prepare_out_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  KILN_CHECK(!ec, "train.out_dir", "cannot create '{}': {}", dir, ec.message());
  const fs::path probe = fs::path(dir) / ".kiln-write-test";
  std::ofstream(probe) << "ok";
  KILN_CHECK(fs::exists(probe), "train.out_dir", "'{}' is not writable", dir);
  fs::remove(probe, ec);
}

std::string human_count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f}k", n / 1e3);
  return fmt::format("{:.0f}", n);
}

// Every registry name in the config must exist; the error names the key and the choices.
void check_component_names(const Config& c) {
  auto check = [](const auto& registry, const char* key, const std::string& name) {
    KILN_CHECK(registry.contains(name), "config", "{}: unknown {} '{}' (known: {})", key, registry.kind(), printable(name),
               registry.known());
  };
  check(norm_registry(), "model.norm", c.model.norm);
  check(attention_registry(), "model.attention", c.model.attention);
  check(mlp_registry(), "model.mlp", c.model.mlp);
  check(position_registry(), "model.position", c.model.position);
  check(optimizer_registry(), "optim.name", c.optim.name);
  check(schedule_registry(), "optim.schedule", c.optim.schedule);
}

}  // namespace

Device resolve_device(const std::string& setting) {
  const bool gpu = cuda_available();
  if (setting == "cuda") {
    KILN_CHECK(gpu, "train.device", "cuda requested, but {}",
               KILN_WITH_CUDA ? "no CUDA device is visible" : "this kiln was built without the CUDA backend");
    return Device::cuda;
  }
  return setting == "auto" && gpu ? Device::cuda : Device::cpu;
}

DType resolve_precision(const std::string& setting, Device device) {
  if (setting == "fp32") return DType::f32;
  KILN_CHECK(setting != "bf16" || device == Device::cuda, "train.precision",
             "bf16 runs on the GPU only (this run uses the CPU); use fp32 or auto");
  return device == Device::cuda ? DType::bf16 : DType::f32;
}

BuildOptions training_build_options(const Config& config, Device device) {
  BuildOptions options;
  options.device = device;
  options.dtype = resolve_precision(config.train.precision, device);
  options.recompute_blocks = config.train.recompute_blocks;
  options.deterministic = config.train.deterministic;
  options.max_tokens = config.train.micro_batch_tokens;
  options.loss_chunk_rows = config.train.loss_chunk_tokens;
  return options;
}

Trainer::Trainer(const Config& config, const TrainOptions& train_options)
    : config_(config),
      device_(resolve_device(config.train.device)),
      optimizer_state_("optimizer", device_),
      faults_(FaultInjector::from_env()),
      guard_(config.train) {
  validate_config(config_);
  check_component_names(config_);  // before any data is read: config mistakes surface first
  const int threads = set_cpu_threads(config_.train.threads);
  threads_ = threads;
  prepare_out_dir(config_.train.out_dir);
  checkpoints_ = std::make_unique<CheckpointWriter>(config_, faults_);
  checkpoints_->prepare();  // an unusable checkpoint directory fails now, not at the first save

  tokenizer_ = tokenizer_from_config(config_.data.tokenizer);  // "byte" or a tokenizer.json
  KILN_CHECK(config_.model.vocab_size >= tokenizer_->vocab_size(), "model.vocab_size",
             "{} is smaller than the {} tokenizer's vocabulary ({})", config_.model.vocab_size, tokenizer_->name(),
             tokenizer_->vocab_size());
  dataset_ = std::make_unique<TokenDataset>(config_.data, *tokenizer_);
  // Before anything large is allocated (batches, arenas): stop now if it cannot fit.
  check_memory_fits(config_, device_, plan_training_memory(config_, device_), available_memory(device_));
  const Packer packer(packer_options(config_, *tokenizer_));
  // data.seed, rank sharding (data.rank/world_size or RANK/WORLD_SIZE) and data.prefetch.
  stream_ = std::make_unique<BatchStream>(*dataset_, Split::train, packer, config_.data);
  validation_ = validation_batches(*dataset_, packer, config_.train.eval_batches);
  micro_batches_.resize(static_cast<size_t>(config_.train.grad_accum));

  model_ = std::make_unique<Model>(config_.model, training_build_options(config_, device_));
  optimizer_ = optimizer_registry().build("optim.name", config_.optim.name, config_.optim, model_->parameters());
  schedule_ = schedule_registry().build("optim.schedule", config_.optim.schedule, config_.optim, config_.train.steps);
  optimizer_->plan(optimizer_state_);
  // Found and verified (checksums, model and precision guards) before allocating.
  const std::optional<CheckpointInfo> resume = find_resume_checkpoint(train_options);
  model_->allocate();
  optimizer_state_.allocate();
  if (resume) restore(*resume, train_options.allow_data_change);
  else model_->init_weights(config_.train.seed);
  // The GPU step with its scalars on the device, unless the op-by-op one is asked for or
  // test faults must be injected between its parts.
  if (device_ == Device::cuda && config_.train.cuda_graphs && optimizer_->updates_on_device() && !faults_.numeric())
    device_step_ = std::make_unique<DeviceStep>(*model_, *optimizer_, config_.train.grad_accum, true);

  std::ofstream(fs::path(config_.train.out_dir) / "config.toml") << config_to_toml(config_);
  metrics_ = std::make_unique<MetricsLog>((fs::path(config_.train.out_dir) / config_.log.metrics_file).string());
  if (resume) {
    metrics_->resume(progress_.step, resume->path);
    fmt::print("resumed from {} at step {}\n", resume->path, progress_.step);
  }

  const MemoryPlan plan = model_->memory_plan();
  const char* precision = model_->options().dtype == DType::bf16 ? "bf16 mixed" : "fp32";
  const std::string device = device_ == Device::cuda
                                 ? fmt::format("cuda ({}, {}, {})", cuda_device_name(), precision,
                                               device_step_ ? "CUDA graphs" : "op by op")
                                 : fmt::format("cpu ({} threads, {})", threads, precision);
  fmt::print("kiln {} | device {} | model {}: {} parameters, {} layers, hidden {}\n", KILN_VERSION, device,
             config_.model.name, human_count(static_cast<double>(model_->parameter_count())), config_.model.layers,
             config_.model.hidden);
  fmt::print("data {}: {} train / {} validation documents ({} / {} tokens) | {} tokens per step ({} x {})\n",
             config_.data.path, dataset_->num_documents(Split::train), dataset_->num_documents(Split::validation),
             human_count(static_cast<double>(dataset_->num_tokens(Split::train))),
             human_count(static_cast<double>(dataset_->num_tokens(Split::validation))),
             config_.train.micro_batch_tokens * config_.train.grad_accum, config_.train.grad_accum,
             config_.train.micro_batch_tokens);
  // Data readers: bad input skipped in lenient mode, and this rank's share of the stream.
  if (config_.data.lenient) fmt::print("data: skipped bad input (data.lenient): {}\n", dataset_->skipped_summary());
  if (stream_->options().world_size > 1)
    fmt::print("data: rank {} of {} (the global stream's micro-batches {} mod {})\n", stream_->options().rank,
               stream_->options().world_size, stream_->options().rank, stream_->options().world_size);
  fmt::print("memory: parameters {:.1f} MiB, gradients {:.1f} MiB, optimizer {:.1f} MiB, activations {:.1f} MiB, "
             "workspace {:.1f} MiB | run directory {}\n",
             plan.parameters / 1048576.0, plan.gradients / 1048576.0, optimizer_state_.planned_bytes() / 1048576.0,
             plan.activations / 1048576.0, plan.workspace / 1048576.0, config_.train.out_dir);
  std::fflush(stdout);
}

Trainer::~Trainer() = default;

bool Trainer::step(int64_t step_index, StepMetrics& m) {
  // Token-exact accumulation: the loss of the whole step is the mean over all its target
  // tokens, so every micro-batch's gradient is scaled by 1 / (targets in the whole step).
  int64_t targets = 0;
  for (HostBatch& batch : micro_batches_) {
    stream_->next(batch);
    targets += batch.target_count;
    m.tokens += batch.size();
  }
  KILN_CHECK(targets > 0, "train", "step {} has no target tokens", step_index + 1);
  m.target_tokens = targets;
  // The schedule's position is the count of applied updates: a skipped step leaves it.
  m.lr = schedule_->lr(optimizer_->steps_taken());
  const double clip = config_.optim.grad_clip;

  if (device_step_) {  // GPU: scalars on the device, one read when the step has run
    DeviceStepPlan plan;
    plan.lr = m.lr;
    guard_.spike_limits(&plan.loss_limit, &plan.grad_limit);
    plan.clip = clip;
    plan.z_loss = config_.train.z_loss;
    const DeviceStepOutcome outcome = device_step_->run(micro_batches_, targets, plan);
    m.loss = outcome.loss;
    m.z = config_.train.z_loss > 0 ? outcome.z : 0;
    m.grad_norm = outcome.grad_norm;
    m.skipped = guard_.check(m.loss, m.grad_norm);
    // The device applied (or skipped) the update on its own copy of the guard's rules.
    KILN_CHECK(m.skipped.empty() == (outcome.verdict == ops::StepVerdict::apply), "train",
               "step {}: the device's guard verdict ({}) disagrees with the host's ('{}'): an internal error",
               m.step, static_cast<int>(outcome.verdict), m.skipped);
    if (!m.skipped.empty()) return skip_update(m);
    optimizer_->count_update();
    guard_.accept(m.loss, m.grad_norm);
    return true;
  }

  model_->zero_grads();
  double loss = 0, z = 0;
  for (const HostBatch& batch : micro_batches_) {
    model_->load_batch(batch);
    const ops::LossSums sums = model_->forward_backward(1.0 / static_cast<double>(targets), config_.train.z_loss);
    loss += sums.loss;
    z += sums.z;
  }
  m.loss = loss / static_cast<double>(targets);
  m.z = config_.train.z_loss > 0 ? z / static_cast<double>(targets) : 0;
  if (faults_.numeric()) inject_numeric_faults(faults_, m.step, m.loss, model_->parameters());  // tests only
  m.grad_norm = model_->gradient_norm();
  m.skipped = guard_.check(m.loss, m.grad_norm);
  if (!m.skipped.empty()) return skip_update(m);
  if (clip > 0 && m.grad_norm > clip) model_->scale_gradients(clip / (m.grad_norm + 1e-6));
  optimizer_->step(m.lr);
  guard_.accept(m.loss, m.grad_norm);
  return true;
}

bool Trainer::skip_update(const StepMetrics& m) {
  // Weights, optimizer state and schedule stay untouched.
  fmt::print("step {}: update skipped ({}); {} skipped in a row, {} in total\n", m.step, m.skipped,
             guard_.state().consecutive_skips + 1, guard_.state().total_skips + 1);
  metrics_->skip(m.step, m.skipped, m.loss, m.grad_norm);
  guard_.skip(m.step, m.skipped);  // throws after train.max_consecutive_skips in a row
  return false;
}

double Trainer::validate() {
  double loss = 0;
  int64_t count = 0;
  for (const HostBatch& batch : validation_) {
    model_->load_batch(batch);
    const ops::LossSums sums = model_->evaluate();
    loss += sums.loss;
    count += sums.count;
  }
  return count > 0 ? loss / static_cast<double>(count) : std::nan("");
}

std::string Trainer::sample(uint64_t seed) {
  SampleOptions o;
  o.max_tokens = config_.train.sample_tokens;
  o.temperature = config_.train.sample_temperature;
  o.top_k = config_.train.sample_top_k;
  o.seed = seed;
  return config_.train.sample_prompt + generate(*model_, *tokenizer_, config_.train.sample_prompt, o);
}

void Trainer::log_step(const StepMetrics& m) {
  const double tokens_per_second = static_cast<double>(m.tokens) / std::max(m.step_seconds, 1e-9);
  const double eta = m.elapsed_seconds / static_cast<double>(m.step) * static_cast<double>(m.total_steps - m.step);
  fmt::print("step {:>5}/{} | loss {:.4f} | lr {:.2e} | grad norm {:.3f} | {} tok/s | elapsed {} | eta {}\n", m.step,
             m.total_steps, m.loss, m.lr, m.grad_norm, human_count(tokens_per_second),
             format_duration(m.elapsed_seconds), format_duration(eta));
  std::fflush(stdout);
}

TrainResult Trainer::run() {
  const TrainConfig& t = config_.train;
  const StopSignals signals;  // SIGTERM/SIGINT: checkpoint at the next step boundary, exit 0
  const double start = now_seconds() - progress_.elapsed_seconds;  // a resumed run continues the clock
  TrainResult result;
  auto show_validation = [&](int64_t step) {
    const double val = validate();
    if (std::isnan(val)) return val;
    fmt::print("validation at step {}: loss {:.4f} nats/token ({:.4f} bits/byte)\n", step, val, val / std::log(2.0));
    metrics_->validation(step, val, now_seconds() - start);
    return val;
  };
  auto show_sample = [&](int64_t step) {
    const std::string text = sample(t.seed + static_cast<uint64_t>(step));
    fmt::print("sample at step {}:\n{}\n---\n", step, text);
    metrics_->sample(step, text);
  };

  // The log window (averaged over log.every steps) lives in progress_, so a resumed run
  // continues the same average; non-finite losses of skipped steps are left out of it.
  TrainProgress& p = progress_;
  double window_start = now_seconds();
  for (int64_t s = p.step; s < t.steps; ++s) {
    if (faults_.any()) inject_before_step(faults_, s + 1);  // tests only
    StepMetrics m;
    m.step = s + 1;
    m.total_steps = t.steps;
    step(s, m);
    m.skipped_total = guard_.state().total_skips;
    result.final_train_loss = m.loss;
    p.step = m.step;
    p.tokens += m.tokens;
    p.target_tokens += m.target_tokens;
    if (std::isfinite(m.loss)) {
      p.window_loss += m.loss;
      ++p.window_losses;
    }
    p.window_tokens += m.tokens;
    ++p.window_steps;
    if (m.step % config_.log.every == 0 || m.step == t.steps) {
      const double now = now_seconds();
      m.step_seconds = now - window_start;
      m.elapsed_seconds = now - start;
      m.tokens = p.window_tokens;
      m.loss = p.window_losses > 0 ? p.window_loss / static_cast<double>(p.window_losses) : std::nan("");
      log_step(m);
      metrics_->step(m);
      p.window_loss = 0;
      p.window_losses = p.window_steps = p.window_tokens = 0;
      window_start = now_seconds();
    }
    if (t.eval_every > 0 && m.step % t.eval_every == 0 && m.step != t.steps) show_validation(m.step);
    if (t.sample_every > 0 && m.step % t.sample_every == 0 && m.step != t.steps) show_sample(m.step);
    p.elapsed_seconds = now_seconds() - start;
    const int64_t every = config_.checkpoint.every;
    if (every > 0 && m.step % every == 0 && m.step != t.steps) save_checkpoint_or_warn(result);
    if (const int sig = signals.received()) {
      // Not subject to on_save_error: a stop whose state is not saved must fail loudly.
      if (checkpoint_step_ != p.step) result.checkpoint = save_checkpoint();
      fmt::print("stopped by {} after step {}; resume with: kiln train CONFIG --resume\n", StopSignals::name(sig),
                 p.step);
      result.steps = p.step;
      result.stopped_by = StopSignals::name(sig);
      result.skipped_steps = guard_.state().total_skips;
      result.seconds = now_seconds() - start;
      return result;
    }
    // Time spent validating, sampling and saving is not training throughput.
    if (p.window_steps == 0) window_start = now_seconds();
  }
  result.steps = t.steps;
  result.skipped_steps = guard_.state().total_skips;
  result.final_val_loss = show_validation(t.steps);
  show_sample(t.steps);
  if (config_.checkpoint.save_final) {
    const std::string dir = (fs::path(t.out_dir) / "model").string();
    io::save_model(*model_, config_, dir);
    if (!io::save_tokenizer_with_model(config_.data.tokenizer, dir))  // so the model dir stands alone
      warn("save", fmt::format("data.tokenizer '{}' is gone: the model in {} has no tokenizer.json",
                               config_.data.tokenizer, dir));
    fmt::print("saved model to {}\n", dir);
  }
  p.elapsed_seconds = now_seconds() - start;
  if (config_.checkpoint.every > 0 && checkpoint_step_ != p.step) save_checkpoint_or_warn(result);
  result.seconds = now_seconds() - start;
  fmt::print("done: {} steps in {} | final train loss {:.4f} | validation loss {:.4f}\n", t.steps,
             format_duration(result.seconds), result.final_train_loss, result.final_val_loss);
  return result;
}

}  // namespace kiln
