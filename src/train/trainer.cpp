#include "train/trainer.h"

#include "core/device_memory.h"
#include "core/peak_flops.h"
#include "core/process_memory.h"
#include "data/mixture.h"
#include "core/printable.h"
#include "io/durable_io.h"
#include "io/hf_config.h"
#include "io/hf_export.h"
#include "io/model_dir.h"
#include "io/model_io.h"
#include "nn/modules.h"
#include "nn/moe/router.h"
#include "nn/mup.h"
#include "ops/blas.h"
#include "ops/dropout/dropout_mask.h"
#include "ops/parallel.h"
#include "plot/plot.h"
#include "train/action_schedule.h"
#include "train/init_from.h"
#include "train/memory_check.h"
#include "train/optimizer_groups.h"
#include "train/run_paths.h"
#include "train/signals.h"
#include "train/tensorboard_log.h"
#include "train/training_data.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <thread>

namespace kiln {

namespace fs = std::filesystem;

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
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
  check(mixer_registry(), "model.attention", c.model.attention);
  if (!c.model.alt_attention.empty()) check(mixer_registry(), "model.alt_attention", c.model.alt_attention);
  check(mlp_registry(), "model.mlp", c.model.mlp);
  if (!c.model.alt_mlp.empty()) check(mlp_registry(), "model.alt_mlp", c.model.alt_mlp);
  check(position_registry(), "model.position", c.model.position);
  check(router_registry(), "model.moe.router", c.model.moe.router);
  check(schedule_registry(), "optim.schedule", c.optim.schedule);
}

// The resolved config's TOML with each key named in full and its help comment left out
// ("optim.lr = 0.001"), so a difference between ranks names its key.
std::string keyed_config_lines(const std::string& toml) {
  std::string out, section, line;
  std::istringstream in(toml);
  while (std::getline(in, line)) {
    if (line.starts_with('[')) {
      section = line.substr(1, line.find(']') - 1);
      continue;
    }
    if (line.empty() || line.starts_with('#')) continue;
    if (const size_t help = line.rfind("  # "); help != std::string::npos) line.resize(help);
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += (section.empty() ? "" : section + ".") + line + '\n';
  }
  return out;
}

}  // namespace

