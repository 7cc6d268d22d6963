#include "train/checkpoint.h"

#include "core/checksum.h"
#include "core/device_memory.h"
#include "core/printable.h"
#include "core/small_file.h"
#include "dist/communicator.h"
#include "io/checkpoint_manifest.h"
#include "io/durable_io.h"
#include "io/model_dir.h"
#include "io/model_io.h"
#include "io/safetensors.h"
#include "train/optimizer_shard_files.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <unistd.h>

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::string_view kWhere = "checkpoint";
// `latest` holds "step-NNNNNNNN\n"; anything much longer is not one.
constexpr size_t kMaxLatestBytes = 4096;
// Every checkpoint's files; besides, the optimizer's state: kWholeOptimizer, or a ZeRO run's
// shard files (train/optimizer_shard_files.h), which the manifest counts.
constexpr const char* kFiles[] = {"model.safetensors", "config.toml", "state.json"};
constexpr const char* kWholeOptimizer = "optimizer.safetensors";
// Besides: a trained tokenizer's files (io::kTokenizerFiles), when the run has one, so the
// checkpoint, itself a model directory, stands alone; listed and checksummed like the rest
// (readers that predate them check kFiles only).

std::string join_path(const std::string& dir, std::string_view name) { return (fs::path(dir) / name).string(); }

// step-N -> N; -1 for any other name.
// Rank `root`'s `text` on every rank (host collectives).
std::string broadcast_text(dist::Communicator& comm, int root, const std::string& text) {
  int64_t size = comm.rank() == root ? static_cast<int64_t>(text.size()) : 0;
  comm.broadcast(&size, sizeof(size), root, "checkpoint save");
  std::string out = comm.rank() == root ? text : std::string(static_cast<size_t>(size), '\0');
  if (size > 0) comm.broadcast(out.data(), size, root, "checkpoint save");
  return out;
}

int64_t step_of(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return -1;
  int64_t step = -1;
  const auto [ptr, ec] = std::from_chars(name.data() + 5, name.data() + name.size(), step);
  return ec == std::errc() && ptr == name.data() + name.size() ? step : -1;
}

}  // namespace

std::string checkpoint_root(const Config& config) {
  return config.checkpoint.dir.empty() ? join_path(config.train.out_dir, "checkpoints") : config.checkpoint.dir;
}

std::string checkpoint_name(int64_t step) { return fmt::format("step-{:08}", step); }

CheckpointWriter::CheckpointWriter(const Config& config, const FaultInjector& faults)
    : root_(checkpoint_root(config)),
      optimizer_name_(config.optim.name),
      tokenizer_(config.data.tokenizer),
      keep_last_(config.checkpoint.keep_last),
      keep_every_(config.checkpoint.keep_every),
      faults_(faults) {}

void CheckpointWriter::prepare() {
  io::ensure_writable_dir(root_, "checkpoint.dir");
  for (const auto& entry : fs::directory_iterator(root_)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0 || name.rfind(".trash-", 0) == 0 || name == "latest.tmp") {
      fmt::print("checkpoint: removing {} left by an interrupted save\n", entry.path().string());
      remove_quietly(entry.path().string());
    }
  }
}

void CheckpointWriter::remove_quietly(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) warn(kWhere, fmt::format("{}: cannot delete: {}; continuing", path, ec.message()));
}

void CheckpointWriter::make_empty(const std::string& tmp) {
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) fail(kWhere, "{}: cannot create: {}", tmp, ec.message());
}

