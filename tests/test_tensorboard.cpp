// TensorBoard event files (log.tensorboard): read back by the `tensorboard` package's own
// readers (tests/python/read_tensorboard.py), they hold every number of metrics.jsonl,
// step by step, under the tags docs/metrics.md lists, and the samples as text; a resumed
// run shows each step once; an earlier run's files are set aside; write failures follow
// checkpoint.on_save_error. (The records' CRC-32C: tests/test_crc32c.cpp.)
#include "fault_test_util.h"

#include "train/metrics.h"
#include "train/tensorboard_log.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::run_with_fault;
using test::tiny_train;

// tag -> step -> value (a number, or "nan" / "inf" / "-inf", or text).
using Series = std::map<std::string, std::map<int64_t, json>>;

class Tensorboard : public test::TinyRunTest {
 protected:
  Tensorboard() : TinyRunTest("kiln-tensorboard") {}
  // What TensorBoard's readers find in `tensorboard_dir` (fails the test if they fail).
  json read_back(const std::string& tensorboard_dir) {
    const std::string log = dir_ + "/reader.log";  // its messages (a purge is announced), apart from the JSON
    std::string output;
    const int code = test::run_command("{ " + test::kiln_python() + " " + test::source_dir() +
                                           "/tests/python/read_tensorboard.py " + tensorboard_dir + " 2>" + log + "; }",
                                       &output);
    EXPECT_EQ(code, 0) << test::read_file(log);
    const json j = json::parse(output, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << output;
    return j.is_discarded() ? json::object() : j;
  }
};

// The readers' list of [step, value] pairs per tag as a Series; a step twice fails.
Series series_of(const json& by_tag) {
  Series out;
  for (const auto& [tag, points] : by_tag.items())
    for (const auto& point : points)
      EXPECT_TRUE(out[tag].emplace(point[0].get<int64_t>(), point[1]).second) << tag << " twice at step " << point[0];
  return out;
}

// A metrics.jsonl number as TensorBoard holds it: a float32 simple value; null (JSON has
// no NaN or Inf) as "non-finite".
json as_tensorboard(const json& value) {
  if (value.is_null()) return "non-finite";
  return static_cast<double>(static_cast<float>(value.get<double>()));
}

// A reader's value, with NaN and infinities folded as as_tensorboard folds null.
json normalized(const json& value) {
  return value.is_string() && (value == "nan" || value == "inf" || value == "-inf") ? json("non-finite") : value;
}

// A sample or reason as the text plugin is given it: an indented markdown code block.
std::string verbatim(const std::string& text) {
  std::string out = "    ";
  for (const char c : text) {
    out += c;
    if (c == '\n') out += "    ";
  }
  return out;
}

// Every scalar TensorBoard should hold for the records of metrics.jsonl, by the tag scheme
// of docs/metrics.md, written out here again from the records themselves.
Series expected_scalars(const std::string& out_dir) {
  Series s;
  const std::set<std::string> known = {"kind",         "step",          "loss",          "lr",
                                       "grad_norm",    "tokens",        "target_tokens", "document_tokens",
                                       "step_seconds", "elapsed_seconds", "skipped",     "skipped_total",
                                       "window_steps", "mfu",           "device_memory_used_bytes",
                                       "host_peak_rss_bytes"};
  for (const json& r : test::metrics_of_kind(out_dir, "train")) {
    const int64_t step = r["step"];
    const double seconds = r["step_seconds"];
    auto put = [&](const std::string& tag, const json& value) { s[tag][step] = as_tensorboard(value); };
    put("train/loss", r["loss"]);
    put("train/lr", r["lr"]);
    put("train/grad_norm", r["grad_norm"]);
    put("perf/tokens_per_second", r["tokens"].get<double>() / std::max(seconds, 1e-9));
    put("perf/document_tokens_per_second", r["document_tokens"].get<double>() / std::max(seconds, 1e-9));
    put("perf/step_seconds", seconds / r["window_steps"].get<double>());
    put("perf/elapsed_seconds", r["elapsed_seconds"]);
    put("tokens/positions", r["tokens"]);
    put("tokens/documents", r["document_tokens"]);
    put("tokens/targets", r["target_tokens"]);
    put("memory/host_peak_rss_bytes", r["host_peak_rss_bytes"]);
    put("skips/total", r.value("skipped_total", 0));
    if (r.contains("mfu")) put("perf/mfu", r["mfu"]);
    if (r.contains("device_memory_used_bytes")) put("memory/device_used_bytes", r["device_memory_used_bytes"]);
    // The rest: loss terms ("z", "moe_aux") under train/, components ("moe.0.load_max")
    // with their dots as the tag's slashes.
    for (const auto& [key, value] : r.items()) {
      if (known.count(key)) continue;
      std::string tag = key;
      for (char& c : tag)
        if (c == '.') c = '/';
      put(key.find('.') == std::string::npos ? "train/" + key : tag, value);
    }
  }
  for (const json& r : test::metrics_of_kind(out_dir, "validation")) s["val/loss"][r["step"]] = as_tensorboard(r["loss"]);
  for (const json& r : test::metrics_of_kind(out_dir, "checkpoint"))
    s["checkpoint/save_seconds"][r["step"]] = as_tensorboard(r["seconds"]);
  for (const json& r : test::metrics_of_kind(out_dir, "skip")) {
    s["skips/loss"][r["step"]] = as_tensorboard(r["loss"]);
    s["skips/grad_norm"][r["step"]] = as_tensorboard(r["grad_norm"]);
  }
  return s;
}

Series expected_text(const std::string& out_dir) {
  Series s;
  for (const json& r : test::metrics_of_kind(out_dir, "sample"))
    s["sample/text"][r["step"]] = verbatim(r["text"].get<std::string>());
  for (const json& r : test::metrics_of_kind(out_dir, "skip"))
    s["skips/reason"][r["step"]] = verbatim(r["reason"].get<std::string>());
  return s;
}

void expect_same(const Series& expected, const Series& got, const std::string& what) {
  std::set<std::string> expected_tags, got_tags;
  for (const auto& [tag, points] : expected) expected_tags.insert(tag);
  for (const auto& [tag, points] : got) got_tags.insert(tag);
  EXPECT_EQ(got_tags, expected_tags) << what << ": the tags differ";
  for (const auto& [tag, points] : expected) {
    if (!got.count(tag)) continue;
    const auto& read = got.at(tag);
    EXPECT_EQ(read.size(), points.size()) << what << " " << tag << ": steps differ";
    for (const auto& [step, value] : points) {
      const auto it = read.find(step);
      if (it == read.end()) {
        ADD_FAILURE() << what << " " << tag << ": no value at step " << step;
        continue;
      }
      EXPECT_EQ(normalized(it->second), value) << what << " " << tag << " at step " << step;
    }
  }
}

// TensorBoard's server (its own accumulator, which purges only at a run's second session
// start and later) holds the same steps of every scalar tag as the reader compared above.
void expect_server_agrees(const json& read) {
  std::set<std::string> tags, server_tags;
  for (const auto& [tag, points] : read["scalars"].items()) {
    tags.insert(tag);
    json steps = json::array();
    for (const auto& point : points) steps.push_back(point[0]);
    EXPECT_EQ(read["server_scalar_steps"].value(tag, json()), steps) << tag;
  }
  for (const auto& [tag, steps] : read["server_scalar_steps"].items()) server_tags.insert(tag);
  EXPECT_EQ(server_tags, tags);
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().filename().string().find(".tfevents.") != std::string::npos)
      names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

// A run with everything a record can hold: validations, samples, checkpoints, a skipped
// update, z-loss, a sparse layer's loss terms and load diagnostics, log windows of two
// steps. TensorBoard's readers find each metrics.jsonl number at its step and tag, as
// float32, and nothing else.
TEST_F(Tensorboard, EventFilesHoldEveryNumberOfMetricsJsonl) {
  const std::string out = dir_ + "/run";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out,
                                      "--set log.every=2 --set data.val_fraction=0.3 --set train.eval_every=4"
                                      " --set train.eval_batches=1 --set train.sample_every=6"
                                      " --set train.sample_tokens=24 --set train.z_loss=1e-4 --set model.mlp=moe"
                                      " --set model.moe.experts=4 --set model.moe.top_k=2"
                                      " --set model.moe.expert_hidden=32 --set model.moe.aux_loss=0.01"),
                           "nan_loss:5", &output),
            0)
      << output;
  ASSERT_EQ(test::metrics_of_kind(out, "skip").size(), 1u) << output;
  ASSERT_FALSE(test::metrics_of_kind(out, "sample").empty()) << output;
  const json read = read_back(out + "/tensorboard");
  ASSERT_EQ(read["files"].size(), 1u) << read.dump();
  EXPECT_EQ(read["files"][0]["file_version"], "brain.Event:2");
  EXPECT_EQ(read["files"][0]["session_starts"], json({1}));
  const Series expected = expected_scalars(out);
  for (const char* tag : {"train/moe_aux", "train/z", "moe/0/load_max", "val/loss", "skips/loss"})
    EXPECT_TRUE(expected.count(tag)) << tag << " missing from metrics.jsonl: the run does not test it";
  expect_same(expected, series_of(read["scalars"]), "scalars");
  expect_same(expected_text(out), series_of(read["text"]), "text");
  expect_server_agrees(read);
}