Trainer::Trainer(const Config& config, const TrainOptions& train_options)
    : config_(config),
      device_(resolve_device(config.train.device)),
      optimizer_state_("optimizer", device_),
      faults_(FaultInjector::from_env()),
      guard_(config.train),
      scaler_(config.train) {
  validate_config(config_);
  check_component_names(config_);  // before any data is read: config mistakes surface first
  check_run_paths(config_);        // no output over an input or another output
  io::ensure_writable_dir(config_.train.out_dir, "train.out_dir");  // before any work starts
  join_process_group();
  check_pipeline_config(config_, group_ ? group_->world_size() : 1, device_);
  if (writes_files()) {  // rank 0 owns the run directory: locked, and never another run's
    run_dir_ = std::make_unique<RunDirectory>(config_);
    if (train_options.resume.empty()) run_dir_->check_fresh_start(train_options.overwrite);
  }
  // train.threads = 0: this node's cores, shared by its ranks.
  const int local_ranks = group_ ? group_->placement().local_world_size : 1;
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency() / local_ranks);
  const int threads = set_cpu_threads(config_.train.threads > 0 ? config_.train.threads : cores);
  threads_ = threads;
  checkpoints_ = std::make_unique<CheckpointWriter>(config_, faults_);
  if (writes_files()) checkpoints_->prepare();  // an unusable checkpoint directory fails now, not at the first save

  // Found and verified (checksums, run, model and precision guards) before anything is
  // read or allocated; the process count may set train.grad_accum, which sizes the rest.
  const std::optional<CheckpointInfo> resume = find_resume_checkpoint(train_options);
  if (resume) keep_global_batch(*resume);
  // train.init_from: a fresh run's starting weights; a resumed run has its checkpoint's.
  std::optional<InitialWeights> initial;
  if (!resume) initial = find_initial_weights(config_);
  else if (!config_.train.init_from.empty())
    console_.print("resume: train.init_from ignored, the run continues from its checkpoint\n");

  tokenizer_ = training_tokenizer(config_);  // "byte" or a tokenizer.json, checked against model.vocab_size
  TrainingSampler::check_fits(config_, *tokenizer_);  // the sample's context, before any data is read
  eval::EvalSuite eval_suite = TrainingEvaluator::read_suite(config_.eval);  // a bad file costs no training
  dataset_ = std::make_unique<TokenDataset>(config_.data, *tokenizer_);
  // A pipeline's split is agreed before any model is built or planned: with
  // dist.pipeline_model = "stages" a rank builds only its stages' layers.
  BuildOptions build = training_build_options(config_, device_);
  std::vector<int64_t> pipeline_bounds;
  std::string pipeline_balance;
  if (pipelined(config_)) {
    pipeline_bounds = agree_pipeline_bounds(config_, group_->pipeline(), pipeline_balance);
    if (builds_stage_models(config_))
      build.layers = pipeline_rank_layers(config_, pipeline_bounds,
                                          pipeline_layout(config_, group_->world_size()).stage_of(group_->rank()));
  }
  // Before anything large is allocated (batches, arenas): stop now if it cannot fit.
  // ZeRO: this rank's shard of the optimizer state, the gather's buffer, ZeRO-2's gradients;
  // a stage's model sharded over the stage's replicas.
  const int zero_ranks = !group_                      ? 1
                         : builds_stage_models(config_) ? pipeline_layout(config_, group_->world_size()).replicas
                                                        : group_->world_size();
  const MemoryBudget budget = group_ ? plan_rank_memory(config_, device_, zero_ranks, build.layers)
                                     : plan_training_memory(config_, device_);
  check_memory_fits(config_, device_, budget, available_memory(device_));
  const Packer packer(packer_options(config_, *tokenizer_));
  // data.seed, rank sharding (data.rank/world_size or RANK/WORLD_SIZE) and data.prefetch.
  stream_ = std::make_unique<BatchStream>(*dataset_, Split::train, packer, pipeline_data_config(config_, group_ ? group_->rank() : 0, group_ ? group_->world_size() : 1));
  if (group_)  // the same documents, tokenizer and packing on every rank
    group_->require_same_as_root(fmt::format("{:016x}", stream_->get_state().fingerprint), "data fingerprint");
  if (config_.train.tokens > 0) {  // a token budget: the steps it takes
    const int64_t per_step = config_.train.micro_batch_tokens * micro_batches_per_step();
    config_.train.steps = (config_.train.tokens + per_step - 1) / per_step;
    console_.print("train.tokens {}: {} steps of {} tokens\n", config_.train.tokens, config_.train.steps, per_step);
  }
  validation_ = validation_batches(*dataset_, packer, config_.train.eval_batches, &validation_sources_);
  micro_batches_.resize(static_cast<size_t>(config_.train.grad_accum));

  model_ = std::make_unique<Model>(config_.model, build);
  model_->set_micro_batches(micro_batches_per_step());
  // A stage model's gradients are summed over the stage's replicas, consecutive ranks
  // (train/pipeline_layout.h), on a communicator of their own; ZeRO shards it over them.
  dist::Communicator* stage_replicas = nullptr;
  if (builds_stage_models(config_)) {
    const pipeline::Layout layout = pipeline_layout(config_, group_->world_size());
    if (layout.replicas > 1)
      stage_replicas = &group_->subgroup(layout.stage_of(group_->rank()) * layout.replicas, layout.replicas);
  }
  if (group_) {
    std::unique_ptr<ParameterShards> shards;  // ZeRO's, over every rank or a stage's replicas
    const int sharing = stage_replicas ? stage_replicas->world_size() : group_->world_size();
    if (config_.dist.zero > 0)
      shards = std::make_unique<ParameterShards>(
          make_parameter_shards(config_.optim, model_->parameters(), mup_width_ratio(config_.model), sharing));
    DataParallelOptions options;
    options.bucket_mb = config_.dist.bucket_mb;
    options.backward_buckets = !pipelined(config_);  // a pipeline's: one reduction after its schedule
    options.shard_gradients = config_.dist.zero >= 2;
    options.shard_ranks = config_.dist.zero > 0 ? stage_replicas : nullptr;
    data_parallel_ = std::make_unique<DataParallel>(*group_, *model_, options, std::move(shards));
  }
  // Periodic exports of a model with no stock class (a component refuses): say so now.
  // (A stage's model holds part of the layers: the export builds the whole from the checkpoint.)
  if ((config_.checkpoint.export_hf_every > 0 || config_.checkpoint.export_hf_every_tokens > 0) &&
      !builds_stage_models(config_))
    io::hf_config_json(*model_, io::choose_hf_arch(config_.model), io::HfSpecialTokens{}, "float32");
  optimizer_ = make_optimizer(model_->exec(), config_.optim, model_->parameters(), mup_width_ratio(config_.model),
                              data_parallel_ ? data_parallel_->shards() : nullptr,
                              data_parallel_ && data_parallel_->shards() ? data_parallel_->shard_rank() : 0);
  schedule_ = make_schedule(config_.optim, config_.train.steps,
                            config_.train.micro_batch_tokens * config_.train.grad_accum * stream_->options().world_size);
  optimizer_->plan(optimizer_state_);
  model_->allocate();
  optimizer_state_.allocate();
  if (resume) restore(*resume, train_options.allow_data_change);
  else if (initial) start_from(*initial);
  else model_->init_weights(config_.train.seed);
  // A stage's model cannot decode: with stage models rank 0 samples and evaluates on a whole
  // model of its own, an inference build whose weights are gathered from the stages first.
  Model* decoded = model_.get();
  if (builds_stage_models(config_) && (config_.train.sample_tokens > 0 || !eval_suite.empty())) {
    decoded = nullptr;
    if (writes_files()) {
      BuildOptions whole = training_build_options(config_, device_);
      whole.training = false;
      whole_model_ = std::make_unique<Model>(config_.model, whole);
      whole_model_->allocate();
      decoded = whole_model_.get();
    }
  }
  if (config_.train.sample_tokens > 0 && decoded)
    sampler_ = std::make_unique<TrainingSampler>(*decoded, *tokenizer_, config_.train);
  if (!eval_suite.empty() && decoded)
    evaluator_ = std::make_unique<TrainingEvaluator>(*decoded, *tokenizer_, config_.eval, std::move(eval_suite));
  // The captured step where it can run, unless test faults must be injected between its
  // phases (train/step_program.h).
  const StepExecution execution = faults_.numeric() ? StepExecution::op_by_op
                                                    : choose_step_execution(device_, config_.train.cuda_graphs, *optimizer_);
  step_ = std::make_unique<StepProgram>(*model_, *optimizer_, config_.train.grad_accum, execution, data_parallel_.get());
  if (pipelined(config_)) {
    // Its transfers on a Gloo context of their own (ProcessGroup::pipeline), apart from the
    // gradients' collectives.
    pipeline_ = std::make_unique<PipelineTrainerStep>(config_, *model_, group_->pipeline(), std::move(pipeline_bounds),
                                                      std::move(pipeline_balance));
    step_->set_micro_batch_runner([this](const auto& batches, double scale) { return pipeline_->run(batches, scale); });
    if (pipeline_->stage_models())
      data_parallel_->use_stage_gradients(pipeline_->stage_gradients(stage_replicas, config_.dist.zero >= 2));
  }

  if (writes_files()) {
    claim_run_directory(train_options);
    io::replace_file_atomically((fs::path(config_.train.out_dir) / "config.toml").string(), config_to_toml(config_),
                                "train");
  }
  if (writes_files()) {
    // A failed record write is handled as a failed save (checkpoint.on_save_error).
    const bool stop_on_error = config_.checkpoint.on_save_error == "stop";
    const std::string metrics_path = (fs::path(config_.train.out_dir) / config_.log.metrics_file).string();
    if (!resume) set_aside_earlier_metrics(metrics_path);
    records_.add(std::make_unique<MetricsLog>(metrics_path, stop_on_error));
    if (config_.log.tensorboard) {
      const std::string dir = (fs::path(config_.train.out_dir) / config_.log.tensorboard_dir).string();
      records_.add(std::make_unique<TensorBoardLog>(prepare_tensorboard_dir(dir, resume.has_value()),
                                                    progress_.step + 1, stop_on_error));
    }
  }
  if (resume) {
    records_.resume(progress_.step, resume->path);
    console_.print("resumed from {} at step {}\n", resume->path, progress_.step);
  }

  const MemoryPlan plan = model_->memory_plan();
  const std::string precision = model_->options().recipe().describe();
  const std::string device = device_ == Device::cuda
                                 ? fmt::format("cuda ({}, {}, {})", cuda_device_name(), precision,
                                               step_execution_name(step_->execution()))
                                 : fmt::format("cpu ({} threads, {}, {})", threads, precision, blas_summary());
  console_.print("kiln {} | device {} | model {}: {} parameters, {} layers, hidden {}\n", KILN_VERSION, device,
                 config_.model.name, human_count(static_cast<double>(model_->parameter_count())), config_.model.layers,
                 config_.model.hidden);
  // A mixture is named by its sources and their shares of the documents drawn.
  std::string data_name = config_.data.path;
  if (!config_.data.sources.empty()) {
    double total = 0;
    for (const DataSource& s : config_.data.sources) total += s.weight;
    data_name = "mixture";
    for (const DataSource& s : config_.data.sources)
      data_name += fmt::format(" {} {:.3g}%", source_name(s), 100.0 * s.weight / total);
  }
  console_.print("data {}: {} train / {} validation documents ({} / {} tokens) | {} tokens per step ({} x {})\n",
                 data_name, dataset_->num_documents(Split::train), dataset_->num_documents(Split::validation),
                 human_count(static_cast<double>(dataset_->num_tokens(Split::train))),
                 human_count(static_cast<double>(dataset_->num_tokens(Split::validation))),
                 config_.train.micro_batch_tokens * micro_batches_per_step(), micro_batches_per_step(),
                 config_.train.micro_batch_tokens);
  // Data readers: bad input skipped in lenient mode, and this rank's share of the stream.
  if (config_.data.lenient) console_.print("data: skipped bad input (data.lenient): {}\n", dataset_->skipped_summary());
  if (group_)
    console_.print("distributed: {} ranks ({} launch, {} per node), gradients over {}, {} | this is rank {}\n",
                   group_->world_size(), group_->placement().convention, group_->placement().local_world_size,
                   group_->device().backend(),
                   config_.dist.bucket_mb > 0 && !pipeline_
                       ? fmt::format("in buckets of {} MiB during backward", config_.dist.bucket_mb)
                       : std::string("in one reduction after backward"),
                   group_->rank());
  if (pipeline_) console_.print("{}\n", pipeline_->describe());
  if (stream_->options().world_size > 1)
    console_.print("data: rank {} of {} (the global stream's micro-batches {} mod {})\n", stream_->options().rank,
                   stream_->options().world_size, stream_->options().rank, stream_->options().world_size);
  console_.print("memory: parameters {:.1f} MiB, gradients {:.1f} MiB, optimizer {:.1f} MiB, activations {:.1f} MiB, "
                 "workspace {:.1f} MiB | run directory {}\n",
                 plan.parameters / 1048576.0, plan.gradients / 1048576.0, optimizer_state_.planned_bytes() / 1048576.0,
                 plan.activations / 1048576.0, plan.workspace / 1048576.0, config_.train.out_dir);
  for (const std::string& line :
       describe_groups(group_parameters(config_.optim, model_->parameters(), mup_width_ratio(config_.model)),
                       config_.optim.lr))
    console_.print("optimizer: {}\n", line);
  if (data_parallel_ && data_parallel_->shards()) {  // ZeRO: this rank's share, measured above
    const ParameterShards& shards = *data_parallel_->shards();
    const int r = data_parallel_->shard_rank();
    console_.print("ZeRO-{}: rank {} updates {} of {} parameters{} and keeps their state ({:.1f} MiB); "
                   "all-gather buffer {:.1f} MiB{}\n",
                   config_.dist.zero, group_->rank(), shards.bound(r + 1) - shards.bound(r), shards.total(),
                   pipeline_ && pipeline_->stage_models()
                       ? fmt::format(" (its stage's, shard {} of {} over the stage's replicas)", r, shards.world_size())
                       : std::string(),
                   optimizer_state_.planned_bytes() / 1048576.0, data_parallel_->gather_buffer_bytes() / 1048576.0,
                   data_parallel_->shards_gradients() ? "; gradients reduce-scattered through it" : "");
  }
  if (config_.optim.qk_clip.enabled) {
    // Only the layers whose token mixer has query-key logits clip (TokenMixer::clips_qk).
    const auto& blocks = model_->backbone().blocks();
    // (A stage's model holds null for the blocks of other stages: the count is its own.)
    const auto clipped =
        std::count_if(blocks.begin(), blocks.end(), [](const auto& b) { return b && b->mixer().clips_qk(); });
    const std::string where = clipped == static_cast<std::ptrdiff_t>(blocks.size())
                                  ? ""
                                  : fmt::format(" on {} of {} layers (the others' token mixers have no logits)",
                                                clipped, blocks.size());
    console_.print("qk-clip: tau {}{} (each head's largest attention logit, clipped after each update)\n",
                   config_.optim.qk_clip.tau, where);
  }
  std::fflush(stdout);
}

