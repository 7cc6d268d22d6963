// Shared pieces of the MoE GPU suites (test_gpu_moe_ops.cpp, test_gpu_moe_routing.cpp):
// the awkward shapes, expert-id patterns (random, some experts without tokens, one expert
// in every token's choices), dispatches on the host and the device, and transfers of f32
// host values as f32 or bf16 device tensors.
#pragma once

#include "core/rng.h"
#include "gpu/bf16_tensors.h"
#include "gpu/gpu_harness.h"
#include "ops/moe/moe.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

namespace kiln::gpu_test {

// Who gets the tokens: each token's k distinct experts uniformly; only the first
// max(k, E / 3) experts (the others get none); expert E - 1 in every token's choices.
enum class Load { random, few_experts, one_takes_all };

inline const char* load_name(Load l) {
  return l == Load::random ? "random" : l == Load::few_experts ? "few" : "one_takes_all";
}

struct MoeShape {
  int64_t tokens, experts, top_k;
  Load load;
  std::string str() const { return fmt::format("T{}_E{}_k{}_{}", tokens, experts, top_k, load_name(load)); }
};

// T = 1, 7, 130; (E, k) from one expert to 64 with top 8; every load.
inline std::vector<MoeShape> moe_shapes() {
  std::vector<MoeShape> shapes;
  for (int64_t t : {1, 7, 130})
    for (auto [e, k] : {std::pair<int64_t, int64_t>{1, 1}, {3, 1}, {3, 2}, {8, 1}, {8, 2}, {8, 8}, {64, 1}, {64, 2},
                        {64, 8}})
      for (Load load : {Load::random, Load::few_experts, Load::one_takes_all}) shapes.push_back({t, e, k, load});
  return shapes;
}

// Expert ids [T, k], distinct within a token.
inline std::vector<int32_t> expert_ids(const MoeShape& s, uint64_t seed) {
  Rng rng(seed);
  const int64_t pool = s.load == Load::few_experts ? std::max(s.top_k, s.experts / 3) : s.experts;
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::vector<int32_t> candidates(static_cast<size_t>(pool));
    std::iota(candidates.begin(), candidates.end(), 0);
    for (int64_t j = 0; j < s.top_k; ++j) {  // partial Fisher-Yates
      const auto pick = j + static_cast<int64_t>(rng.below(static_cast<uint64_t>(pool - j)));
      std::swap(candidates[static_cast<size_t>(j)], candidates[static_cast<size_t>(pick)]);
    }
    std::vector<int32_t> mine(candidates.begin(), candidates.begin() + s.top_k);
    if (s.load == Load::one_takes_all) {
      const int32_t all = static_cast<int32_t>(s.experts - 1);
      if (std::find(mine.begin(), mine.end(), all) == mine.end()) mine[static_cast<size_t>(t % s.top_k)] = all;
    }
    ids.insert(ids.end(), mine.begin(), mine.end());
  }
  return ids;
}

// A dispatch's four tensors on one device.
struct DispatchTensors {
  OwnedTensor counts, offsets, pair_of_row, row_of_pair;
  ops::MoeDispatch d;
  DispatchTensors(Device device, int64_t tokens, int64_t k, int64_t experts)
      : counts(DType::i32, device, Shape{experts}),
        offsets(DType::i32, device, Shape{experts + 1}),
        pair_of_row(DType::i32, device, Shape{tokens * k}),
        row_of_pair(DType::i32, device, Shape{tokens * k}) {
    d = {experts, k, *counts, *offsets, *pair_of_row, *row_of_pair};
  }
};

inline OwnedTensor ints_tensor(const std::vector<int32_t>& v, Shape shape) {
  OwnedTensor t(DType::i32, Device::cpu, shape);
  std::copy(v.begin(), v.end(), t->data<int32_t>());
  return t;
}

inline std::vector<int32_t> ints_of(const Tensor& host) {
  return {host.data<int32_t>(), host.data<int32_t>() + host.numel()};
}

// The CPU reference's dispatch of the ids, and the same dispatch uploaded to the GPU.
struct DispatchPair {
  DispatchTensors host, device;
  DispatchPair(const MoeShape& s, const std::vector<int32_t>& ids)
      : host(Device::cpu, s.tokens, s.top_k, s.experts), device(Device::cuda, s.tokens, s.top_k, s.experts) {
    ops::moe_dispatch(*ints_tensor(ids, Shape{s.tokens, s.top_k}), host.d);
    for (auto [from, to] : {std::pair{&host.counts, &device.counts}, std::pair{&host.offsets, &device.offsets},
                            std::pair{&host.pair_of_row, &device.pair_of_row},
                            std::pair{&host.row_of_pair, &device.row_of_pair}})
      copy_tensor(**from, **to);
  }
};

// f32 host values as a device tensor of `dtype` (bf16: rounded, as the mixed path stores them).
inline OwnedTensor upload(const Tensor& host_f32, DType dtype) {
  return dtype == DType::bf16 ? to_device(*bf16_of(host_f32)) : to_device(host_f32);
}

// A device tensor (f32 or bf16) as host f32 values.
inline OwnedTensor download_f32(const Tensor& dev) {
  OwnedTensor host = to_host(dev);
  return dev.dtype() == DType::bf16 ? f32_of_bf16(*host) : std::move(host);
}

// A poisoned device output.
inline OwnedTensor poisoned(DType dtype, Shape shape) {
  OwnedTensor t(dtype, Device::cuda, shape);
  poison(*t);
  return t;
}

// Random f32 host values; on the bf16 path rounded to bf16 so both sides read the same.
inline OwnedTensor inputs(Shape shape, uint64_t seed, DType dtype, double scale = 1.0) {
  OwnedTensor t(DType::f32, Device::cpu, shape);
  Rng rng(seed);
  for (int64_t i = 0; i < t->numel(); ++i) t->data<float>()[i] = static_cast<float>(rng.normal() * scale);
  if (dtype == DType::bf16) round_to_bf16(*t);
  return t;
}

inline std::string dtype_label(DType d) { return d == DType::bf16 ? "bf16" : "f32"; }

// Device bytes of two runs agree.
inline bool same_device_bytes(const Tensor& a, const Tensor& b) { return same_bytes(*to_host(a), *to_host(b)); }

}  // namespace kiln::gpu_test
