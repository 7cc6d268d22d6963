#include "train/zero_state.h"

#include "core/device_memory.h"
#include "core/error.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <map>
#include <string>

namespace kiln {

namespace {

using nlohmann::json;

// One rank's slices: what they are (JSON) and their bytes end to end (host).
struct Slices {
  std::string meta;
  std::vector<unsigned char> bytes;
};

Slices pack(const std::vector<OptimizerStateTensor>& local) {
  json meta = json::array();
  Slices out;
  for (const OptimizerStateTensor& t : local) {
    std::vector<int64_t> whole;
    const Shape& shape = t.sliced ? t.whole : t.tensor.shape();
    for (int d = 0; d < shape.rank(); ++d) whole.push_back(shape[d]);
    meta.push_back({{"name", t.name},
                    {"dtype", dtype_name(t.tensor.dtype())},
                    {"whole", whole},
                    {"offset", t.sliced ? t.offset : 0},
                    {"numel", t.tensor.numel()}});
    const size_t at = out.bytes.size();
    out.bytes.resize(at + t.tensor.nbytes());
    device_copy(out.bytes.data() + at, Device::cpu, t.tensor.raw(), t.tensor.device(), t.tensor.nbytes());
  }
  out.meta = meta.dump();
  return out;
}

// Rank `root`'s `local` (a string or bytes) on every rank.
template <typename Bytes>
Bytes broadcast_bytes(dist::Communicator& comm, int root, const Bytes& local) {
  int64_t size = comm.rank() == root ? static_cast<int64_t>(local.size()) : 0;
  comm.broadcast(&size, sizeof(size), root, "optimizer state sizes");
  Bytes out = comm.rank() == root ? local : Bytes(static_cast<size_t>(size), 0);
  comm.broadcast(out.data(), size, root, "optimizer state");
  return out;
}

Shape shape_of(const std::vector<int64_t>& d, const std::string& name) {
  switch (d.size()) {
    case 1: return Shape{d[0]};
    case 2: return Shape{d[0], d[1]};
    case 3: return Shape{d[0], d[1], d[2]};
    case 4: return Shape{d[0], d[1], d[2], d[3]};
  }
  fail("checkpoint", "optimizer state '{}' of {} dimensions", name, d.size());
}

DType dtype_named(const std::string& name) {
  for (DType d : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8})
    if (name == dtype_name(d)) return d;
  fail("checkpoint", "optimizer state of unknown dtype '{}'", name);
}

}  // namespace

GatheredOptimizerState gather_optimizer_state(dist::Communicator& comm, const std::vector<OptimizerStateTensor>& local) {
  const Slices mine = pack(local);
  std::map<std::string, std::pair<OwnedTensor, int64_t>> whole;  // name -> tensor, elements filled
  for (int r = 0; r < comm.world_size(); ++r) {
    const std::string meta = broadcast_bytes(comm, r, mine.meta);
    const std::vector<unsigned char> bytes = broadcast_bytes(comm, r, mine.bytes);
    if (comm.rank() != 0) continue;
    size_t at = 0;
    for (const json& entry : json::parse(meta)) {
      const std::string name = entry["name"];
      const DType dtype = dtype_named(entry["dtype"]);
      const Shape full = shape_of(entry["whole"].get<std::vector<int64_t>>(), name);
      auto it = whole.find(name);
      if (it == whole.end()) it = whole.emplace(name, std::make_pair(OwnedTensor(dtype, Device::cpu, full), int64_t{0})).first;
      const Tensor& t = *it->second.first;
      const int64_t offset = entry["offset"], numel = entry["numel"];
      KILN_CHECK(t.dtype() == dtype && t.shape() == full && offset >= 0 && offset + numel <= t.numel(), "checkpoint",
                 "rank {}'s slice of optimizer state '{}' does not fit the others'", r, name);
      const size_t n = static_cast<size_t>(numel) * dtype_size(dtype);
      std::memcpy(static_cast<unsigned char*>(t.raw()) + static_cast<size_t>(offset) * dtype_size(dtype), bytes.data() + at, n);
      at += n;
      it->second.second += numel;
    }
  }
  GatheredOptimizerState out;
  for (auto& [name, entry] : whole) {
    KILN_CHECK(entry.second == entry.first->numel(), "checkpoint",
               "the ranks hold {} of the {} elements of optimizer state '{}'", entry.second, entry.first->numel(), name);
    out.storage.push_back(std::move(entry.first));
    out.tensors.push_back({name, *out.storage.back(), false, Shape{}, 0});  // a view: the data stays put
  }
  return out;
}

}  // namespace kiln