// Killed at the start of step 7 after its step-4 checkpoint, resumed: the crashed run's
// file (its session starting at step 1) still holds steps 5 and 6, the resumed run's file
// starts a session at 5, and TensorBoard's readers, its server's too, show every step
// once, with the values metrics.jsonl ends up with.
TEST_F(Tensorboard, AResumedRunShowsEachStepOnce) {
  const std::string out = dir_ + "/run";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out), "kill_at_step:7", &output), -SIGKILL) << output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--resume"), "", &output), 0) << output;
  const json read = read_back(out + "/tensorboard");
  ASSERT_EQ(read["files"].size(), 2u) << read.dump();
  const std::vector<std::string> names = event_files(out + "/tensorboard");
  EXPECT_EQ(read["files"][0]["name"], names[0]);
  EXPECT_EQ(read["files"][0]["session_starts"], json({1}));
  EXPECT_EQ(read["files"][0]["scalar_steps"]["train/loss"], json({1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(read["files"][1]["session_starts"], json({5}));
  EXPECT_EQ(read["files"][1]["scalar_steps"]["train/loss"], json({5, 6, 7, 8, 9, 10, 11, 12}));
  const Series scalars = series_of(read["scalars"]);
  ASSERT_TRUE(scalars.count("train/loss"));
  std::vector<int64_t> steps;
  for (const auto& [step, value] : scalars.at("train/loss")) steps.push_back(step);
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}));
  expect_same(expected_scalars(out), scalars, "after the resume");
  expect_server_agrees(read);
}