Trainer::~Trainer() = default;

bool Trainer::step(int64_t step_index, StepMetrics& m) {
  // Token-exact accumulation: the loss of the whole step is the mean over all its target
  // tokens, so every micro-batch's gradient is scaled by 1 / (targets in the whole step).
  int64_t targets = 0;
  const int64_t rank = data_rank();
  for (size_t i = 0; i < micro_batches_.size(); ++i) {
    HostBatch& batch = micro_batches_[i];
    stream_->next(batch);
    batch.dropout_key = dropout::stream_key(config_.train.seed, step_index, static_cast<int64_t>(i), rank);
    targets += batch.target_count;
    m.tokens += batch.size();
    m.document_tokens += batch.document_tokens;
  }
  if (data_ranks() > 1) {  // the step's tokens over every rank
    int64_t counts[2] = {targets, m.document_tokens};
    data_parallel_->sum_counts(counts, 2);
    // Summed over every rank: a pipeline's counts once per stage of each replica.
    const int64_t readers = data_parallel_->world_size() / data_ranks();
    targets = counts[0] / readers;
    m.document_tokens = counts[1] / readers;
    m.tokens *= data_ranks();  // the packer fills every micro-batch: equal on every rank
  }
  KILN_CHECK(targets > 0, "train", "step {} has no target tokens", step_index + 1);
  m.target_tokens = targets;
  // The schedule's position is the count of applied updates: a skipped step leaves it.
  m.lr = schedule_->lr(optimizer_->steps_taken());
  StepPlan plan;
  plan.lr = m.lr;
  guard_.spike_limits(&plan.loss_limit, &plan.grad_limit);
  plan.clip = config_.optim.grad_clip;
  plan.loss_scale = scaler_.scale();
  if (scaler_.enabled()) m.loss_scale = plan.loss_scale;
  if (faults_.numeric())  // tests only
    step_->set_fault_hook([&](double& loss) { inject_numeric_faults(model_->exec(), faults_, m.step, loss, model_->parameters()); });
  const StepOutcome outcome = step_->run(micro_batches_, targets, plan);
  m.loss = outcome.loss;
  m.terms = reported_terms(outcome.step_sums, targets);
  m.grad_norm = outcome.grad_norm;
  // The step reached its verdict with the guard's rules (ops/optim/step_rules.h) and the
  // limits above, and applied or skipped the update by it: the guard only words it here.
  m.skipped = guard_.reason(outcome.verdict, m.loss, m.grad_norm);
  if (scaler_.after_step(outcome.verdict)) {  // an overflow of the loss scale: not a fault
    m.skipped = fmt::format("gradient overflow at loss scale {}; the scale is now {}", plan.loss_scale, scaler_.scale());
    console_.print("step {}: update skipped ({})\n", m.step, m.skipped);
    records_.skip(m.step, m.skipped, m.loss, m.grad_norm);
    return false;
  }
  if (!m.skipped.empty()) return skip_update(m);
  guard_.accept(m.loss, m.grad_norm);
  return true;
}