void CheckpointWriter::write_files(const std::string& tmp, const Model& model, const Optimizer& optimizer,
                                   const CheckpointState& state, bool sharded,
                                   const std::vector<GatheredWeight>* more_weights) {
  {
    io::SafetensorsWriter writer;  // scoped: its copy of the weights is freed before the next file
    io::add_model_weights(writer, model);
    if (more_weights) add_gathered_weights(writer, *more_weights);
    writer.write(join_path(tmp, "model.safetensors"));
  }
  faults_.kill_point("model", saves_);
  if (!sharded) {
    io::SafetensorsWriter writer;
    size_t bytes = 0;
    for (const OptimizerStateTensor& t : optimizer.state_tensors()) {
      KILN_CHECK(!t.sliced, kWhere, "optimizer state '{}' is one rank's slice: a ZeRO run saves shards", t.name);
      writer.add(t.name, t.tensor);
      bytes += t.tensor.nbytes();
    }
    writer.set_metadata("format", "kiln-optimizer");
    writer.set_metadata("optimizer", optimizer_name_);
    writer.set_metadata("steps", std::to_string(optimizer.steps_taken()));
    const std::string path = join_path(tmp, kWholeOptimizer);
    if (faults_.value("checkpoint_enospc", 0) == saves_) {  // injected: a disk that fills up mid-file
      io::write_file_synced(path, std::string(bytes / 2, '\0'), kWhere);
      fail("safetensors", "{}: write failed: {}", path, std::strerror(ENOSPC));
    }
    writer.write(path);
  }
  faults_.kill_point("optimizer", saves_);
  io::write_file_synced(join_path(tmp, "config.toml"), state.config_toml, kWhere);
  if (!io::save_tokenizer_with_model(tokenizer_, tmp))
    warn(kWhere, fmt::format("data.tokenizer '{}' is gone: {} has no tokenizer.json", tokenizer_, tmp));
  for (const char* name : io::kTokenizerFiles)
    if (fs::exists(join_path(tmp, name))) io::fsync_path(join_path(tmp, name), kWhere);
  const std::string state_json = state_to_json(state);
  if (faults_.at_write_point("partial", saves_)) {
    io::write_file_synced(join_path(tmp, "state.json"), state_json.substr(0, state_json.size() / 2), kWhere);
    kill_self();
  }
  io::write_file_synced(join_path(tmp, "state.json"), state_json, kWhere);
  faults_.kill_point("state", saves_);
}

void CheckpointWriter::write_manifest(const std::string& tmp, const CheckpointState& state, const json& shards) {
  json manifest = {{"format", "kiln-checkpoint"},
                   {"format_version", io::kCheckpointFormatVersion},
                   {"kiln_version", KILN_VERSION},
                   {"step", state.progress.step},
                   {"checksum", "xxh64"},
                   {"files", json::object()}};
  auto list = [&](const char* name) {
    const FileDigest d = xxh64_file(join_path(tmp, name));
    manifest["files"][name] = {{"bytes", d.bytes}, {"xxh64", hex64(d.hash)}};
  };
  for (const char* name : kFiles) list(name);
  if (shards.empty()) list(kWholeOptimizer);
  for (const char* name : io::kTokenizerFiles)
    if (fs::exists(join_path(tmp, name))) list(name);
  // The shards as their ranks reported them once durable: rank 0 never reads them back.
  for (const auto& [name, digest] : shards.items()) manifest["files"][name] = digest;
  if (!shards.empty()) manifest["optimizer_shards"] = shards.size();
  manifest["manifest_xxh64"] = hex64(io::checkpoint_manifest_hash(manifest));
  io::write_file_synced(join_path(tmp, "manifest.json"), manifest.dump(1) + "\n", kWhere);
  io::fsync_path(tmp, kWhere);  // the directory: every file's entry, the ranks' shards among them
  faults_.kill_point("manifest", saves_);
}

void CheckpointWriter::publish(const std::string& tmp, const std::string& final_dir, int64_t step) {
  const std::string name = checkpoint_name(step);
  if (fs::exists(final_dir)) {
    // A checkpoint of this step from an abandoned run (crashed before `latest` moved,
    // or one resumed from an older checkpoint): replaced, never merged.
    const std::string trash = join_path(root_, fmt::format(".trash-{}-{}", name, ::getpid()));
    io::rename_synced(final_dir, trash, kWhere);
    remove_quietly(trash);
  }
  io::rename_synced(tmp, final_dir, kWhere);
}