// A restart (--resume) of an attempt that died before its first checkpoint: the dead
// attempt's event files move to tensorboard.previous, announced; log.tensorboard = false
// writes none.
TEST_F(Tensorboard, ARestartWithoutACheckpointSetsTheEarlierEventFilesAside) {
  const std::string out = dir_ + "/run";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set checkpoint.every=0"), "kill_at_step:3", &output), -SIGKILL)
      << output;
  const std::vector<std::string> first = event_files(out + "/tensorboard");
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set train.steps=2 --resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "tensorboard: " + out + "/tensorboard held an earlier run's event files: moved to " + out +
                              "/tensorboard.previous");
  EXPECT_EQ(event_files(out + "/tensorboard.previous"), first);
  const std::vector<std::string> second = event_files(out + "/tensorboard");
  ASSERT_EQ(second.size(), 1u);
  EXPECT_NE(second[0], first[0]);

  const std::string off = dir_ + "/off";
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, off, "--set train.steps=2 --set log.tensorboard=false"), "", &output), 0)
      << output;
  EXPECT_TRUE(fs::exists(off + "/metrics.jsonl"));
  EXPECT_FALSE(fs::exists(off + "/tensorboard"));
}

// The reader really checks each record's CRC: one flipped byte in an event's data fails
// it, naming the file (so the tests above would catch a wrong checksum).
TEST_F(Tensorboard, TheReaderRejectsADamagedEventFile) {
  const std::string out = dir_ + "/run";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set train.steps=2"), "", &output), 0) << output;
  const std::string file = out + "/tensorboard/" + event_files(out + "/tensorboard").at(0);
  std::string bytes = test::read_file(file);
  ASSERT_GT(bytes.size(), 200u);
  bytes[bytes.size() - 5] ^= 1;  // the last byte of the last event's data, before its CRC
  test::write_file(file, bytes);
  const int code = test::run_command(test::kiln_python() + " " + test::source_dir() +
                                         "/tests/python/read_tensorboard.py " + out + "/tensorboard",
                                     &output);
  EXPECT_NE(code, 0) << output;
  EXPECT_CONTAINS(output, "failed event crc32 check");
}

// A generic scalars record (an evaluation's scores, say): metrics.jsonl's {"kind": KIND,
// NAME: value}, TensorBoard's "KIND/NAME".
TEST_F(Tensorboard, AScalarsRecordIsKindSlashName) {
  const std::string tb = dir_ + "/tb";
  {
    MetricsLog metrics(dir_ + "/metrics.jsonl", true);
    TensorBoardLog events(prepare_tensorboard_dir(tb, false), 1, true);
    for (RunRecordSink* sink : {static_cast<RunRecordSink*>(&metrics), static_cast<RunRecordSink*>(&events)})
      sink->scalars(40, "eval", {{"hellaswag.acc", 0.25}, {"arc_easy.acc", 0.5}});
  }
  const auto records = test::metrics_of_kind(dir_, "eval");
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0], json({{"kind", "eval"}, {"step", 40}, {"hellaswag.acc", 0.25}, {"arc_easy.acc", 0.5}}));
  const json read = read_back(tb);
  EXPECT_EQ(read["scalars"], json({{"eval/hellaswag.acc", {{40, 0.25}}}, {"eval/arc_easy.acc", {{40, 0.5}}}}));
}

// A full disk (/dev/full fails every write with ENOSPC): with on_save_error = stop the
// first write (the file version) is an error naming the file; with continue, one warning,
// and later records are dropped without another.
TEST_F(Tensorboard, WriteFailuresFollowOnSaveError) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  EXPECT_EQ(test::error_of([] { TensorBoardLog("/dev/full", 1, true); }),
            "[tensorboard] /dev/full: write failed: No space left on device (checkpoint.on_save_error = stop)");
  ::testing::internal::CaptureStderr();
  {
    TensorBoardLog events("/dev/full", 1, false);
    events.validation(4, 1.5, 2.0);
    events.sample(4, "the king");
  }
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(warnings,
            "kiln: warning: [tensorboard] /dev/full: write failed: No space left on device; checkpoint.on_save_error = "
            "continue: training goes on, without further tensorboard records\n");
}

}  // namespace kiln