bool Trainer::skip_update(const StepMetrics& m) {
  // Weights, optimizer state and schedule stay untouched.
  console_.print("step {}: update skipped ({}); {} skipped in a row, {} in total\n", m.step, m.skipped,
                 guard_.state().consecutive_skips + 1, guard_.state().total_skips + 1);
  records_.skip(m.step, m.skipped, m.loss, m.grad_norm);
  guard_.skip(m.step, m.skipped);  // throws after train.max_consecutive_skips in a row
  return false;
}

double Trainer::validate() {
  double loss = 0;
  int64_t count = 0;
  if (faults_.any()) inject_eval_faults(faults_, "validation", true);  // tests only
  // Several ranks: each evaluates its share of the batches (i mod world_size), then the
  // sums are added.
  // A pipeline of stage models runs each batch through its stages: every rank of the
  // replica takes the replica's share, the last stage's rank adds its losses.
  const bool through_stages = pipeline_ && pipeline_->stage_models();
  const size_t ranks = through_stages   ? static_cast<size_t>(data_ranks())
                       : data_parallel_ ? static_cast<size_t>(data_parallel_->world_size())
                                        : 1;
  const size_t rank = through_stages   ? static_cast<size_t>(data_rank())
                      : data_parallel_ ? static_cast<size_t>(data_parallel_->rank())
                                       : 0;
  // A mixture: (loss, count) per source too, each batch holding one source's documents.
  const std::vector<DataSource>& sources = config_.data.sources;
  std::vector<double> per_source(validation_sources_.empty() ? 0 : 2 * sources.size(), 0.0);
  for (size_t i = rank; i < validation_.size(); i += ranks) {
    if (faults_.any()) inject_eval_faults(faults_, "validation", false);
    if (stop_requested()) return std::nan("");  // polled per batch: a stop does not wait for the pass
    LossSums sums;
    if (through_stages) {
      sums = pipeline_->evaluate(validation_[i]);
    } else {
      model_->load_batch(validation_[i]);
      sums = model_->evaluate();
    }
    loss += sums.loss;
    count += sums.count;
    if (!per_source.empty()) {
      per_source[2 * static_cast<size_t>(validation_sources_[i])] += sums.loss;
      per_source[2 * static_cast<size_t>(validation_sources_[i]) + 1] += static_cast<double>(sums.count);
    }
  }
  if (data_parallel_) {
    double totals[2] = {loss, static_cast<double>(count)};
    data_parallel_->sum(totals, 2, Device::cpu);
    loss = totals[0];
    count = static_cast<int64_t>(totals[1]);
    if (!per_source.empty()) data_parallel_->sum(per_source.data(), static_cast<int64_t>(per_source.size()), Device::cpu);
  }
  source_validation_.clear();
  for (size_t s = 0; 2 * s < per_source.size(); ++s) {
    if (per_source[2 * s + 1] <= 0) continue;
    // Two sources may share a name (dir1/train.jsonl, dir2/train.jsonl): their index tells them apart.
    std::string name = source_name(sources[s]);
    for (size_t t = 0; t < sources.size(); ++t)
      if (t != s && source_name(sources[t]) == name) name = fmt::format("{}[{}]", name, s);
    if (name == "kind" || name == "step") name = fmt::format("{}[{}]", name, s);  // the record's own keys
    source_validation_.emplace_back(name, per_source[2 * s] / per_source[2 * s + 1]);
  }
  if (faults_.has("nan_validation", "all")) return std::nan("");  // tests only
  return count > 0 ? loss / static_cast<double>(count) : std::nan("");
}