void CheckpointWriter::point_latest(const std::string& final_dir, int64_t step) {
  faults_.kill_point("rename", saves_);
  try {
    io::replace_file_atomically(join_path(root_, "latest"), checkpoint_name(step) + "\n", kWhere);
  } catch (const Error& e) {
    fail(kWhere, "{}: saved, but 'latest' could not be moved to it: {}", final_dir, e.what());
  }
  faults_.kill_point("latest", saves_);
  apply_retention(step);
}

std::string CheckpointWriter::save(const Model& model, const Optimizer& optimizer, const CheckpointState& state) {
  ++saves_;
  const int64_t step = state.progress.step;
  const std::string final_dir = join_path(root_, checkpoint_name(step));
  const std::string tmp = join_path(root_, ".tmp-" + checkpoint_name(step));
  try {
    make_empty(tmp);
    faults_.kill_point("begin", saves_);
    write_files(tmp, model, optimizer, state, false);
    write_manifest(tmp, state, json::object());
    publish(tmp, final_dir, step);
  } catch (const Error& e) {
    std::error_code ec;
    fs::remove_all(tmp, ec);  // best effort; a leftover is removed by the next prepare()
    fail(kWhere, "{}: save failed: {}", final_dir, e.what());
  }
  point_latest(final_dir, step);
  return final_dir;
}

std::string CheckpointWriter::save_sharded(const Model& model, const Optimizer& optimizer,
                                           const CheckpointState& state, dist::Communicator& comm,
                                           const ShardedSaveParts& parts) {
  ++saves_;
  const bool root = comm.rank() == 0;
  const int world = comm.world_size();
  const int64_t step = state.progress.step;
  const std::string final_dir = join_path(root_, checkpoint_name(step));
  const std::string tmp = join_path(root_, ".tmp-" + checkpoint_name(step));
  // This rank's first failure. Every rank runs every collective below whatever fails, so
  // none waits for one that gave up; rank 0 decides, and tells the others, at the end.
  std::string error;
  const auto attempt = [&](const auto& work) {
    if (!error.empty()) return;
    try {
      work();
    } catch (const Error& e) {
      error = e.what();
    }
  };
  if (root) attempt([&] {
    make_empty(tmp);
    faults_.kill_point("begin", saves_);
  });
  error = broadcast_text(comm, 0, error);  // no rank writes into a directory rank 0 could not make
  json report;
  attempt([&] {
    const std::string path = join_path(tmp, optimizer_shard_name(comm.rank(), world));
    write_optimizer_shard(path, parts.state ? *parts.state : optimizer.state_tensors(), optimizer_name_,
                          optimizer.steps_taken(), comm.rank(), world);
    if (faults_.at_write_point("shard", saves_)) {  // injected: this rank dies with its file half written
      fs::resize_file(path, fs::file_size(path) / 2);
      kill_self();
    }
    const FileDigest d = xxh64_file(path);  // written and fsynced: durable
    report = {{"bytes", d.bytes}, {"xxh64", hex64(d.hash)}};
  });
  if (root) attempt([&] { write_files(tmp, model, optimizer, state, true, parts.more_weights); });
  // Every rank's shard, durable, or its error: only then may rank 0 write the manifest.
  json shards = json::object();
  for (int r = 0; r < world; ++r) {
    const json said = json::parse(broadcast_text(comm, r, error.empty() ? report.dump() : json{{"error", error}}.dump()));
    if (!root) continue;
    if (said.contains("error")) {
      if (error.empty()) error = fmt::format("rank {}: {}", r, said["error"].get<std::string>());
    } else {
      shards[optimizer_shard_name(r, world)] = said;
    }
  }
  std::string outcome;  // rank 0's: empty once the checkpoint is in place and `latest` names it
  if (root) {
    attempt([&] {
      write_manifest(tmp, state, shards);
      publish(tmp, final_dir, step);
    });
    if (!error.empty()) {
      std::error_code ec;
      fs::remove_all(tmp, ec);  // best effort; a leftover is removed by the next prepare()
      outcome = fmt::format("[{}] {}: save failed: {}", kWhere, final_dir, error);
    } else {
      try {
        point_latest(final_dir, step);
      } catch (const Error& e) {
        outcome = e.what();
      }
    }
  }
  outcome = broadcast_text(comm, 0, outcome);
  if (!outcome.empty()) throw Error(outcome);
  return final_dir;
}

