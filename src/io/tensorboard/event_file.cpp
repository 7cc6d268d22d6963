#include "io/tensorboard/event_file.h"

#include "core/utf8.h"
#include "io/tensorboard/event.pb.h"
#include "io/tensorboard/tfrecord.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <string_view>
#include <unistd.h>

namespace kiln::io {

namespace {

namespace pb = kiln::tensorboard;

constexpr std::string_view kPrefix = "events.out.tfevents.";

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

pb::Event event_at(int64_t step) {
  pb::Event event;
  event.set_wall_time(unix_seconds());
  event.set_step(step);
  return event;
}

// The <seconds> of an event file's name; -1 for any other name.
int64_t seconds_in_name(const std::string& name) {
  if (!name.starts_with(kPrefix)) return -1;
  int64_t seconds = -1;
  const char* begin = name.data() + kPrefix.size();
  const auto [end, error] = std::from_chars(begin, name.data() + name.size(), seconds);
  return error == std::errc() && end != begin ? seconds : -1;
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

}  // namespace

std::string new_event_file_path(const std::string& dir) {
  int64_t seconds = static_cast<int64_t>(std::time(nullptr));
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error))
    seconds = std::max(seconds, seconds_in_name(entry.path().filename().string()) + 1);
  const std::string name = fmt::format("{}{}.{}.{}.kiln", kPrefix, seconds, host_name(), ::getpid());
  return (std::filesystem::path(dir) / name).string();
}

EventFileWriter::EventFileWriter(const std::string& path, bool stop_on_error) : file_("tensorboard", path, stop_on_error) {
  pb::Event event = event_at(0);
  event.set_file_version("brain.Event:2");
  file_.append(tfrecord(event.SerializeAsString()));
}

void EventFileWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  if (values.empty()) return;
  pb::Event event = event_at(step);
  for (const auto& [tag, value] : values) {
    pb::Summary::Value* v = event.mutable_summary()->add_value();
    v->set_tag(replace_invalid_utf8(tag));
    v->set_simple_value(static_cast<float>(value));
  }
  file_.append(tfrecord(event.SerializeAsString()));
}

void EventFileWriter::text(int64_t step, const std::string& tag, const std::string& markdown) {
  pb::Event event = event_at(step);
  pb::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(replace_invalid_utf8(tag));
  v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  pb::TensorProto* tensor = v->mutable_tensor();
  tensor->set_dtype(pb::DT_STRING);
  tensor->mutable_tensor_shape();  // no dimensions: a scalar
  tensor->add_string_val(replace_invalid_utf8(markdown));
  file_.append(tfrecord(event.SerializeAsString()));
}

void EventFileWriter::session_start(int64_t step) {
  pb::Event event = event_at(step);
  event.mutable_session_log()->set_status(pb::SessionLog::START);
  file_.append(tfrecord(event.SerializeAsString()));
}

}  // namespace kiln::io
