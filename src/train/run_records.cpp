#include "train/run_records.h"

namespace kiln {

void RunRecords::step(const StepMetrics& m) {
  for (const auto& sink : sinks_) sink->step(m);
}

void RunRecords::validation(int64_t step, double loss, double elapsed_seconds) {
  for (const auto& sink : sinks_) sink->validation(step, loss, elapsed_seconds);
}

void RunRecords::sample(int64_t step, const std::string& text) {
  for (const auto& sink : sinks_) sink->sample(step, text);
}

void RunRecords::skip(int64_t step, const std::string& reason, double loss, double grad_norm) {
  for (const auto& sink : sinks_) sink->skip(step, reason, loss, grad_norm);
}

void RunRecords::checkpoint(int64_t step, const std::string& path, double seconds) {
  for (const auto& sink : sinks_) sink->checkpoint(step, path, seconds);
}

void RunRecords::resume(int64_t step, const std::string& path) {
  for (const auto& sink : sinks_) sink->resume(step, path);
}

void RunRecords::scalars(int64_t step, const std::string& kind, const NamedValues& values) {
  for (const auto& sink : sinks_) sink->scalars(step, kind, values);
}

}  // namespace kiln