void Trainer::gather_whole_model() {
  if (!pipeline_ || !pipeline_->stage_models()) return;
  const std::vector<GatheredWeight> others = pipeline_->gather_weights();
  if (whole_model_) load_stage_weights(*whole_model_, *model_, others);
}

std::optional<std::string> Trainer::sample(uint64_t seed) {
  if (config_.train.sample_tokens > 0) gather_whole_model();
  if (!sampler_) return std::nullopt;
  if (faults_.any()) inject_eval_faults(faults_, "sample", true);  // tests only
  return sampler_->sample(seed, [this] {
    if (faults_.any()) inject_eval_faults(faults_, "sample", false);
    return stop_requested();  // polled per token: a stop does not wait for the sample
  });
}

// The reported loss terms beyond the main loss (slot 0), each its step value (a mean per
// target token or per micro-batch, nn/loss_terms.h).
std::vector<std::pair<std::string, double>> Trainer::reported_terms(const LossSlotSums& sums, int64_t targets) const {
  std::vector<std::pair<std::string, double>> out;
  const std::vector<LossTerm>& slots = model_->loss_terms().slots();
  for (size_t k = 1; k < slots.size(); ++k)
    if (slots[k].reported)
      out.emplace_back(slots[k].name, model_->loss_terms().value(static_cast<int>(k), sums, targets,
                                                                 micro_batches_per_step()));
  return out;
}

void Trainer::log_step(const StepMetrics& m) {
  const double tokens_per_second = m.tokens_per_second(), real_per_second = m.document_tokens_per_second();
  const double eta = m.elapsed_seconds / static_cast<double>(m.step) * static_cast<double>(m.total_steps - m.step);
  std::string terms;
  for (const auto& [name, value] : m.terms) terms += fmt::format(" | {} {:.4g}", name, value);
  // Sparse layers: the busiest expert's load over the mean, and the experts without a token.
  double load_max = 0, dead = 0;
  bool sparse = false;
  for (const auto& [name, value] : m.components) {
    if (name.ends_with(".load_max")) load_max = std::max(load_max, value), sparse = true;
    if (name.ends_with(".dead")) dead += value;
  }
  if (sparse) terms += fmt::format(" | experts max load {:.2f}x dead {}", load_max, dead);
  // QK-Clip: the largest attention logit of the step over every layer and head, and the
  // heads clipped.
  double max_logit = -INFINITY, clipped = 0;
  for (const auto& [name, value] : m.components) {
    if (name.ends_with(".max_logit")) max_logit = std::max(max_logit, value);
    if (name.ends_with(".clipped")) clipped += value;
  }
  if (std::isfinite(max_logit)) terms += fmt::format(" | max logit {:.1f} clipped {}", max_logit, clipped);
  // Computed positions per second, and of them the documents' (PAD left out) when they differ.
  const std::string real = m.document_tokens < m.tokens ? fmt::format(" ({} real)", human_count(real_per_second)) : "";
  console_.print("step {:>5}/{} | loss {:.4f}{} | lr {:.2e} | grad norm {:.3f} | {} tok/s{} | elapsed {} | eta {}\n",
                 m.step, m.total_steps, m.loss, terms, m.lr, m.grad_norm, human_count(tokens_per_second), real,
                 format_duration(m.elapsed_seconds), format_duration(eta));
  std::fflush(stdout);
}

int Trainer::stop_signal() const {
  if (group_) return agreed_signal_;
  return signals_ != nullptr ? signals_->received() : 0;
}

bool Trainer::stop_requested() const { return stop_signal() != 0; }

