#include "train/run_summary.h"

#include "core/json_number.h"
#include "io/durable_io.h"

#include <nlohmann/json.hpp>

#include <fstream>

namespace kiln {

BestValidation best_validation_in(const std::string& metrics_path) {
  BestValidation best;
  std::ifstream in(metrics_path);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || j.value("kind", "") != "validation") continue;
    if (j.contains("loss") && j["loss"].is_number() && j.contains("step") && j["step"].is_number_integer())
      best.offer(j["loss"].get<double>(), j["step"].get<int64_t>());
  }
  return best;
}

void write_run_summary(const std::string& path, const RunSummary& s) {
  const nlohmann::json j = {
      {"steps", s.steps},
      {"total_steps", s.total_steps},
      {"tokens", s.tokens},
      {"target_tokens", s.target_tokens},
      {"document_tokens", s.document_tokens},
      {"seconds", s.seconds},
      {"elapsed_seconds", s.elapsed_seconds},
      {"tokens_per_second", json_number(s.tokens_per_second)},
      {"document_tokens_per_second", json_number(s.document_tokens_per_second)},
      {"final_train_loss", json_number(s.final_train_loss)},
      {"final_validation_loss", json_number(s.final_validation_loss)},
      {"best_validation_loss", json_number(s.best.loss)},
      {"best_validation_step", std::isnan(s.best.loss) ? nlohmann::json(nullptr) : nlohmann::json(s.best.step)},
      {"skipped_steps", s.skipped_steps},
      {"stopped_by", s.stopped_by.empty() ? nlohmann::json(nullptr) : nlohmann::json(s.stopped_by)}};
  io::replace_file_atomically(path, j.dump(2) + "\n", "train");
}

}  // namespace kiln
