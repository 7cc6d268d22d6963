#include "train/checkpoint_state.h"

#include "core/checksum.h"
#include "core/error.h"
#include "config/config_fields.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kiln {

namespace {

using nlohmann::json;

// The value of `key` in `j` as T, or a one-line error naming the file and key.
template <typename T>
T get(const json& j, const char* key, const std::string& path) {
  const auto it = j.find(key);
  if (it == j.end()) fail("checkpoint", "{}: missing '{}'", path, key);
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    fail("checkpoint", "{}: '{}' has the wrong type ({})", path, key, it->type_name());
  }
}

std::string value_text(const ConfigValueRef& ref) {
  return std::visit(
      [](const auto* p) -> std::string {
        using T = std::remove_cv_t<std::remove_pointer_t<decltype(p)>>;
        if constexpr (std::is_same_v<T, std::string>) return fmt::format("'{}'", *p);
        else return fmt::format("{}", *p);
      },
      ref);
}

bool same_value(const ConfigValueRef& a, const ConfigValueRef& b) {
  return std::visit([&](auto* pa) { return *pa == *std::get<decltype(pa)>(b); }, a);
}

bool is_incompatible(const ConfigField& f) {
  if (f.section == "model") return f.key != "name" && f.key != "init_std";
  // The router's training coefficients may change on resume; the experts' shapes and
  // routing may not.
  if (f.section == "model.moe")
    return f.key != "aux_loss" && f.key != "z_loss" && f.key != "balance_scope" && f.key != "bias_rate" &&
           f.key != "bias_update";
  // Another optimizer for a role cannot continue the state saved for it (Muon's momentum
  // is not AdamW's moments), nor AdamW its moments saved in another format (fp32, bf16 or
  // 8-bit codes); learning rates, decay and betas may change.
  // bf16 masters (optim.master_weights) carry no fp32 copy to resume fp32 ones from, and an
  // fp32 master's bits would be lost; the switch is refused by name instead.
  if (f.section == "optim") return f.key == "name" || f.key == "adamw_state" || f.key == "master_weights";
  return f.section.starts_with("optim.") && f.key == "optimizer";
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

}  // namespace

std::string state_to_json(const CheckpointState& s) {
  const TrainProgress& p = s.progress;
  json j = {
      {"format", "kiln-checkpoint-state"},
      {"format_version", s.format_version},
      {"kiln_version", s.kiln_version},
      {"step", p.step},
      {"tokens", p.tokens},
      {"target_tokens", p.target_tokens},
      {"document_tokens", p.document_tokens},
      {"elapsed_seconds", p.elapsed_seconds},
      {"log_window",
       {{"loss_sum", p.window_loss}, {"losses", p.window_losses}, {"steps", p.window_steps}, {"tokens", p.window_tokens},
        {"document_tokens", p.window_document_tokens}}},
      {"optimizer_steps", s.optimizer_steps},
      {"data",
       {{"fingerprint", hex64(s.stream.fingerprint)},
        {"epoch", s.stream.epoch},
        {"next_document", s.stream.next_document},
        {"next_piece", s.stream.next_piece}}},
      {"fault_guard",
       {{"consecutive_skips", s.guard.consecutive_skips},
        {"total_skips", s.guard.total_skips},
        {"recent_loss", s.guard.recent_loss},
        {"recent_grad_norm", s.guard.recent_grad_norm}}},
      // No live RNG state: init uses train.seed, the data order data.seed and the epoch,
      // samples train.seed + step. Recorded so a reader sees that nothing is missing.
      {"rng", "stateless: init from train.seed, data order from data.seed + epoch, samples from train.seed + step"},
      {"precision", s.precision},
      {"threads", s.threads},
      {"config", s.config_toml},
      {"run_id", s.run_id},
      {"world_size", s.world_size},
  };
  if (s.loss_scaler)  // absent where the saving run did not scale its loss
    j["loss_scaler"] = {{"scale", s.loss_scaler->scale},
                        {"clean_steps", s.loss_scaler->clean_steps},
                        {"overflows", s.loss_scaler->overflows}};
  // A mixture's per-source positions (data.sources); absent for one source, as before.
  for (const SourcePosition& source : s.stream.sources)
    j["data"]["sources"].push_back(
        {{"epoch", source.epoch}, {"next_document", source.next_document}, {"draws", source.draws}});
  // nlohmann writes doubles with enough digits to read back the same bits.
  return j.dump(1) + "\n";
}

