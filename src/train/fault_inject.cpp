#include "train/fault_inject.h"

#include "core/error.h"
#include "ops/elementwise/elementwise.h"

#include <charconv>
#include <chrono>
#include <cmath>
#include <limits>
#include <thread>
#include <csignal>
#include <cstdlib>
#include <unistd.h>

namespace kiln {

namespace {

constexpr std::string_view kWhere = "KILN_FAULT_INJECT";
constexpr std::string_view kWritePoints[] = {"begin", "shard", "model", "optimizer", "partial",
                                             "state", "manifest", "rename", "latest"};
constexpr std::string_view kStepFaults[] = {"kill_at_step", "nan_loss", "inf_grad", "grad_spike"};

int64_t parse_int(std::string_view text, std::string_view item) {
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  KILN_CHECK(ec == std::errc() && ptr == text.data() + text.size() && v >= 0, kWhere,
             "'{}': '{}' is not a non-negative integer", item, text);
  return v;
}

template <size_t N>
bool contains(const std::string_view (&list)[N], std::string_view s) {
  for (std::string_view x : list)
    if (x == s) return true;
  return false;
}

}  // namespace

FaultInjector::FaultInjector(std::string_view spec) {
  while (!spec.empty()) {
    const size_t comma = spec.find(',');
    const std::string_view item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view() : spec.substr(comma + 1);
    if (item.empty()) continue;
    const size_t colon = item.find(':');
    KILN_CHECK(colon != std::string_view::npos, kWhere, "'{}': expected name:argument", item);
    Fault f{std::string(item.substr(0, colon)), std::string(item.substr(colon + 1))};
    if (f.name == "checkpoint_write") {
      const size_t at = f.arg.find('@');
      f.first = at == std::string::npos ? 1 : parse_int(std::string_view(f.arg).substr(at + 1), item);
      if (at != std::string::npos) f.arg.resize(at);
      KILN_CHECK(contains(kWritePoints, f.arg), kWhere, "'{}': unknown checkpoint_write point", item);
    } else if (f.name == "checkpoint_delete") {
      KILN_CHECK(f.arg == "fail", kWhere, "'{}': expected checkpoint_delete:fail", item);
    } else if (f.name == "eval_error") {
      KILN_CHECK(f.arg == "validation" || f.arg == "sample", kWhere, "'{}': expected eval_error:validation|sample",
                 item);
    } else if (f.name == "nan_validation") {
      KILN_CHECK(f.arg == "all", kWhere, "'{}': expected nan_validation:all", item);
    } else if (contains(kStepFaults, f.name)) {
      const size_t dash = f.arg.find('-');
      f.first = parse_int(std::string_view(f.arg).substr(0, dash), item);
      f.last = dash == std::string::npos ? f.first : parse_int(std::string_view(f.arg).substr(dash + 1), item);
    } else if (f.name == "checkpoint_enospc" || f.name == "step_delay_ms" || f.name == "eval_delay_ms") {
      f.first = f.last = parse_int(f.arg, item);
    } else {
      fail(kWhere, "'{}': unknown fault '{}'", item, f.name);
    }
    faults_.push_back(std::move(f));
  }
}

FaultInjector FaultInjector::from_env() {
  const char* spec = std::getenv("KILN_FAULT_INJECT");
  return spec ? FaultInjector(spec) : FaultInjector();
}

bool FaultInjector::at_write_point(std::string_view point, int64_t save) const {
  for (const Fault& f : faults_)
    if (f.name == "checkpoint_write" && f.arg == point && f.first == save) return true;
  return false;
}

void FaultInjector::kill_point(std::string_view point, int64_t save) const {
  if (at_write_point(point, save)) kill_self();
}

bool FaultInjector::at_step(std::string_view name, int64_t step) const {
  for (const Fault& f : faults_)
    if (f.name == name && step >= f.first && step <= f.last) return true;
  return false;
}

int64_t FaultInjector::value(std::string_view name, int64_t fallback) const {
  for (const Fault& f : faults_)
    if (f.name == name) return f.first;
  return fallback;
}

bool FaultInjector::has(std::string_view name, std::string_view arg) const {
  for (const Fault& f : faults_)
    if (f.name == name && f.arg == arg) return true;
  return false;
}

bool FaultInjector::numeric() const {
  for (const Fault& f : faults_)
    if (f.name == "nan_loss" || f.name == "inf_grad" || f.name == "grad_spike") return true;
  return false;
}

void inject_before_step(const FaultInjector& faults, int64_t step) {
  if (faults.at_step("kill_at_step", step)) kill_self();
  if (const int64_t ms = faults.value("step_delay_ms", 0); ms > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

void inject_eval_faults(const FaultInjector& faults, std::string_view what, bool starting) {
  if (starting && faults.has("eval_error", what)) fail("train", "injected {} failure (KILN_FAULT_INJECT)", what);
  if (const int64_t ms = faults.value("eval_delay_ms", 0); ms > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

void inject_numeric_faults(const ExecContext& exec, const FaultInjector& faults, int64_t step, double& loss,
                           const std::vector<std::unique_ptr<Parameter>>& parameters) {
  if (faults.at_step("nan_loss", step)) loss = std::nan("");
  if (faults.at_step("inf_grad", step)) {
    // One element of the last parameter's gradient, written through a copy so it works
    // on any device.
    const Tensor grad = parameters.back()->grad();
    const Tensor flat = grad.view(Shape{grad.numel()}).rows(0, 1);
    OwnedTensor inf(flat.dtype(), Device::cpu, flat.shape());
    if (flat.dtype() == DType::f64) inf->data<double>()[0] = std::numeric_limits<double>::infinity();
    else inf->data<float>()[0] = std::numeric_limits<float>::infinity();
    copy_tensor(*inf, flat);
  }
  if (faults.at_step("grad_spike", step))
    for (const auto& p : parameters)
      if (p->trainable()) ops::scale_inplace(exec, p->grad(), 1e4);
}

void kill_self() {
  ::kill(::getpid(), SIGKILL);
  std::abort();  // not reached
}

}  // namespace kiln
