#include "train/optimizer_shard_files.h"

#include "core/device_memory.h"
#include "core/error.h"
#include "io/safetensors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

namespace kiln {

namespace {

using nlohmann::json;

constexpr std::string_view kWhere = "checkpoint";
constexpr const char* kFormat = "kiln-optimizer-shard";

std::vector<int64_t> dims_of(const Shape& shape) {
  std::vector<int64_t> dims;
  for (int d = 0; d < shape.rank(); ++d) dims.push_back(shape[d]);
  return dims;
}

// Where a tensor's elements sit: in the whole tensor (`whole`, from `offset` on) and, for
// a piece read from a file, in that file.
struct Slice {
  size_t file = 0;  // index into the opened files
  std::vector<int64_t> whole;
  int64_t offset = 0, numel = 0;
  DType dtype = DType::f32;
};

int64_t metadata_int(const io::SafetensorsFile& file, const std::string& key) {
  const std::string& text = file.metadata(key);
  try {
    return std::stoll(text);
  } catch (const std::exception&) {
    fail(kWhere, "{}: metadata '{}' is '{}', not a number", file.path(), key, text);
  }
}

}  // namespace

std::string optimizer_shard_name(int rank, int world_size) {
  return fmt::format("optimizer.rank-{:05}-of-{:05}.safetensors", rank, world_size);
}

void write_optimizer_shard(const std::string& path, const std::vector<OptimizerStateTensor>& local,
                           const std::string& optimizer, int64_t steps, int rank, int world_size) {
  io::SafetensorsWriter writer;
  json slices = json::object();
  for (const OptimizerStateTensor& t : local) {
    const Tensor flat(t.tensor.raw(), t.tensor.dtype(), t.tensor.device(), Shape{t.tensor.numel()});
    writer.add(t.name, flat);
    slices[t.name] = {{"whole", dims_of(t.sliced ? t.whole : t.tensor.shape())}, {"offset", t.sliced ? t.offset : 0}};
  }
  writer.set_metadata("format", kFormat);
  writer.set_metadata("optimizer", optimizer);
  writer.set_metadata("steps", std::to_string(steps));
  writer.set_metadata("rank", std::to_string(rank));
  writer.set_metadata("world_size", std::to_string(world_size));
  writer.set_metadata("slices", slices.dump());
  writer.write(path);
}

void read_optimizer_shards(const std::vector<std::string>& paths, const std::vector<OptimizerStateTensor>& local,
                           bool strict) {
  std::vector<io::SafetensorsFile> files;
  std::map<std::string, std::vector<Slice>> pieces;  // state tensor name -> its slices in the files
  for (size_t f = 0; f < paths.size(); ++f) {
    files.push_back(io::SafetensorsFile::open(paths[f]));
    const io::SafetensorsFile& file = files.back();
    const auto& meta = file.metadata();
    KILN_CHECK(meta.count("format") && meta.at("format") == kFormat, kWhere, "{}: not a kiln optimizer shard",
               file.path());
    KILN_CHECK(metadata_int(file, "rank") == static_cast<int64_t>(f) &&
                   metadata_int(file, "world_size") == static_cast<int64_t>(paths.size()),
               kWhere, "{}: holds rank {} of {}, expected rank {} of {}", file.path(), metadata_int(file, "rank"),
               metadata_int(file, "world_size"), f, paths.size());
    json slices;
    try {
      slices = json::parse(file.metadata("slices"));
      for (const std::string& name : file.names()) {
        const io::TensorInfo& info = file.info(name);
        const json& s = slices.at(name);
        pieces[name].push_back({f, s.at("whole").get<std::vector<int64_t>>(), s.at("offset").get<int64_t>(),
                                info.numel(), info.dtype});
      }
    } catch (const json::exception& e) {
      fail(kWhere, "{}: corrupt slice metadata: {}", file.path(), e.what());
    }
  }

  // The checkpoint directory, for errors about the files together.
  const std::string where = paths.empty() ? std::string("(no optimizer shard files)")
                                          : std::filesystem::path(paths[0]).parent_path().string();
  std::set<std::string> expected;
  for (const OptimizerStateTensor& t : local) {
    expected.insert(t.name);
    const auto found = pieces.find(t.name);
    KILN_CHECK(found != pieces.end(), kWhere, "{}: no optimizer shard file holds optimizer state '{}'", where, t.name);
    const std::vector<int64_t> whole = dims_of(t.sliced ? t.whole : t.tensor.shape());
    const int64_t begin = t.sliced ? t.offset : 0, end = begin + t.tensor.numel();
    const size_t element = dtype_size(t.tensor.dtype());
    int64_t covered = 0;
    for (const Slice& s : found->second) {
      const io::SafetensorsFile& file = files[s.file];
      KILN_CHECK(s.dtype == t.tensor.dtype() && s.whole == whole, kWhere,
                 "{}: optimizer state '{}' is {} [{}], this run keeps it as {} [{}]", file.path(), t.name,
                 dtype_name(s.dtype), fmt::join(s.whole, ", "), dtype_name(t.tensor.dtype()), fmt::join(whole, ", "));
      const int64_t lo = std::max(begin, s.offset), hi = std::min(end, s.offset + s.numel);
      if (lo >= hi) continue;
      device_copy(static_cast<unsigned char*>(t.tensor.raw()) + static_cast<size_t>(lo - begin) * element,
                  t.tensor.device(),
                  static_cast<const unsigned char*>(file.data(t.name)) + static_cast<size_t>(lo - s.offset) * element,
                  Device::cpu, static_cast<size_t>(hi - lo) * element);
      covered += hi - lo;
    }
    // Slices never overlap (each element is one rank's), so the elements copied add up.
    KILN_CHECK(covered == t.tensor.numel(), kWhere,
               "{}: the {} optimizer shard files hold {} of the {} elements of optimizer state '{}' this rank needs",
               where, paths.size(), covered, t.tensor.numel(), t.name);
  }
  if (!strict) return;
  for (const auto& [name, slices] : pieces)
    KILN_CHECK(expected.count(name), kWhere, "{}: tensor '{}' does not belong to this optimizer",
               paths[slices.front().file], name);
}

}  // namespace kiln
