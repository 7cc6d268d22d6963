// `kiln bench-kda`: the KDA delta rule alone (ops/kda/kda.h) on the GPU, forward and
// forward + backward, for each kernel named by --kernels (recurrent, chunked), at B
// sequences of T tokens, H heads, d_k = d_v = D: the shape of issue 40's comparison with
// flash-linear-attention's chunk_kda (bench/fla_peer_kda.py times the peer). Inputs as the
// mixer makes them: q and k unit rows per head, g = -exp(A) softplus(x) a log decay per
// channel (A = log 4), beta a sigmoid; each kernel runs --warmup untimed passes, then
// --iters timed ones (the median reported), its workspace included in the memory figure.
#include "cli/commands.h"
#include "core/device_choice.h"
#include "core/device_memory.h"
#include "core/error.h"
#include "core/exec_context.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "ops/kda/kda.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace kiln::cli {

namespace {

struct KdaBenchShape {
  int64_t batch, seq, heads, dim;
  DType dtype;
};

// A host tensor of `values` as a device tensor of `dtype`.
OwnedTensor on_device(const std::vector<float>& values, Shape shape, DType dtype) {
  OwnedTensor host(dtype, Device::cpu, shape);
  if (dtype == DType::f32)
    std::copy(values.begin(), values.end(), host->data<float>());
  else
    for (size_t i = 0; i < values.size(); ++i) static_cast<uint16_t*>(host->raw())[i] = float_to_bf16(values[i]);
  OwnedTensor dev(dtype, Device::cuda, shape);
  copy_tensor(*host, *dev);
  return dev;
}

struct KdaInputs {
  OwnedTensor q, k, v, g, beta, dout, cu;
};

KdaInputs make_inputs(const KdaBenchShape& s) {
  const int64_t n = s.batch * s.seq, H = s.heads, D = s.dim;
  Rng rng(40);
  auto normal = [&](int64_t count) {
    std::vector<float> x(count);
    for (float& e : x) e = static_cast<float>(rng.normal());
    return x;
  };
  auto unit_rows = [&](std::vector<float> x) {
    for (int64_t r = 0; r < n * H; ++r) {
      double norm = 0;
      for (int64_t i = 0; i < D; ++i) norm += double(x[r * D + i]) * x[r * D + i];
      for (int64_t i = 0; i < D; ++i) x[r * D + i] = static_cast<float>(x[r * D + i] / std::sqrt(norm));
    }
    return x;
  };
  std::vector<float> g = normal(n * H * D), beta = normal(n * H);
  for (float& e : g) e = static_cast<float>(-4.0 * std::log1p(std::exp(double(e) - 4.0)));  // softplus(x - 4) x 4
  for (float& e : beta) e = static_cast<float>(1 / (1 + std::exp(-double(e))));
  std::vector<int32_t> cu(s.batch + 1);
  for (int64_t b = 0; b <= s.batch; ++b) cu[b] = static_cast<int32_t>(b * s.seq);
  OwnedTensor cu_host(DType::i32, Device::cpu, Shape{s.batch + 1}), cu_dev(DType::i32, Device::cuda, Shape{s.batch + 1});
  std::copy(cu.begin(), cu.end(), cu_host->data<int32_t>());
  copy_tensor(*cu_host, *cu_dev);
  const Shape ks{n, H, D}, bs{n, H};
  return {on_device(unit_rows(normal(n * H * D)), ks, s.dtype), on_device(unit_rows(normal(n * H * D)), ks, s.dtype),
          on_device(normal(n * H * D), ks, s.dtype),           on_device(g, ks, s.dtype),
          on_device(beta, bs, s.dtype),                        on_device(normal(n * H * D), ks, s.dtype),
          std::move(cu_dev)};
}

double median_ms(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

nlohmann::json bench_kernel(const KdaBenchShape& s, const KdaInputs& in, const std::string& kernel, int slice,
                            bool simt, bool bf16_grads, int64_t warmup, int64_t iters) {
  const bool chunked = kernel == "chunked";
  ops::KdaOptions options;
  options.gpu_slice = slice;
  options.gpu_tensor_cores = !simt;
  options.gpu_bf16_grads = bf16_grads;
  const int64_t n = s.batch * s.seq, H = s.heads, D = s.dim;
  const Shape ks{n, H, D}, bs{n, H};
  size_t free_before = 0, total = 0;
  cuda_memory_info(&free_before, &total);
  OwnedTensor out(s.dtype, Device::cuda, ks), dq(s.dtype, Device::cuda, ks), dk(s.dtype, Device::cuda, ks),
      dv(s.dtype, Device::cuda, ks), dg(s.dtype, Device::cuda, ks), dbeta(s.dtype, Device::cuda, bs);
  const int64_t fwd_ws = chunked ? ops::kda_chunked_workspace(n, H, D, D, s.batch) : 0;
  const int64_t bwd_ws = chunked ? fwd_ws : ops::kda_backward_workspace(n, H, D, D, s.batch);
  OwnedTensor ws(DType::f32, Device::cuda, Shape{std::max<int64_t>({fwd_ws, bwd_ws, 1})});
  size_t free_after = 0;
  cuda_memory_info(&free_after, &total);
  const ExecContext& ctx = process_exec();
  auto forward = [&] {
    if (chunked)
      ops::kda_chunked_forward(ctx, *in.q, *in.k, *in.v, *in.g, *in.beta, *in.cu, Tensor(), options, *out, Tensor(),
                               *ws);
    else
      ops::kda_recurrent_forward(ctx, *in.q, *in.k, *in.v, *in.g, *in.beta, *in.cu, Tensor(), {}, *out);
  };
  auto backward = [&] {
    if (chunked)
      ops::kda_chunked_backward(ctx, *in.q, *in.k, *in.v, *in.g, *in.beta, *in.cu, Tensor(), *in.dout, Tensor(),
                                options, *dq, *dk, *dv, *dg, *dbeta, Tensor(), *ws);
    else
      ops::kda_recurrent_backward(ctx, *in.q, *in.k, *in.v, *in.g, *in.beta, *in.cu, Tensor(), *in.dout, Tensor(), {},
                                  *dq, *dk, *dv, *dg, *dbeta, Tensor(), *ws);
  };
  auto timed = [&](auto&& body) {
    for (int64_t i = 0; i < warmup; ++i) body();
    synchronize_stream(ctx);
    std::vector<double> ms;
    for (int64_t i = 0; i < iters; ++i) {
      const auto start = std::chrono::steady_clock::now();
      body();
      synchronize_stream(ctx);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    return median_ms(ms);
  };
  const double fwd = timed(forward);
  const double fwd_bwd = timed([&] {
    forward();
    backward();
  });
  return {{"kernel", kernel},
          {"slice", slice},
          {"tensor_cores", !simt},
          {"bf16_grads", bf16_grads},
          {"B", s.batch},
          {"T", s.seq},
          {"H", H},
          {"D", D},
          {"dtype", dtype_name(s.dtype)},
          {"fwd_ms", fwd},
          {"fwd_bwd_ms", fwd_bwd},
          {"tensors_and_workspace_gib", double(free_before - free_after) / double(1 << 30)}};
}

}  // namespace

void add_bench_kda_command(CLI::App& app) {
  struct Options {
    int64_t batch = 8, seq = 4096, heads = 16, warmup = 3, iters = 10;
    int slice = 0;
    bool simt = false;
    bool bf16_grads = false;
    std::vector<int64_t> dims{128, 64};
    std::vector<std::string> kernels{"recurrent", "chunked"};
    std::string dtype = "bf16", json;
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("bench-kda", "time the KDA delta rule's GPU kernels alone (forward, forward+backward)");
  cmd->add_option("--batch", o->batch, "sequences")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--seq", o->seq, "tokens per sequence")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--heads", o->heads, "heads")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--dims", o->dims, "d_k = d_v per head (comma-separated)")->delimiter(',')->capture_default_str();
  cmd->add_option("--kernels", o->kernels, "recurrent, chunked (comma-separated)")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::IsMember({"recurrent", "chunked"}));
  cmd->add_option("--slice", o->slice, "the chunked kernels' state columns per sequential block: 8, 16, 32; 0 = chosen")
      ->capture_default_str()
      ->check(CLI::IsMember({0, 8, 16, 32}));
  cmd->add_flag("--simt", o->simt, "the chunked kernels' chunk products in fp32 SIMT, not on tensor cores");
  cmd->add_flag("--bf16-grads", o->bf16_grads,
                "the chunked backward's chunk gradients on bf16 tensor cores (model.kda.gpu_kernel = chunked_bf16)");
  cmd->add_option("--dtype", o->dtype, "bf16 | f32")->capture_default_str()->check(CLI::IsMember({"bf16", "f32"}));
  cmd->add_option("--warmup", o->warmup, "untimed passes first")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--iters", o->iters, "timed passes (the median is reported)")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--json", o->json, "also append each result as a JSON line to this file");
  cmd->callback([o] {
    KILN_CHECK(resolve_device("auto") == Device::cuda, "bench-kda", "needs a CUDA GPU (none found)");
    std::ofstream json;
    if (!o->json.empty()) {
      json.open(o->json, std::ios::app);
      KILN_CHECK(json.good(), "bench-kda", "--json {}: cannot write", o->json);
    }
    fmt::print("{:>9} {:>3} {:>6} {:>3} {:>4} {:>5} {:>10} {:>12} {:>10}\n", "kernel", "B", "T", "H", "D", "dtype",
               "fwd ms", "fwd+bwd ms", "mem GiB");
    for (int64_t dim : o->dims) {
      const KdaBenchShape shape{o->batch, o->seq, o->heads, dim, o->dtype == "f32" ? DType::f32 : DType::bf16};
      const KdaInputs inputs = make_inputs(shape);
      for (const std::string& kernel : o->kernels) {
        const nlohmann::json r = bench_kernel(shape, inputs, kernel, o->slice, o->simt, o->bf16_grads, o->warmup, o->iters);
        fmt::print("{:>9} {:>3} {:>6} {:>3} {:>4} {:>5} {:>10.3f} {:>12.3f} {:>10.2f}\n", kernel, shape.batch,
                   shape.seq, shape.heads, dim, o->dtype, r["fwd_ms"].get<double>(), r["fwd_bwd_ms"].get<double>(),
                   r["tensors_and_workspace_gib"].get<double>());
        if (json.is_open()) json << r.dump() << "\n" << std::flush;
      }
    }
  });
}

}  // namespace kiln::cli
