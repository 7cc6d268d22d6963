// The dense model's GPU checks beyond single ops (each op against its CPU reference is a
// row of the op table, test_gpu_op_table.cpp): kernels that must give each other's bits
// (multi-tensor AdamW, repeated launches), the finiteness check, then the whole model
// against the golden file, recompute and the uniform-batch attention layout.
#include "gpu/gpu_harness.h"
#include "io/export_names.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "ops/attention/attention_cudnn.h"
#include "ops/elementwise/elementwise.h"
#include "ops/optim/adamw.h"
#include "ops/rms_norm/rms_norm.h"
#include "test_util.h"

namespace kiln {
namespace {

using namespace gpu_test;

class Dense : public GpuTest {};

// A launch on a long row keeps working after many calls (no per-call allocation or state).
TEST_F(Dense, RmsNormRepeatedCallsAreStable) {
  const Shape xs{64, 8192};
  OwnedTensor x = test::random_tensor(DType::f32, xs, 99);
  OwnedTensor xd = to_device(*x), yd(DType::f32, Device::cuda, xs), rstdd(DType::f32, Device::cuda, Shape{64});
  ops::rms_norm_forward(process_exec(), *xd, Tensor(), 1e-6, *yd, *rstdd);
  OwnedTensor first = to_host(*yd);
  for (int i = 0; i < 100; ++i) ops::rms_norm_forward(process_exec(), *xd, Tensor(), 1e-6, *yd, *rstdd);
  OwnedTensor last = to_host(*yd);
  EXPECT_TRUE(same_bytes(*first, *last));
}

TEST_F(Dense, AllFiniteFindsOneInfinity) {
  const int64_t n = 100003;
  OwnedTensor a = to_device(*test::random_tensor(DType::f32, Shape{n}, 61));
  EXPECT_TRUE(ops::all_finite(process_exec(), *a));
  std::vector<float> bad(static_cast<size_t>(n), 1.0f);
  bad[77777] = INFINITY;
  copy_tensor(Tensor(bad.data(), DType::f32, Device::cpu, Shape{n}), *a);
  EXPECT_FALSE(ops::all_finite(process_exec(), *a));
}

// kernel's bits, for sizes below, at and across its 65536-element chunks.
TEST_F(Dense, AdamWManyTensorsMatchesOneByOne) {
  ops::AdamWStep s;
  s.lr = 3e-3;
  s.bias_correction1 = 1 - std::pow(0.9, 7);
  s.bias_correction2 = 1 - std::pow(0.95, 7);
  const int64_t sizes[] = {1, 1000, 65536, 65537, 200003};
  std::vector<ops::AdamWTensor> many;
  std::vector<OwnedTensor> keep;
  uint64_t seed = 300;
  for (int64_t n : sizes) {
    const OwnedTensor p0 = test::random_tensor(DType::f32, Shape{n}, ++seed), g = test::random_tensor(DType::f32, Shape{n}, ++seed);
    const OwnedTensor m0 = test::random_tensor(DType::f32, Shape{n}, ++seed, 0.1);
    OwnedTensor v0 = test::random_tensor(DType::f32, Shape{n}, ++seed, 0.1);
    for (int64_t i = 0; i < n; ++i) v0->data<float>()[i] = std::fabs(v0->data<float>()[i]);
    const double decay = n % 2 ? 0.1 : 0.0;
    // Two copies on the GPU: one updated by the multi-tensor path, one tensor by tensor.
    OwnedTensor pa = to_device(*p0), ma = to_device(*m0), va = to_device(*v0), ga = to_device(*g);
    OwnedTensor pb = to_device(*p0), mb = to_device(*m0), vb = to_device(*v0);
    many.push_back({*pa, *ga, *ma, *va, decay});
    ops::AdamWStep one = s;
    one.weight_decay = decay;
    ops::adamw_update(process_exec(), *pb, *ga, *mb, *vb, one);
    for (OwnedTensor* t : {&pa, &ma, &va, &ga, &pb, &mb, &vb}) keep.push_back(std::move(*t));
  }
  ops::AdamWDeviceTable table;
  ops::adamw_update_all(process_exec(), many, s, table);
  for (size_t i = 0; i < many.size(); ++i) {
    const OwnedTensor& pb = keep[7 * i + 4];
    const OwnedTensor& mb = keep[7 * i + 5];
    const OwnedTensor& vb = keep[7 * i + 6];
    EXPECT_TRUE(same_bytes(*to_host(many[i].param), *to_host(*pb))) << "param of size " << sizes[i];
    EXPECT_TRUE(same_bytes(*to_host(many[i].m), *to_host(*mb))) << "m of size " << sizes[i];
    EXPECT_TRUE(same_bytes(*to_host(many[i].v), *to_host(*vb))) << "v of size " << sizes[i];
  }
}

// The update whose scalars live in device memory (the captured training step's):
// gradients times grad_scale give the bits of scaling the gradients first and updating
// tensor by tensor; with skip set nothing changes.
TEST_F(Dense, AdamWWithDeviceScalarsMatchesScaledUpdate) {
  ops::AdamWStep s;
  s.bias_correction1 = 1 - std::pow(0.9, 3);
  s.bias_correction2 = 1 - std::pow(0.95, 3);
  // Group 2's slot, the others left unset: each optimizer group reads only its own.
  constexpr int kGroup = 2;
  ops::DeviceUpdateScalars host{};
  ops::GroupUpdateScalars& group = host.group[kGroup];
  group.lr = 2e-3f;
  group.bias_correction1 = static_cast<float>(s.bias_correction1);
  group.bias_correction2 = static_cast<float>(s.bias_correction2);
  host.grad_scale = 0.37f;
  Storage device(Device::cuda, sizeof(host));
  for (const int32_t skip : {0, 1}) {
    SCOPED_TRACE(skip ? "skip" : "apply");
    host.skip = skip;
    device_copy(device.data(), Device::cuda, &host, Device::cpu, sizeof(host));
    std::vector<ops::AdamWTensor> many;
    std::vector<OwnedTensor> keep;
    std::vector<OwnedTensor> before;
    uint64_t seed = 700;
    for (const int64_t n : {int64_t{3}, int64_t{65536}, int64_t{70001}}) {
      const OwnedTensor p0 = test::random_tensor(DType::f32, Shape{n}, ++seed);
      const OwnedTensor g0 = test::random_tensor(DType::f32, Shape{n}, ++seed);
      const OwnedTensor m0 = test::random_tensor(DType::f32, Shape{n}, ++seed, 0.1);
      OwnedTensor v0 = test::random_tensor(DType::f32, Shape{n}, ++seed, 0.1);
      for (int64_t i = 0; i < n; ++i) v0->data<float>()[i] = std::fabs(v0->data<float>()[i]);
      const double decay = n % 2 ? 0.1 : 0.0;
      OwnedTensor pa = to_device(*p0), ma = to_device(*m0), va = to_device(*v0), ga = to_device(*g0);
      OwnedTensor pb = to_device(*p0), mb = to_device(*m0), vb = to_device(*v0), gb = to_device(*g0);
      many.push_back({*pa, *ga, *ma, *va, decay});
      if (!skip) {  // the reference: scale the gradient, then the per-tensor update
        ops::scale_inplace(process_exec(), *gb, host.grad_scale);
        ops::AdamWStep one = s;
        one.lr = group.lr;
        one.weight_decay = decay;
        ops::adamw_update(process_exec(), *pb, *gb, *mb, *vb, one);
      }
      for (OwnedTensor* t : {&pa, &ma, &va, &ga, &pb, &mb, &vb, &gb}) keep.push_back(std::move(*t));
    }
    ops::AdamWDeviceTable table;
    ops::adamw_update_all_on_device(process_exec(), many, s, static_cast<const ops::DeviceUpdateScalars*>(device.data()), kGroup, table);
    for (size_t i = 0; i < many.size(); ++i) {
      EXPECT_TRUE(same_bytes(*to_host(many[i].param), *to_host(*keep[8 * i + 4]))) << "param " << i;
      EXPECT_TRUE(same_bytes(*to_host(many[i].m), *to_host(*keep[8 * i + 5]))) << "m " << i;
      EXPECT_TRUE(same_bytes(*to_host(many[i].v), *to_host(*keep[8 * i + 6]))) << "v " << i;
    }
  }
}

// The golden file of scripts/make_golden.py (transformers' Qwen3, untied, 2 layers): its
// weights, the model's shape and the packed batch the reference values were computed on.
struct GoldenCase {
  io::SafetensorsFile file;
  ModelConfig config;
  HostBatch batch;