void Trainer::show_progress(const StepMetrics& m, double step_seconds, double elapsed) {
  const double per_second = static_cast<double>(m.tokens) / std::max(step_seconds, 1e-9);
  std::string line = fmt::format("step {}/{} | loss {:.4f}", m.step, m.total_steps, m.loss);
  if (std::isfinite(last_validation_)) line += fmt::format(" | val {:.4f}", last_validation_);
  line += fmt::format(" | {} tok/s", human_count(per_second));
  if (const double utilization = mfu(per_second); std::isfinite(utilization))
    line += fmt::format(" | MFU {:.1f}%", 100 * utilization);
  const double eta = elapsed / static_cast<double>(m.step) * static_cast<double>(m.total_steps - m.step);
  line += fmt::format(" | elapsed {} | eta {}", format_duration(elapsed), format_duration(eta));
  console_.progress(line);
  last_progress_ = ProgressPoint{m, step_seconds, elapsed};
}

double Trainer::mfu(double tokens_per_second) const {
  if (device_ != Device::cuda) return std::nan("");
  // Model FLOPs against the bf16 peak (kiln bench's MFU), per GPU.
  return model_->flops_per_token(config_.model.max_seq_len) * tokens_per_second / kGpuPeakFlops /
         (group_ ? group_->world_size() : 1);
}

int64_t Trainer::device_memory_used_bytes() const {
  if (device_ != Device::cuda) return 0;
  size_t free_bytes = 0, total_bytes = 0;
  cuda_memory_info(&free_bytes, &total_bytes);
  return static_cast<int64_t>(total_bytes - free_bytes);
}

int Trainer::agree_on_stop() {
  const int local = signals_ != nullptr ? signals_->received() : 0;
  agreed_signal_ = data_parallel_ ? data_parallel_->agree_on_stop(local) : local;
  return agreed_signal_;
}

void Trainer::join_process_group() {
  const std::optional<dist::ProcessPlacement> placement = dist::process_placement();
  if (!placement) return;
  KILN_CHECK(config_.data.world_size == 0, "data.world_size",
             "must be 0 in a {} launch of {} ranks: the data's ranks are the launcher's", placement->convention,
             placement->world_size);
  group_ = std::make_unique<dist::ProcessGroup>(*placement, device_, dist::collective_timeout(config_.dist.timeout));
  if (!group_->is_root()) {
    // The other ranks' console goes to a file of their own: one progress log, rank 0's.
    const std::string log = (fs::path(config_.train.out_dir) / fmt::format("rank-{}.log", group_->rank())).string();
    std::fflush(stdout);
    KILN_CHECK(std::freopen(log.c_str(), "w", stdout) != nullptr, "train.out_dir", "{}: cannot write: {}", log,
               std::strerror(errno));
    console_ = Console();  // a file now: plain lines
  }
  group_->require_same_as_root(keyed_config_lines(config_to_toml(config_)), "config");
}

double Trainer::show_validation(int64_t step) {
  const double val = validate();
  // A diverged model's loss is NaN too, and is shown and recorded: only a stop or an empty
  // validation set go unshown.
  if (stop_requested() || validation_.empty()) return std::nan("");
  console_.print("validation at step {}: loss {:.4f} nats/token ({:.4f} bits/byte)\n", step, val, val / std::log(2.0));
  std::fflush(stdout);  // a log read while the run goes on sees it now
  records_.validation(step, val, now_seconds() - run_start_);
  if (!source_validation_.empty()) {
    std::string parts;
    for (const auto& [name, loss] : source_validation_) parts += fmt::format("{}{} {:.4f}", parts.empty() ? "" : ", ", name, loss);
    console_.print("validation at step {} per source: {}\n", step, parts);
    records_.scalars(step, "validation_sources", source_validation_);
  }
  best_validation_.offer(val, step);
  last_validation_ = val;
  // The line shows the new "val" now, not at the next step (after the last step, never).
  if (console_.live() && last_progress_) {
    const ProgressPoint p = *last_progress_;
    show_progress(p.metrics, p.step_seconds, p.elapsed);
  }
  return val;
}

void Trainer::show_eval(int64_t step) {
  if (!config_.eval.tasks.empty() || !config_.eval.texts.empty()) gather_whole_model();
  if (!evaluator_) return;
  const std::optional<eval::EvalResults> results = evaluator_->evaluate([this] { return stop_requested(); });
  if (!results) return;
  console_.print("evaluation at step {} ({:.1f} s):\n{}", step, results->seconds, eval::format_eval_table(*results));
  std::fflush(stdout);
  NamedValues values = eval::eval_scalars(*results);
  values.emplace_back("seconds", results->seconds);
  records_.scalars(step, "eval", values);
}

void Trainer::show_sample(int64_t step) {
  const std::optional<std::string> text = sample(config_.train.seed + static_cast<uint64_t>(step));
  if (!text) return;
  console_.print("sample at step {}:\n{}\n---\n", step, *text);
  std::fflush(stdout);
  records_.sample(step, *text);
}