CheckpointState state_from_json(const std::string& text, const std::string& path) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail("checkpoint", "{}: not valid JSON: {}", path, e.what());
  }
  KILN_CHECK(j.is_object() && j.value("format", "") == "kiln-checkpoint-state", "checkpoint",
             "{}: not a kiln checkpoint state file", path);
  CheckpointState s;
  s.format_version = get<int64_t>(j, "format_version", path);
  KILN_CHECK(s.format_version == kCheckpointFormatVersion, "checkpoint",
             "{}: checkpoint format version {} (this kiln reads version {})", path, s.format_version,
             kCheckpointFormatVersion);
  s.kiln_version = get<std::string>(j, "kiln_version", path);
  TrainProgress& p = s.progress;
  p.step = get<int64_t>(j, "step", path);
  p.tokens = get<int64_t>(j, "tokens", path);
  p.target_tokens = get<int64_t>(j, "target_tokens", path);
  // Checkpoints before document_tokens was counted: as if every position held one.
  p.document_tokens = j.contains("document_tokens") ? get<int64_t>(j, "document_tokens", path) : p.tokens;
  p.elapsed_seconds = get<double>(j, "elapsed_seconds", path);
  const json w = get<json>(j, "log_window", path);
  p.window_loss = get<double>(w, "loss_sum", path);
  p.window_losses = get<int64_t>(w, "losses", path);
  p.window_steps = get<int64_t>(w, "steps", path);
  p.window_tokens = get<int64_t>(w, "tokens", path);
  p.window_document_tokens =
      w.contains("document_tokens") ? get<int64_t>(w, "document_tokens", path) : p.window_tokens;
  s.optimizer_steps = get<int64_t>(j, "optimizer_steps", path);
  const json d = get<json>(j, "data", path);
  s.stream.fingerprint = parse_hex64(get<std::string>(d, "fingerprint", path), "checkpoint");
  s.stream.epoch = get<uint64_t>(d, "epoch", path);
  s.stream.next_document = get<uint64_t>(d, "next_document", path);
  s.stream.next_piece = get<uint64_t>(d, "next_piece", path);
  if (d.contains("sources")) {
    KILN_CHECK(d["sources"].is_array(), "checkpoint", "{}: data.sources is not an array", path);
    for (const json& source : d["sources"])
      s.stream.sources.push_back(SourcePosition{get<uint64_t>(source, "epoch", path),
                                                get<uint64_t>(source, "next_document", path),
                                                get<uint64_t>(source, "draws", path)});
  }
  const json g = get<json>(j, "fault_guard", path);
  s.guard.consecutive_skips = get<int64_t>(g, "consecutive_skips", path);
  s.guard.total_skips = get<int64_t>(g, "total_skips", path);
  s.guard.recent_loss = get<std::vector<double>>(g, "recent_loss", path);
  s.guard.recent_grad_norm = get<std::vector<double>>(g, "recent_grad_norm", path);
  s.precision = get<std::string>(j, "precision", path);
  s.threads = get<int64_t>(j, "threads", path);
  s.config_toml = get<std::string>(j, "config", path);
  // Both absent from checkpoints written before they were recorded.
  if (j.contains("run_id")) s.run_id = get<std::string>(j, "run_id", path);
  if (j.contains("world_size")) s.world_size = get<int64_t>(j, "world_size", path);
  if (j.contains("loss_scaler")) {
    const json& l = j["loss_scaler"];
    s.loss_scaler = LossScalerState{get<double>(l, "scale", path), get<int64_t>(l, "clean_steps", path),
                                    get<int64_t>(l, "overflows", path)};
  }
  KILN_CHECK(p.step >= 0 && s.optimizer_steps >= 0 && s.optimizer_steps <= p.step, "checkpoint",
             "{}: inconsistent counters (step {}, optimizer_steps {})", path, p.step, s.optimizer_steps);
  return s;
}

int64_t saved_world_size(const CheckpointState& saved, const Config& saved_config) {
  if (saved.world_size > 0) return saved.world_size;
  const TrainProgress& p = saved.progress;
  const int64_t per_process = p.step * saved_config.train.grad_accum * saved_config.train.micro_batch_tokens;
  if (per_process <= 0 || p.tokens % per_process != 0) return 0;
  return p.tokens / per_process;
}

std::vector<std::string> config_differences(const Config& saved, const Config& now) {
  std::vector<std::string> out;
  for (const ConfigField& f : config_fields())
    if (!same_value(f.get(saved), f.get(now)))
      out.push_back(fmt::format("{} ({} -> {})", f.name(), value_text(f.get(saved)), value_text(f.get(now))));
  return out;
}

std::vector<std::string> incompatible_differences(const Config& saved, const Config& now) {
  std::vector<std::string> out;
  for (const ConfigField& f : config_fields())
    if (is_incompatible(f) && !same_value(f.get(saved), f.get(now)))
      out.push_back(fmt::format("{} ({} -> {})", f.name(), value_text(f.get(saved)), value_text(f.get(now))));
  return out;
}

void check_resume_model(const std::string& path, const CheckpointState& saved, const Config& saved_config,
                        const Config& now, DType precision) {
  std::vector<std::string> problems = incompatible_differences(saved_config, now);
  if (saved.precision != dtype_name(precision))
    problems.push_back(fmt::format("precision ({} -> {})", saved.precision, dtype_name(precision)));
  KILN_CHECK(problems.empty(), "checkpoint", "{}: cannot resume, the run differs from the checkpoint in: {}", path,
             join(problems));
}

bool check_resume_data(const std::string& path, const CheckpointState& saved, const Config& saved_config,
                       const Config& now, uint64_t stream_fingerprint, bool allow_data_change) {
  if (saved.stream.fingerprint == stream_fingerprint) return true;
  // Name the keys that feed the fingerprint, when one of them changed; else the file did.
  std::vector<std::string> changed;
  for (const ConfigField& f : config_fields()) {
    const bool feeds = f.section == "data" || f.name() == "train.micro_batch_tokens" ||
                       f.name() == "model.max_seq_len";
    if (feeds && !same_value(f.get(saved_config), f.get(now))) changed.push_back(std::string(f.name()));
  }
  if (saved_config.data.sources != now.data.sources) changed.push_back("data.sources");
  const std::string what = changed.empty() ? "the contents of data.path" : join(changed);
  KILN_CHECK(allow_data_change, "checkpoint",
             "{}: the training data differs from the checkpoint's (fingerprint {} -> {}; changed: {}); pass "
             "--allow-data-change to continue on the new data from its start",
             path, hex64(saved.stream.fingerprint), hex64(stream_fingerprint), what);
  return false;
}

}  // namespace kiln