  static GoldenCase load() {
    GoldenCase g{io::SafetensorsFile::open(test::test_data_dir() + "/golden/qwen3_tiny_untied.safetensors"), {}, {}};
    ModelConfig& c = g.config;
    c.vocab_size = 259, c.hidden = 64, c.layers = 2, c.heads = 4, c.kv_heads = 2, c.head_dim = 16, c.ffn_hidden = 128;
    c.max_seq_len = 256, c.tie_embeddings = false;
    auto ints = [&](const char* name) {
      const OwnedTensor t = io::read_tensor(g.file, name, DType::i32);
      return std::vector<int32_t>(t->data<int32_t>(), t->data<int32_t>() + t->numel());
    };
    HostBatch& b = g.batch;
    b.tokens = ints("input_ids");
    b.targets = ints("targets");
    b.cu_seqlens = ints("cu_seqlens");
    for (size_t s = 0; s + 1 < b.cu_seqlens.size(); ++s)
      for (int32_t i = b.cu_seqlens[s]; i < b.cu_seqlens[s + 1]; ++i) b.positions.push_back(i - b.cu_seqlens[s]);
    b.max_seqlen = 21;
    for (int32_t t : b.targets) b.target_count += t >= 0;
    return g;
  }
};

// The whole model on the GPU against transformers' logits, loss and gradients (computed
// in fp32 by scripts/make_golden.py), in fp32 and in bf16 mixed precision.
struct GoldenTolerance {
  double logits, loss, grads;
  double floor_fraction = kFloorFraction;
};

void check_golden_model(DType dtype, GoldenTolerance tol) {
  const GoldenCase golden = GoldenCase::load();
  const io::SafetensorsFile& file = golden.file;
  const ModelConfig& c = golden.config;
  const HostBatch& batch = golden.batch;
  BuildOptions options;
  options.device = Device::cuda;
  options.dtype = dtype;
  options.max_tokens = batch.size();
  options.loss_chunk_rows = 16;
  Model model(c, options);
  model.allocate();
  for (const auto& p : model.parameters()) io::read_into(file, io::hf_name(*p), p->value());
  model.load_batch(batch);
  std::vector<float> logits;
  model.logits(0, batch.size(), logits);
  const OwnedTensor expected = io::read_tensor(file, "logits", DType::f32);
  const double logits_error = expect_close("logits", Tensor(logits.data(), DType::f32, Device::cpu, expected->shape()),
                                           *to_f64(*expected), tol.logits, 0, tol.floor_fraction);
  model.zero_grads();
  const LossSums sums = model.forward_backward(1.0 / static_cast<double>(batch.target_count));
  const double expected_loss = io::read_tensor(file, "loss", DType::f32)->data<float>()[0];
  const double loss = sums.loss / static_cast<double>(sums.count);
  EXPECT_NEAR(loss, expected_loss, tol.loss * expected_loss);
  double grad_error = 0;
  for (const auto& p : model.parameters()) {
    const OwnedTensor want = io::read_tensor(file, "grad." + io::hf_name(*p), DType::f32);
    grad_error = std::max(grad_error, expect_close(p->name().c_str(), *to_host(p->grad()), *to_f64(*want), tol.grads,
                                                   0, tol.floor_fraction));
  }
  std::printf("golden model, %s: logits error %.2e, loss %.7f vs %.7f, worst gradient error %.2e\n",
              std::string(dtype_name(dtype)).c_str(), logits_error, loss, expected_loss, grad_error);
}

// Activation recompute on the GPU (bf16 path, cuDNN attention): the same loss and
// gradients to the bit as keeping every activation.
TEST_F(Dense, RecomputedBlocksGiveTheSameGradientsBf16) {
  const GoldenCase golden = GoldenCase::load();
  const io::SafetensorsFile& file = golden.file;
  const ModelConfig& c = golden.config;
  const HostBatch& batch = golden.batch;
  std::vector<std::vector<OwnedTensor>> grads;
  std::vector<double> losses;
  for (int64_t recompute : {0, 2}) {
    BuildOptions options;
    options.device = Device::cuda;
    options.dtype = DType::bf16;
    options.max_tokens = batch.size();
    options.loss_chunk_rows = 16;
    options.recompute_blocks = recompute;
    Model model(c, options);
    model.allocate();
    for (const auto& p : model.parameters()) io::read_into(file, io::hf_name(*p), p->value());
    model.load_batch(batch);
    model.zero_grads();
    losses.push_back(model.forward_backward(1.0 / static_cast<double>(batch.target_count)).loss);
    grads.emplace_back();
    for (const auto& p : model.parameters()) grads.back().push_back(to_host(p->grad()));
  }
  EXPECT_EQ(losses[0], losses[1]);
  for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_TRUE(same_bytes(*grads[0][i], *grads[1][i])) << "gradient " << i;
}

// A batch of equal-length rows is marked uniform and takes cuDNN's plain attention graphs;
// the same rows with an empty sequence appended are ragged (the bucketed graphs). The two
// must agree to bf16 noise: the same model, loss and gradients, only another kernel layout.
TEST_F(Dense, UniformRowsAgreeWithTheRaggedLayoutBf16) {
  const GoldenCase golden = GoldenCase::load();
  const ModelConfig& c = golden.config;
  constexpr int32_t kRows = 3, kLength = 40;
  HostBatch uniform;
  for (int32_t i = 0; i < kRows * kLength; ++i) {
    uniform.tokens.push_back(golden.batch.tokens[static_cast<size_t>(i) % golden.batch.tokens.size()]);
    uniform.targets.push_back((i * 7 + 3) % static_cast<int32_t>(c.vocab_size));
    uniform.positions.push_back(i % kLength);
  }
  for (int32_t r = 0; r <= kRows; ++r) uniform.cu_seqlens.push_back(r * kLength);
  uniform.max_seqlen = kLength;
  uniform.target_count = kRows * kLength;
  HostBatch ragged = uniform;
  ragged.cu_seqlens.push_back(kRows * kLength);  // an empty fourth sequence
  ASSERT_TRUE(uniform.uniform());
  ASSERT_FALSE(ragged.uniform());

  BuildOptions options;
  options.device = Device::cuda;
  options.dtype = DType::bf16;
  options.max_tokens = uniform.size();
  options.loss_chunk_rows = 16;
  Model model(c, options);
  model.allocate();
  for (const auto& p : model.parameters()) io::read_into(golden.file, io::hf_name(*p), p->value());
  std::vector<double> losses;
  std::vector<std::vector<OwnedTensor>> grads;
  for (const HostBatch* batch : {&uniform, &ragged}) {
    const int64_t graphs_before = cuda::attention_cudnn_graph_count();
    model.load_batch(*batch);
    model.zero_grads();
    const LossSums sums = model.forward_backward(1.0 / static_cast<double>(batch->target_count));
    losses.push_back(sums.loss / static_cast<double>(sums.count));
    if (batch == &uniform) {
      EXPECT_EQ(cuda::attention_cudnn_graph_count(), graphs_before + 2) << "plain graphs built";
    }
    grads.emplace_back();
    for (const auto& p : model.parameters()) grads.back().push_back(to_host(p->grad()));
  }
  EXPECT_NEAR(losses[0], losses[1], 1e-3 * losses[1]);
  const auto& params = model.parameters();
  for (size_t i = 0; i < grads[0].size(); ++i)
    expect_close(params[i]->name().c_str(), *grads[0][i], *to_f64(*grads[1][i]), 3e-2, 0, 1.0);
}

TEST_F(Dense, GoldenModelOnGpu) { check_golden_model(DType::f32, {1e-4, 1e-4, 1e-3}); }

// bf16 rounds every GEMM and attention input and the logits (relative step 2^-8); through
// two layers, the head and the backward the roundings compound, and single elements near
// zero carry errors of the size of their terms. So bf16 results are judged against the
// largest value of each tensor (floor_fraction 1: max |err| / max |ref|), measured on the
// H200 at about 1% for the logits and a few % for gradients; the mean loss, where the
// roundings average out, matched to 3e-5. A wrong wiring (a stale weight copy, a swapped
// operand, fp32 read as bf16) is off by O(1) of the scale and fails by far.
TEST_F(Dense, GoldenModelOnGpuBf16) { check_golden_model(DType::bf16, {3e-2, 1e-3, 6e-2, 1.0}); }

}  // namespace
}  // namespace kiln