void CheckpointWriter::mark_best(int64_t step) {
  io::replace_file_atomically(join_path(root_, "best"), checkpoint_name(step) + "\n", kWhere);
  apply_retention(step);  // the best before it is no longer kept for being the best
}

void CheckpointWriter::apply_retention(int64_t newest) {
  if (keep_last_ == 0) return;
  // The best checkpoint's name (DIR/best), kept whatever its age.
  std::string best;
  if (std::ifstream in(join_path(root_, "best")); in) std::getline(in, best);
  // Newest first among those older than the one just written; newer ones belong to an
  // abandoned future (a resume from an older checkpoint) and are left alone.
  auto all = list_checkpoints(root_);
  int64_t kept = 1;  // the new one
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    const auto& [step, path] = *it;
    if (step >= newest || fs::path(path).filename() == best) continue;
    if (kept < keep_last_ || (keep_every_ > 0 && step % keep_every_ == 0)) {
      kept += kept < keep_last_ ? 1 : 0;
      continue;
    }
    const std::string trash = join_path(root_, fmt::format(".trash-{}-{}", fs::path(path).filename().string(), ::getpid()));
    std::error_code ec;
    if (faults_.has("checkpoint_delete", "fail")) ec = std::make_error_code(std::errc::permission_denied);
    else fs::rename(path, trash, ec);
    if (ec) {
      warn(kWhere, fmt::format("{}: cannot delete old checkpoint: {}; continuing", path, ec.message()));
      continue;
    }
    remove_quietly(trash);
  }
}

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const int64_t step = step_of(entry.path().filename().string());
    if (step >= 0 && fs::exists(entry.path() / "manifest.json")) out.emplace_back(step, entry.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string resolve_checkpoint(const std::string& path) {
  KILN_CHECK(fs::exists(path), kWhere, "{}: no such checkpoint or checkpoint directory", path);
  const std::string latest = join_path(path, "latest");
  if (!fs::exists(latest)) {
    if (fs::exists(join_path(path, "manifest.json")) || step_of(fs::path(path).filename().string()) >= 0)
      return path;  // a checkpoint itself (read_checkpoint reports an incomplete one)
    const auto all = list_checkpoints(path);
    return all.empty() ? std::string() : all.back().second;
  }
  std::string name = read_small_file(latest, kMaxLatestBytes, "checkpoint 'latest' file", kWhere);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  // Escaped: a corrupt `latest` may hold any bytes, which must not reach the terminal raw.
  KILN_CHECK(step_of(name) >= 0, kWhere, "{}: does not name a checkpoint ('{}')", latest, printable(name));
  const std::string target = join_path(path, name);
  if (fs::exists(target)) return target;
  // Only a crash while a same-step checkpoint was being replaced leaves this.
  const auto all = list_checkpoints(path);
  KILN_CHECK(!all.empty(), kWhere, "{}: names {}, which does not exist", latest, target);
  warn(kWhere, fmt::format("{} names {}, which does not exist; using the newest complete checkpoint {}", latest, name,
                   all.back().second));
  return all.back().second;
}

CheckpointInfo read_checkpoint(const std::string& path) {
  const int64_t step = io::verify_checkpoint_files(path, kFiles);  // before anything in it is believed
  CheckpointInfo info;
  info.path = path;
  // The optimizer's files, as the (verified) manifest lists them: whole, or W shards.
  const std::string manifest_path = join_path(path, "manifest.json");
  const json manifest = json::parse(io::read_file_bytes(manifest_path, kWhere));
  const json& files = manifest.at("files");
  const int64_t shards = manifest.value("optimizer_shards", int64_t{0});
  KILN_CHECK(shards >= 0 && shards < (int64_t{1} << 20), kWhere, "{}: optimizer_shards {} is no rank count",
             manifest_path, shards);
  if (shards == 0)
    KILN_CHECK(files.contains(kWholeOptimizer), kWhere, "{}: does not list {}", manifest_path, kWholeOptimizer);
  for (int r = 0; r < shards; ++r) {
    const std::string name = optimizer_shard_name(r, static_cast<int>(shards));
    KILN_CHECK(files.contains(name), kWhere, "{}: does not list {}", manifest_path, name);
    info.optimizer_shards.push_back(join_path(path, name));
  }
  const std::string state_path = join_path(path, "state.json");
  info.state = state_from_json(io::read_file_bytes(state_path, kWhere), state_path);
  info.config = load_config(join_path(path, "config.toml"));
  KILN_CHECK(info.state.progress.step == step, kWhere,
             "{}: step {} disagrees with the manifest's", state_path, info.state.progress.step);
  return info;
}

namespace {

// ZeRO: this rank's slice of a whole state tensor, read straight out of the file, so a
// checkpoint loads at any world size (train/parameter_shards.h).
void read_slice(const io::SafetensorsFile& file, const OptimizerStateTensor& t) {
  const io::TensorInfo& info = file.info(t.name);
  KILN_CHECK(info.dtype == t.tensor.dtype() && info.kiln_shape() == t.whole, kWhere,
             "{}: optimizer state '{}' is {}{}, this run keeps it as {}{}", file.path(), t.name,
             dtype_name(info.dtype), info.shape_str(), dtype_name(t.tensor.dtype()), t.whole.str());
  const size_t element = dtype_size(t.tensor.dtype());
  device_copy(t.tensor.raw(), t.tensor.device(),
              static_cast<const unsigned char*>(file.data(t.name)) + static_cast<size_t>(t.offset) * element, Device::cpu,
              t.tensor.nbytes());
}

}  // namespace

void load_checkpoint_tensors(const CheckpointInfo& checkpoint, Model& model, Optimizer& optimizer) {
  io::load_weights(model, io::SafetensorsFile::open(join_path(checkpoint.path, "model.safetensors")));
  // A pipeline stage's model holds part of the parameters, and so of the state.
  const bool part = !model.backbone().whole();
  if (!checkpoint.optimizer_shards.empty()) {  // a ZeRO run's: each tensor put together from its slices
    const std::vector<OptimizerStateTensor> state = optimizer.state_tensors();
    const bool sliced = std::any_of(state.begin(), state.end(), [](const OptimizerStateTensor& t) { return t.sliced; });
    read_optimizer_shards(checkpoint.optimizer_shards, state, !sliced && !part);
    optimizer.set_steps_taken(checkpoint.state.optimizer_steps);
    return;
  }
  const std::string path = join_path(checkpoint.path, kWholeOptimizer);
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  std::set<std::string> expected;
  bool sliced = part;  // ZeRO, a stage: the file's other tensors are the other ranks' to read
  for (const OptimizerStateTensor& t : optimizer.state_tensors()) {
    expected.insert(t.name);
    sliced = sliced || t.sliced;
    KILN_CHECK(file.contains(t.name), kWhere, "{}: missing optimizer state '{}'", path, t.name);
    if (t.sliced) read_slice(file, t);
    else io::read_into(file, t.name, t.tensor);
  }
  for (const std::string& name : file.names())
    KILN_CHECK(sliced || expected.count(name), kWhere, "{}: tensor '{}' does not belong to this optimizer", path, name);
  optimizer.set_steps_taken(checkpoint.state.optimizer_steps);
}

}  // namespace kiln