TrainResult Trainer::run() {
  const TrainConfig& t = config_.train;
  const StopSignals signals;  // SIGTERM/SIGINT: checkpoint at the next step boundary, exit 0
  signals_ = &signals;
  struct Uninstall {
    const StopSignals*& signals;
    Console& console;
    ~Uninstall() {
      signals = nullptr;
      console.finish_line();  // what follows the run (an error too) starts on a line of its own
    }
  } uninstall{signals_, console_};
  run_start_ = now_seconds() - progress_.elapsed_seconds;  // a resumed run continues the clock
  this_run_start_ = now_seconds();
  tokens_before_run_ = progress_.tokens;
  document_tokens_before_run_ = progress_.document_tokens;
  const double start = run_start_;
  TrainResult result;

  // The log window (averaged over log.every steps) lives in progress_, so a resumed run
  // continues the same average; non-finite losses of skipped steps are left out of it.
  TrainProgress& p = progress_;
  double window_start = now_seconds();
  StepMetrics m;  // the step just run, as the actions see it

  // The periodic actions, in the order they run after a step. Only the log runs after the
  // last step too; the end of the run saves, validates and samples (finish()).
  ActionSchedule actions;
  actions.add("log", {config_.log.every, config_.log.every_tokens, true}, [&](const StepSpan&) {
    StepMetrics w = m;  // the window's averages, recorded at this step
    const double now = now_seconds();
    w.step_seconds = now - window_start;
    w.elapsed_seconds = now - start;
    w.tokens = p.window_tokens;
    w.document_tokens = p.window_document_tokens;
    w.loss = p.window_losses > 0 ? p.window_loss / static_cast<double>(p.window_losses) : std::nan("");
    // Of this step; a pipeline of stage models brings every stage's to rank 0.
    w.components = pipeline_ ? pipeline_->component_metrics() : model_->component_metrics();
    w.window_steps = p.window_steps;
    w.mfu = mfu(w.tokens_per_second());
    w.device_memory_used_bytes = device_memory_used_bytes();
    w.host_peak_rss_bytes = host_peak_rss_bytes();
    log_step(w);
    records_.step(w);
    p.window_loss = 0;
    p.window_losses = p.window_steps = p.window_tokens = p.window_document_tokens = 0;
    window_start = now_seconds();
  });
  actions.add("validation", {t.eval_every, t.eval_every_tokens}, [&](const StepSpan& span) {
    show_validation(span.step);
    keep_if_best(span.step, result);
  });
  actions.add("sample", {t.sample_every, t.sample_every_tokens}, [&](const StepSpan& span) { show_sample(span.step); });
  actions.add("eval", {config_.eval.every, config_.eval.every_tokens}, [&](const StepSpan& span) { show_eval(span.step); });
  actions.add("checkpoint", {config_.checkpoint.every, config_.checkpoint.every_tokens},
              [&](const StepSpan&) { save_checkpoint_or_warn(result); });
  const Cadence export_cadence{config_.checkpoint.export_hf_every, config_.checkpoint.export_hf_every_tokens};
  actions.add("export", export_cadence, [&](const StepSpan& span) { export_hf_at(span.step, result); });
  // What finish() asks of the last step: a resumed run that has no step left crossed nothing.
  StepSpan last{p.step, t.steps, p.tokens, p.tokens};

  for (int64_t s = p.step; s < t.steps; ++s) {
    if (faults_.any()) inject_before_step(faults_, s + 1);  // tests only
    m = StepMetrics{};
    m.step = s + 1;
    m.total_steps = t.steps;
    const double step_start = now_seconds();
    step(s, m);
    if (console_.live()) show_progress(m, now_seconds() - step_start, now_seconds() - start);
    m.skipped_total = guard_.state().total_skips;
    result.final_train_loss = m.loss;
    const StepSpan span{m.step, t.steps, p.tokens, p.tokens + m.tokens};
    p.step = m.step;
    p.tokens += m.tokens;
    p.target_tokens += m.target_tokens;
    p.document_tokens += m.document_tokens;
    if (std::isfinite(m.loss)) {
      p.window_loss += m.loss;
      ++p.window_losses;
    }
    p.window_tokens += m.tokens;
    p.window_document_tokens += m.document_tokens;
    ++p.window_steps;
    actions.run_due(span);
    last = span;
    if (span.last()) break;  // the last step: finish() saves, whatever arrived meanwhile
    if (const int sig = agree_on_stop()) {
      // Not subject to on_save_error: a stop whose state is not saved must fail loudly.
      if (checkpoint_step_ != p.step) result.checkpoint = save_checkpoint();
      console_.print("stopped by {} after step {}; resume with: kiln train CONFIG --resume\n", StopSignals::name(sig),
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
  finish(result, export_cadence.crossed(last));
  return result;
}

// checkpoint.keep_best: when the validation of `step` was the best so far, its checkpoint
// (saved now unless one of this step exists) becomes DIR/best.
void Trainer::keep_if_best(int64_t step, TrainResult& result) {
  if (!config_.checkpoint.keep_best || best_validation_.step != step || std::isnan(best_validation_.loss)) return;
  if (checkpoint_step_ != step) save_checkpoint_or_warn(result);
  if (checkpoint_step_ != step) return;  // the save failed (and warned)
  if (!writes_files()) return;
  checkpoints_->mark_best(step);
  console_.print("checkpoint: step {} is the best so far (validation loss {:.4f}): kept as {}/best\n", step,
                 best_validation_.loss, checkpoints_->root());
}

void Trainer::export_hf_at(int64_t step, TrainResult& result) {
  if (checkpoint_step_ != step) save_checkpoint_or_warn(result);
  if (checkpoint_step_ != step || !writes_files()) return;  // the save failed (and warned), or rank 0 exports
  const std::string dir = (fs::path(config_.train.out_dir) / "hf" / fmt::format("step-{}", step)).string();
  try {
    const io::HfExportReport report =
        io::export_hf((fs::path(checkpoints_->root()) / checkpoint_name(step)).string(), dir, io::HfExportOptions{});
    console_.print("export: step {} as {} ({} tensors) in {}\n", step, io::hf_architecture(report.arch),
                   report.tensors, dir);
  } catch (const Error& e) {
    console_.warn("export", fmt::format("step {}: Hugging Face export failed: {}", step, e.what()));
  }
}

// summary.json (and plot.png, log.plot): written after the end-of-run validation, also when
// a signal cut that short (then stopped_by says so); a failed write is a warning, the run's
// results stand.
void Trainer::write_summary(const TrainResult& result) const {
  if (!writes_files()) return;
  RunSummary s;
  s.steps = progress_.step;
  s.total_steps = config_.train.steps;
  s.tokens = progress_.tokens;
  s.target_tokens = progress_.target_tokens;
  s.document_tokens = progress_.document_tokens;
  s.seconds = now_seconds() - this_run_start_;
  s.elapsed_seconds = result.seconds;
  s.tokens_per_second = s.seconds > 0 ? static_cast<double>(progress_.tokens - tokens_before_run_) / s.seconds : 0;
  s.document_tokens_per_second =
      s.seconds > 0 ? static_cast<double>(progress_.document_tokens - document_tokens_before_run_) / s.seconds : 0;
  s.final_train_loss = result.final_train_loss;
  s.final_validation_loss = result.final_val_loss;
  s.best = best_validation_;
  s.skipped_steps = result.skipped_steps;
  s.stopped_by = result.stopped_by;
  const std::string path = (fs::path(config_.train.out_dir) / "summary.json").string();
  try {
    write_run_summary(path, s);
  } catch (const std::exception& e) {
    console_.warn("train", fmt::format("{}: not written: {}", path, e.what()));
  }
  if (!config_.log.plot) return;
  const std::string out_dir = config_.train.out_dir, image = (fs::path(out_dir) / "plot.png").string();
  try {
    plot::write_run_plot((fs::path(out_dir) / config_.log.metrics_file).string(), plot::run_label(out_dir), image);
  } catch (const std::exception& e) {
    console_.warn("plot", fmt::format("{}: not drawn: {}", image, e.what()));
  }
}

void Trainer::finish(TrainResult& result, bool export_due) {
  const TrainConfig& t = config_.train;
  TrainProgress& p = progress_;
  result.steps = p.step;
  result.skipped_steps = guard_.state().total_skips;
  // The run's results first: whatever happens after this (a signal, a failing sample) is
  // the end-of-run report only.
  p.elapsed_seconds = now_seconds() - run_start_;
  agree_on_stop();
  // A pipeline of stage models: the other stages' weights to rank 0 (every rank takes part).
  std::vector<GatheredWeight> other_stages;
  if (config_.checkpoint.save_final && pipeline_ && pipeline_->stage_models()) other_stages = pipeline_->gather_weights();
  if (config_.checkpoint.save_final && writes_files()) {
    const std::string dir = (fs::path(t.out_dir) / "model").string();
    io::save_model(*model_, config_, dir,
                   [&](io::SafetensorsWriter& writer) { add_gathered_weights(writer, other_stages); });
    if (!io::save_tokenizer_with_model(config_.data.tokenizer, dir))  // so the model dir stands alone
      console_.warn("save", fmt::format("data.tokenizer '{}' is gone: the model in {} has no tokenizer.json",
                                        config_.data.tokenizer, dir));
    console_.print("saved model to {}\n", dir);
  }
  if ((config_.checkpoint.every > 0 || config_.checkpoint.every_tokens > 0) && checkpoint_step_ != p.step) {
    // A stop requested meanwhile makes a failed save an error, as on the loop's stop path.
    if (stop_requested()) result.checkpoint = save_checkpoint();
    else save_checkpoint_or_warn(result);
  }
  if (export_due) export_hf_at(p.step, result);
  const bool model_saved = config_.checkpoint.save_final, checkpoint_saved = checkpoint_step_ == p.step;
  const std::string saved = model_saved && checkpoint_saved ? "the model and the final checkpoint were"
                            : model_saved                   ? "the model was"
                            : checkpoint_saved              ? "the final checkpoint was"
                                                            : "nothing was to be";
  // Each part on its own: a failure (an internal error too) is a warning, the saved run stands.
  auto report = [&](auto&& work) {
    if (stop_requested()) return;
    try {
      work();
    } catch (const std::exception& e) {
      console_.warn("train", fmt::format("after the last step: {}; {} saved before it", e.what(), saved));
    }
  };
  result.final_val_loss = std::nan("");
  bool validated = false;  // NaN alone cannot tell a failed validation from a diverged model
  report([&] {
    result.final_val_loss = show_validation(p.step);
    validated = !validation_.empty();
    keep_if_best(p.step, result);
  });
  report([&] { show_sample(p.step); });
  report([&] { show_eval(p.step); });
  result.seconds = now_seconds() - run_start_;
  if (const int sig = stop_signal()) {
    result.stopped_by = StopSignals::name(sig);
    write_summary(result);
    console_.print("stopped by {} after the last step ({}), in the end-of-run validation and sample; {} saved before "
                   "them\n",
                   result.stopped_by, p.step, saved);
    return;
  }
  write_summary(result);
  if (const auto held = data_parallel_ ? data_parallel_->gradient_memory() : std::nullopt)  // ZeRO-2, measured
    console_.print("ZeRO-2: rank {} held at most {:.3f} MiB of its {:.3f} MiB gradient arena in memory "
                   "(its shard's pages: {:.3f} MiB)\n",
                   group_->rank(), held->peak_resident / 1048576.0, held->arena / 1048576.0, held->shard_pages / 1048576.0);
  const std::string validation = validation_.empty()                  ? std::string("no validation set")
                                 : !validated ? std::string("no validation loss")
                                                                     : fmt::format("validation loss {:.4f}",
                                                                                   result.final_val_loss);
  console_.print("done: {} steps in {} | final train loss {:.4f} | {}\n", p.step, format_duration(result.seconds),
                 result.final_train_loss, validation);
}

}  // namespace kiln
