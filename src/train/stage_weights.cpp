#include "train/stage_weights.h"

#include "core/error.h"
#include "ops/elementwise/elementwise.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <cstring>

namespace kiln {

namespace {

using json = nlohmann::json;

// The tags of a rank's weights on their way to rank 0: its header's size, the header (each
// weight's name, dtype and shape), then every weight's bytes in the header's order. Beyond
// every pipeline transfer's tag, and the tied table's (train/stage_gradients.cpp).
constexpr int kHeaderTag = (1 << 29) + 1, kDataTag = (1 << 29) + 3;  // the header: tags + 1 and + 2

DType dtype_named(const std::string& name) {
  for (DType t : {DType::f32, DType::bf16})
    if (dtype_name(t) == name) return t;
  fail("pipeline", "a gathered weight of dtype '{}'", name);
}

// The bytes a weight is saved as: f32 or bf16 as held, an f64 reference model's as f32
// (io::add_model_weights' rule).
std::pair<DType, std::vector<unsigned char>> saved_bytes(const Tensor& value) {
  OwnedTensor host(value.dtype(), Device::cpu, value.shape());
  copy_tensor(value, *host);
  if (value.dtype() == DType::f32 || value.dtype() == DType::bf16) {
    const auto* p = static_cast<const unsigned char*>(host->raw());
    return {value.dtype(), std::vector<unsigned char>(p, p + host->nbytes())};
  }
  KILN_CHECK(value.dtype() == DType::f64, "pipeline", "a weight of dtype {} to save", dtype_name(value.dtype()));
  std::vector<unsigned char> bytes(static_cast<size_t>(value.numel()) * sizeof(float));
  for (int64_t i = 0; i < value.numel(); ++i) {
    const auto f = static_cast<float>(host->data<double>()[i]);
    std::memcpy(bytes.data() + static_cast<size_t>(i) * sizeof(float), &f, sizeof(float));
  }
  return {DType::f32, std::move(bytes)};
}

}  // namespace

void send_text(dist::Communicator& pipeline, int peer, int tag, const std::string& text, std::string_view what) {
  const auto size = static_cast<int64_t>(text.size());
  pipeline.send(&size, sizeof(size), peer, tag, what);
  pipeline.send(text.data(), size, peer, tag + 1, what);
}

std::string recv_text(dist::Communicator& pipeline, int peer, int tag, std::string_view what) {
  int64_t size = 0;
  pipeline.recv(&size, sizeof(size), peer, tag, what);
  std::string text(static_cast<size_t>(size), '\0');
  pipeline.recv(text.data(), size, peer, tag + 1, what);
  return text;
}

bool saves_weight(const Model& model, const Parameter& parameter) {
  const Backbone& backbone = model.backbone();
  return !(backbone.has_embedding() && &parameter == &backbone.embedding() && !model.options().builds_layer(0));
}

std::vector<GatheredWeight> gather_stage_weights(const Model& model, dist::Communicator& pipeline) {
  if (pipeline.rank() != 0) {
    json header = json::array();
    std::vector<unsigned char> data;
    for (const auto& p : model.parameters()) {
      if (!saves_weight(model, *p)) continue;
      auto [dtype, bytes] = saved_bytes(p->value());
      std::vector<int64_t> shape;
      for (int d = 0; d < p->value().rank(); ++d) shape.push_back(p->value().size(d));
      header.push_back({{"name", p->name()}, {"dtype", std::string(dtype_name(dtype))}, {"shape", shape}});
      data.insert(data.end(), bytes.begin(), bytes.end());
    }
    send_text(pipeline, 0, kHeaderTag, header.dump(), "weights to save");
    pipeline.send(data.data(), static_cast<int64_t>(data.size()), 0, kDataTag, "weights to save");
    return {};
  }
  std::vector<GatheredWeight> out;
  for (int r = 1; r < pipeline.world_size(); ++r) {
    const std::string text = recv_text(pipeline, r, kHeaderTag, "weights to save");
    size_t total = 0;
    const size_t first = out.size();
    for (const json& w : json::parse(text)) {
      GatheredWeight g;
      g.name = w.at("name").get<std::string>();
      g.dtype = dtype_named(w.at("dtype").get<std::string>());
      g.shape = w.at("shape").get<std::vector<int64_t>>();
      int64_t numel = 1;
      for (int64_t d : g.shape) numel *= d;
      g.bytes.resize(static_cast<size_t>(numel) * dtype_size(g.dtype));
      total += g.bytes.size();
      out.push_back(std::move(g));
    }
    std::vector<unsigned char> data(total);
    pipeline.recv(data.data(), static_cast<int64_t>(total), r, kDataTag, "weights to save");
    size_t at = 0;
    for (size_t i = first; i < out.size(); ++i) {
      std::memcpy(out[i].bytes.data(), data.data() + at, out[i].bytes.size());
      at += out[i].bytes.size();
    }
  }
  return out;
}

void add_gathered_weights(io::SafetensorsWriter& writer, const std::vector<GatheredWeight>& weights) {
  for (const GatheredWeight& w : weights) writer.add_raw(w.name, w.dtype, w.shape, w.bytes.data(), w.bytes.size());
}

void load_stage_weights(Model& whole, const Model& mine, const std::vector<GatheredWeight>& others) {
  std::map<std::string, const GatheredWeight*> by_name;
  for (const GatheredWeight& w : others) by_name[w.name] = &w;
  for (const auto& p : whole.parameters()) {
    const Tensor into = p->value();
    if (const Parameter* own = mine.find_parameter(p->name())) {
      copy_tensor(own->value(), into);
      continue;
    }
    const auto it = by_name.find(p->name());
    KILN_CHECK(it != by_name.end(), "pipeline", "weight '{}' is in no stage's model", p->name());
    const GatheredWeight& w = *it->second;
    KILN_CHECK(w.bytes.size() == static_cast<size_t>(into.numel()) * dtype_size(w.dtype), "pipeline",
               "weight '{}': {} bytes of {} for {} elements", p->name(), w.bytes.size(), dtype_name(w.dtype),
               into.numel());
    OwnedTensor host(w.dtype, Device::cpu, into.shape());
    std::memcpy(host->raw(), w.bytes.data(), w.bytes.size());
    if (w.dtype == into.dtype()) {
      copy_tensor(*host, into);
    } else {  // bf16 masters into an f32 model, or the like
      OwnedTensor converted(into.dtype(), Device::cpu, into.shape());
      ops::convert(whole.exec(), *host, *converted);
      copy_tensor(*converted, into);
    }
  }
}

std::vector<OptimizerStateTensor> saved_state(const Model& model, const Optimizer& optimizer) {
  std::vector<std::string> left_out;  // "<parameter>." of each weight another rank saves
  for (const auto& p : model.parameters())
    if (!saves_weight(model, *p)) left_out.push_back(p->name() + ".");
  std::vector<OptimizerStateTensor> out;
  for (OptimizerStateTensor& t : optimizer.state_tensors()) {
    const bool theirs = std::any_of(left_out.begin(), left_out.end(),
                                    [&](const std::string& prefix) { return t.name.starts_with(prefix); });
    if (!theirs) out.push_back(std::move(t));
  }
  return out;
}

}  // namespace kiln
