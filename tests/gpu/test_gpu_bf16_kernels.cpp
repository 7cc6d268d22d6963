// The kernels of the mixed-precision path (ops/mixed_precision.h) that no op front end
// wraps alone, called directly: the dtype casts (every bit pattern, specials, ties), the
// cross-entropy rows of a logits chunk, the skinny GEMM of decode steps and the decoder's
// fused projections, against fp64 CPU references computed from the same inputs (bf16
// inputs are random values rounded to bf16 first, kiln::float_to_bf16, so both sides read
// identical numbers). Outputs are poisoned with NaN bytes before each run; NaN/Inf never
// pass. The ops with a front end (norms, RoPE, SwiGLU, the q|k|v split, adds, ...) are
// rows of the op table (test_gpu_op_table.cpp).
//
// Tolerances: max over elements of |gpu - ref| / max(|ref|, floor). The floor is
// kFloorFraction of the output's scale unless a row says otherwise.
//   output                           tolerance  why
//   casts                            bit-exact  conversions (round to nearest even)
//   CE grad                          1e-2       one bf16 rounding (8 significant bits: at most
//                                               2^-8 = 3.9e-3 relative) over fp32 math; floor 1%
//                                               of its terms, |p * zfactor| + [target], so every
//                                               logit, however small, is checked
//   row_stats (f64 from fp32 lse)    1e-5       fp32 logsumexp (__expf: ~2 ulp near the max);
//                                               loss judged against |lse| + |target logit|
//   decode projections (the decoder's fused norm/residual/SwiGLU products, <= 8 rows):
//     norm_gemv f32                  2e-4       fp32 dot over staged bf16 rows; floor sum |terms|
//                                               (a staged value may round the other way from the
//                                               host's replica of the norm: 2^-8 of one term)
//     norm_gemv bf16, residual add   1e-2       one bf16 rounding; floor sum |terms| (+ |x0|)
//     swiglu                         2e-2       bf16 gate, up and output: three roundings;
//                                               floor |g u| + 1e-3 (terms_g |u| + terms_u |g|)
#include "core/device_memory.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "gpu/gpu_harness.h"
#include "grad_check.h"
#include "infer/decoder_cuda.h"
#include "ops/cross_entropy/cross_entropy_cuda.h"
#include "ops/cross_entropy/lm_head_loss.h"
#include "ops/decode/decode_kernels.h"
#include "ops/elementwise/elementwise_cuda.h"
#include "ops/linear/linear_cuda.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

constexpr double kBf16Tol = 1e-2;
constexpr double kStatsTol = 1e-5;
constexpr float kEps = 1e-6f;

// ---- host data ---------------------------------------------------------------------------

std::vector<float> random_f32(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.normal() * scale);
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]);
  return out;
}

std::vector<uint16_t> random_bf16(size_t n, uint64_t seed, double scale = 1.0) {
  return to_bf16(random_f32(n, seed, scale));
}

std::vector<float> bf16_values(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(v[i]);
  return out;
}

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

bool bf16_is_nan(uint16_t h) { return (h & 0x7fffu) > 0x7f80u; }

// ---- device buffers ------------------------------------------------------------------------

template <typename T>
DType dtype_for() {
  if constexpr (std::is_same_v<T, uint16_t>) return DType::bf16;
  else if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else return DType::i32;
}

// A flat device buffer holding `host` (bf16 travels as its 16 bits).
template <typename T>
OwnedTensor upload(const std::vector<T>& host) {
  const Shape shape{static_cast<int64_t>(host.size())};
  OwnedTensor dev(dtype_for<T>(), Device::cuda, shape);
  copy_tensor(Tensor(const_cast<T*>(host.data()), dtype_for<T>(), Device::cpu, shape), *dev);
  return dev;
}

// A poisoned (NaN bytes) device buffer of n elements.
template <typename T>
OwnedTensor poisoned(size_t n) {
  OwnedTensor dev(dtype_for<T>(), Device::cuda, Shape{static_cast<int64_t>(n)});
  poison(*dev);
  return dev;
}

template <typename T>
std::vector<T> download(const Tensor& dev) {
  std::vector<T> host(dev.nbytes() / sizeof(T));
  copy_tensor(dev, Tensor(host.data(), dev.dtype(), Device::cpu, dev.shape()));
  return host;
}

template <typename T>
T* ptr(const OwnedTensor& t) {
  return static_cast<T*>(t->raw());
}

// ---- comparison ----------------------------------------------------------------------------

// The op table's measure (op_table/op_compare.h); floors, when given, are each element's
// floor itself (already a fraction of its terms).
void expect_values_close(const std::string& name, const std::vector<float>& gpu, const std::vector<double>& ref,
                         double tolerance, double scale = 0, const std::vector<double>* floors = nullptr) {
  const op_test::Comparison c = floors ? op_test::compare(std::vector<double>(gpu.begin(), gpu.end()), ref, scale,
                                                          *floors, 1.0)
                                       : op_test::compare(std::vector<double>(gpu.begin(), gpu.end()), ref, scale);
  EXPECT_TRUE(c.within(tolerance)) << name << ": " << c.str() << ", tolerance " << tolerance;
  ::testing::Test::RecordProperty(name + "_max_rel_err", fmt::format("{:.3e}", c.worst));
}

void expect_bf16_close(const std::string& name, const std::vector<uint16_t>& gpu, const std::vector<double>& ref,
                       double tolerance, double scale = 0, const std::vector<double>* floors = nullptr) {
  expect_values_close(name, bf16_values(gpu), ref, tolerance, scale, floors);
}

class Bf16Kernels : public GpuTest {};

// ---- casts -----------------------------------------------------------------------------------

// Floats of every kind: normals over the whole exponent range, both zeros, infinities,
// the largest float (rounds up to inf), subnormals, exact ties of both parities, NaNs.
std::vector<float> cast_inputs(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch (rng.below(8)) {
      case 0: v[i] = static_cast<float>(rng.normal()); break;
      case 1: v[i] = static_cast<float>(rng.normal() * std::ldexp(1.0, static_cast<int>(rng.below(250)) - 125)); break;
      case 2: v[i] = float_of(static_cast<uint32_t>(rng.next_u64())); break;  // any bit pattern (some NaN)
      case 3: v[i] = float_of((static_cast<uint32_t>(rng.next_u64()) & 0xffff0000u) | 0x8000u); break;  // a tie
      case 4: v[i] = float_of(static_cast<uint32_t>(rng.below(0x00800000u) | rng.below(2) << 31)); break;  // subnormal
      default: v[i] = static_cast<float>(rng.normal() * 1e3); break;
    }
  }
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, FLT_MAX, -FLT_MAX, FLT_MIN, 1e-45f, NAN, 1.0f + 0x1p-8f,
                            1.0f + 0x1p-8f + 0x1p-7f, 65504.0f};
  for (size_t i = 0; i < std::size(specials) && i < n; ++i) v[i] = specials[i];
  return v;
}

TEST_F(Bf16Kernels, CastF32ToBf16RoundsToNearestEven) {
  for (size_t n : {size_t{1}, size_t{7}, size_t{8}, size_t{13}, size_t{1000}, (size_t{1} << 20) + 3}) {
    for (size_t offset : {size_t{0}, size_t{1}}) {  // offset 1: unaligned pointers, the scalar path
      SCOPED_TRACE(fmt::format("n={} offset={}", n, offset));
      const std::vector<float> src = cast_inputs(n + offset, 40 + n);
      OwnedTensor src_dev = upload(src), dst_dev = poisoned<uint16_t>(n + offset);
      cuda::cast_f32_to_bf16(process_exec(), ptr<float>(src_dev) + offset, static_cast<int64_t>(n), ptr<uint16_t>(dst_dev) + offset);
      const std::vector<uint16_t> dst = download<uint16_t>(*dst_dev);
      size_t mismatches = 0, first = 0;
      for (size_t i = offset; i < n + offset; ++i) {
        const bool ok = std::isnan(src[i]) ? bf16_is_nan(dst[i]) : dst[i] == float_to_bf16(src[i]);
        if (!ok && mismatches++ == 0) first = i;
      }
      EXPECT_EQ(mismatches, 0u) << "first at " << first << ": " << src[first] << " (0x" << std::hex << bits_of(src[first])
                                << ") -> 0x" << dst[first] << ", expected 0x" << float_to_bf16(src[first]);
      if (offset) {
        EXPECT_EQ(dst[0], 0xFFFFu) << "wrote before the start";
      }
    }
  }
}

TEST_F(Bf16Kernels, CastBf16ToF32IsExactAndRoundTrips) {
  for (size_t offset : {size_t{0}, size_t{1}}) {
    SCOPED_TRACE(fmt::format("offset={}", offset));
    // Every bf16 bit pattern, then a ragged tail.
    std::vector<uint16_t> src(65536 + 5 + offset);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint16_t>((i - offset) * 40503u);
    const size_t n = src.size() - offset;
    OwnedTensor src_dev = upload(src), f32_dev = poisoned<float>(src.size()), back_dev = poisoned<uint16_t>(src.size());
    cuda::cast_bf16_to_f32(process_exec(), ptr<uint16_t>(src_dev) + offset, static_cast<int64_t>(n), ptr<float>(f32_dev) + offset);
    cuda::cast_f32_to_bf16(process_exec(), ptr<float>(f32_dev) + offset, static_cast<int64_t>(n), ptr<uint16_t>(back_dev) + offset);
    const std::vector<float> f32 = download<float>(*f32_dev);
    const std::vector<uint16_t> back = download<uint16_t>(*back_dev);
    size_t bad_value = 0, bad_trip = 0;
    for (size_t i = offset; i < src.size(); ++i) {
      if (bf16_is_nan(src[i])) {
        bad_value += !std::isnan(f32[i]);
        bad_trip += !bf16_is_nan(back[i]);
      } else {
        bad_value += bits_of(f32[i]) != bits_of(bf16_to_float(src[i]));
        bad_trip += back[i] != src[i];
      }
    }
    EXPECT_EQ(bad_value, 0u) << "bf16 -> f32 must be exact";
    EXPECT_EQ(bad_trip, 0u) << "bf16 -> f32 -> bf16 must be the identity";
  }
}

// ---- cross-entropy -------------------------------------------------------------------------------------

struct CeOptions {
  float z_loss = 0, loss_scale = 1, softcap = 0;
};

// The reference of one row (fp64 from the fp32 logits): stats {loss, lse^2}, the gradient
// and the floors of its elements (1% of |p * zfactor| + [target], times the chain factors).
struct CeRow {
  double loss = 0, lse_sq = 0, loss_floor = 0;
  std::vector<double> grad, floors;
};

// logsumexp of a row after the softcap.
double ce_lse(const float* x, int64_t vocab, double cap) {
  double m = -INFINITY;
  std::vector<double> xc(static_cast<size_t>(vocab));
  for (int64_t j = 0; j < vocab; ++j) {
    xc[static_cast<size_t>(j)] = cap > 0 ? cap * std::tanh(x[j] / cap) : x[j];
    m = std::max(m, xc[static_cast<size_t>(j)]);
  }
  double sum = 0;
  for (double v : xc) sum += std::exp(v - m);
  return m + std::log(sum);
}

CeRow ce_reference(const float* x, int64_t vocab, int32_t target, const CeOptions& o, bool with_grad, double lse) {
  CeRow row;
  if (with_grad) {
    row.grad.assign(static_cast<size_t>(vocab), 0.0);
    row.floors.assign(static_cast<size_t>(vocab), 0.0);
  }
  if (target < 0) return row;
  const double cap = o.softcap;
  auto capped = [&](int64_t j) { return cap > 0 ? cap * std::tanh(x[j] / cap) : static_cast<double>(x[j]); };
  const double tl = capped(target);
  row.loss = lse - tl;
  row.lse_sq = lse * lse;
  row.loss_floor = std::fabs(lse) + std::fabs(tl);
  if (!with_grad) return row;
  const double zfactor = 1.0 + 2.0 * o.z_loss * lse;
  for (int64_t j = 0; j < vocab; ++j) {
    const double xc = capped(j), p = std::exp(xc - lse) * zfactor, hot = j == target ? 1.0 : 0.0;
    const double chain = (cap > 0 ? 1.0 - (xc / cap) * (xc / cap) : 1.0) * o.loss_scale;
    row.grad[static_cast<size_t>(j)] = (p - hot) * chain;
    row.floors[static_cast<size_t>(j)] = kFloorFraction * (std::fabs(p) + hot) * std::fabs(chain);
  }
  return row;
}

std::vector<int32_t> ce_targets(int64_t rows, int64_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    t[static_cast<size_t>(r)] = r % 4 == 1 ? -1 : static_cast<int32_t>((r * 7919 + 13) % vocab);
  return t;
}

// The reference of a whole chunk: row_stats and the gradient with their floors.
struct CeChunk {
  std::vector<double> stats, stats_floor, grad, grad_floor;
};

CeChunk ce_chunk_reference(const std::vector<float>& logits, const std::vector<int32_t>& targets, int64_t rows,
                           int64_t vocab, const CeOptions& o, bool grad) {
  CeChunk c;
  c.stats.resize(static_cast<size_t>(2 * rows));
  c.stats_floor.resize(c.stats.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits.data() + r * vocab;
    const int32_t t = targets[static_cast<size_t>(r)];
    const CeRow ref = ce_reference(x, vocab, t, o, grad, t < 0 ? 0.0 : ce_lse(x, vocab, o.softcap));
    c.stats[static_cast<size_t>(2 * r)] = ref.loss;
    c.stats[static_cast<size_t>(2 * r + 1)] = ref.lse_sq;
    c.stats_floor[static_cast<size_t>(2 * r)] = ref.loss_floor;
    c.stats_floor[static_cast<size_t>(2 * r + 1)] = ref.lse_sq;
    c.grad.insert(c.grad.end(), ref.grad.begin(), ref.grad.end());
    c.grad_floor.insert(c.grad_floor.end(), ref.floors.begin(), ref.floors.end());
  }
  return c;
}

TEST_F(Bf16Kernels, CrossEntropyRows) {
  const CeOptions option_sets[] = {{0, 1, 0}, {1e-2f, 1.0f / 37, 0}, {0, 0.5f, 30}, {1e-3f, 1.0f / 3, 5}};
  // rows, vocab: vector path (1000, 50304, 65536) and scalar path (1001).
  for (auto [rows, vocab] : {std::pair<int64_t, int64_t>{1, 1000}, {37, 1000}, {3, 50304}, {37, 50304}, {2, 65536},
                             {5, 1001}}) {
    for (const CeOptions& o : option_sets) {
      for (bool grad : {true, false}) {
        SCOPED_TRACE(fmt::format("rows={} vocab={} z={} scale={} softcap={} grad={}", rows, vocab, o.z_loss,
                                 o.loss_scale, o.softcap, grad));
        const size_t n = static_cast<size_t>(rows * vocab);
        const std::vector<float> logits = random_f32(n, 90 + n, 2.5);
        const std::vector<int32_t> targets = ce_targets(rows, vocab);
        OwnedTensor logits_dev = upload(logits), targets_dev = upload(targets);
        OwnedTensor stats_dev = poisoned<double>(static_cast<size_t>(2 * rows)), grad_dev = poisoned<uint16_t>(n);
        std::vector<double> stats_runs[2];
        std::vector<uint16_t> grad_runs[2];
        for (int run = 0; run < 2; ++run) {
          cuda::cross_entropy_rows_to_bf16(process_exec(), ptr<float>(logits_dev), vocab, ptr<int32_t>(targets_dev), rows, vocab, o.z_loss,
                                           o.loss_scale, o.softcap, grad, ptr<double>(stats_dev),
                                           ptr<uint16_t>(grad_dev));
          stats_runs[run] = download<double>(*stats_dev);
          grad_runs[run] = download<uint16_t>(*grad_dev);
        }
        EXPECT_TRUE(stats_runs[0] == stats_runs[1]) << "row_stats differ between two identical runs";
        EXPECT_TRUE(grad_runs[0] == grad_runs[1]) << "grad differs between two identical runs";
        EXPECT_TRUE(download<float>(*logits_dev) == logits) << "logits must be left as they were";

        const CeChunk ref = ce_chunk_reference(logits, targets, rows, vocab, o, grad);
        std::vector<float> stats_gpu(stats_runs[0].begin(), stats_runs[0].end());
        expect_values_close("row_stats", stats_gpu, ref.stats, kStatsTol, 0, &ref.stats_floor);
        for (int64_t r = 0; r < rows; ++r) {
          if (targets[static_cast<size_t>(r)] >= 0) continue;
          EXPECT_TRUE(stats_runs[0][static_cast<size_t>(2 * r)] == 0 && stats_runs[0][static_cast<size_t>(2 * r + 1)] == 0)
              << "ignored row " << r << " must have zero stats";
        }
        if (grad) {
          // Ignored rows: the reference is 0 with a zero floor, so only an exact 0 passes.
          expect_bf16_close("grad", grad_runs[0], ref.grad, kBf16Tol, 0, &ref.grad_floor);
        } else {
          const bool untouched = std::all_of(grad_runs[0].begin(), grad_runs[0].end(),
                                             [](uint16_t h) { return h == 0xFFFFu; });
          EXPECT_TRUE(untouched) << "grad=false must leave grad_out untouched";
        }
      }
    }
  }
}

// The in-place variant on bf16 logits (the LM head's mixed path): the same reference on
// the bf16-rounded logits; with grad the logits turn into the gradient, without it they
// are left as they were.
TEST_F(Bf16Kernels, CrossEntropyRowsInPlaceOnBf16Logits) {
  const CeOptions option_sets[] = {{0, 1, 0}, {1e-2f, 1.0f / 37, 0}, {1e-3f, 1.0f / 3, 5}};
  for (auto [rows, vocab] : {std::pair<int64_t, int64_t>{37, 1000}, {3, 50304}, {5, 1001}}) {
    for (const CeOptions& o : option_sets) {
      for (bool grad : {true, false}) {
        SCOPED_TRACE(fmt::format("rows={} vocab={} z={} scale={} softcap={} grad={}", rows, vocab, o.z_loss,
                                 o.loss_scale, o.softcap, grad));
        const size_t n = static_cast<size_t>(rows * vocab);
        std::vector<float> logits = random_f32(n, 190 + n, 2.5);
        std::vector<uint16_t> bits(n);
        for (size_t i = 0; i < n; ++i) bits[i] = float_to_bf16(logits[i]), logits[i] = bf16_to_float(bits[i]);
        const std::vector<int32_t> targets = ce_targets(rows, vocab);
        OwnedTensor logits_dev = upload(bits), targets_dev = upload(targets);
        OwnedTensor stats_dev = poisoned<double>(static_cast<size_t>(2 * rows));
        cuda::cross_entropy_rows_bf16(process_exec(), ptr<uint16_t>(logits_dev), vocab, ptr<int32_t>(targets_dev), rows, vocab, o.z_loss,
                                      o.loss_scale, o.softcap, grad, ptr<double>(stats_dev));
        const std::vector<double> stats = download<double>(*stats_dev);
        const std::vector<uint16_t> out = download<uint16_t>(*logits_dev);
        const CeChunk ref = ce_chunk_reference(logits, targets, rows, vocab, o, grad);
        expect_values_close("row_stats", std::vector<float>(stats.begin(), stats.end()), ref.stats, kStatsTol, 0,
                            &ref.stats_floor);
        if (grad)
          expect_bf16_close("grad", out, ref.grad, kBf16Tol, 0, &ref.grad_floor);
        else
          EXPECT_TRUE(out == bits) << "grad=false must leave the logits as they were";
      }
    }
  }
}

// Rows stride apart (the LM head's chunk: the vocabulary padded to 8 columns,
// ops::lm_head_logits_cols), vocabularies that are not multiples of 8: the padding holds
// NaN and must weigh nothing in the sums; the vector path runs (a stride of 8s) and writes
// zeros into the gradient's padding. Both the fp32-in and the in-place bf16 kernels.
TEST_F(Bf16Kernels, CrossEntropyRowsPaddedStride) {
  const CeOptions option_sets[] = {{0, 1, 0}, {1e-2f, 1.0f / 37, 0}, {1e-3f, 1.0f / 3, 5}};
  for (auto [rows, vocab] : {std::pair<int64_t, int64_t>{5, 7}, {37, 1001}, {3, 50257}}) {
    const int64_t stride = ops::lm_head_logits_cols(vocab);
    ASSERT_GT(stride, vocab);
    ASSERT_EQ(stride % 8, 0);
    for (const CeOptions& o : option_sets) {
      for (bool grad : {true, false}) {
        SCOPED_TRACE(fmt::format("rows={} vocab={} stride={} z={} scale={} softcap={} grad={}", rows, vocab, stride,
                                 o.z_loss, o.loss_scale, o.softcap, grad));
        const size_t n = static_cast<size_t>(rows * vocab), padded = static_cast<size_t>(rows * stride);
        const std::vector<float> dense = random_f32(n, 290 + n, 2.5);
        std::vector<float> dense_bf16(n);  // the same values rounded to bf16, for the in-place kernel
        std::vector<float> f32_rows(padded, std::numeric_limits<float>::quiet_NaN());
        std::vector<uint16_t> bf16_rows(padded, 0xFFFFu);  // NaN
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < vocab; ++j) {
            const size_t i = static_cast<size_t>(r * vocab + j), k = static_cast<size_t>(r * stride + j);
            f32_rows[k] = dense[i];
            bf16_rows[k] = float_to_bf16(dense[i]);
            dense_bf16[i] = bf16_to_float(bf16_rows[k]);
          }
        const std::vector<int32_t> targets = ce_targets(rows, vocab);
        OwnedTensor targets_dev = upload(targets);
        // The columns of each row before the padding, and the padding.
        const auto unpadded = [&](const std::vector<uint16_t>& all) {
          std::vector<uint16_t> out;
          for (int64_t r = 0; r < rows; ++r)
            out.insert(out.end(), all.begin() + r * stride, all.begin() + r * stride + vocab);
          return out;
        };
        const auto padding_is = [&](const std::vector<uint16_t>& all, uint16_t bits) {
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = vocab; j < stride; ++j)
              if (all[static_cast<size_t>(r * stride + j)] != bits) return false;
          return true;
        };
        const auto check_stats = [&](const OwnedTensor& stats_dev, const CeChunk& ref) {
          const std::vector<double> stats = download<double>(*stats_dev);
          expect_values_close("row_stats", std::vector<float>(stats.begin(), stats.end()), ref.stats, kStatsTol, 0,
                              &ref.stats_floor);
        };

        {  // fp32 logits in, bf16 gradient out
          OwnedTensor logits_dev = upload(f32_rows), stats_dev = poisoned<double>(static_cast<size_t>(2 * rows));
          OwnedTensor grad_dev = poisoned<uint16_t>(padded);
          cuda::cross_entropy_rows_to_bf16(process_exec(), ptr<float>(logits_dev), stride, ptr<int32_t>(targets_dev), rows,
                                           vocab, o.z_loss, o.loss_scale, o.softcap, grad, ptr<double>(stats_dev),
                                           ptr<uint16_t>(grad_dev));
          const CeChunk ref = ce_chunk_reference(dense, targets, rows, vocab, o, grad);
          check_stats(stats_dev, ref);
          const std::vector<uint16_t> out = download<uint16_t>(*grad_dev);
          if (grad) {
            expect_bf16_close("grad", unpadded(out), ref.grad, kBf16Tol, 0, &ref.grad_floor);
            EXPECT_TRUE(padding_is(out, 0)) << "the gradient's padding must be zero";
          } else {
            EXPECT_TRUE(padding_is(out, 0xFFFFu) && unpadded(out) == std::vector<uint16_t>(n, 0xFFFFu))
                << "grad=false must leave grad_out untouched";
          }
        }
        {  // bf16 logits, in place
          OwnedTensor logits_dev = upload(bf16_rows), stats_dev = poisoned<double>(static_cast<size_t>(2 * rows));
          cuda::cross_entropy_rows_bf16(process_exec(), ptr<uint16_t>(logits_dev), stride, ptr<int32_t>(targets_dev), rows,
                                        vocab, o.z_loss, o.loss_scale, o.softcap, grad, ptr<double>(stats_dev));
          const CeChunk ref = ce_chunk_reference(dense_bf16, targets, rows, vocab, o, grad);
          check_stats(stats_dev, ref);
          const std::vector<uint16_t> out = download<uint16_t>(*logits_dev);
          if (grad) {
            expect_bf16_close("grad in place", unpadded(out), ref.grad, kBf16Tol, 0, &ref.grad_floor);
            EXPECT_TRUE(padding_is(out, 0)) << "the gradient's padding must be zero";
          } else {
            EXPECT_TRUE(out == bf16_rows) << "grad=false must leave the logits as they were";
          }
        }
      }
    }
  }
}

// The mixed LM head at vocabularies that are not multiples of 8: with the weight's padded
// copy (ops::LmHeadScratch::padded_weight, poisoned with NaN before the call) its loss, dh
// and dw match the same call without it, within the bf16 logits' rounding (the products
// run different kernels, so the bits may differ), and the copy holds the weight followed
// by zero rows: padding left unwritten would show as NaN in every output.
TEST_F(Bf16Kernels, LmHeadLossPaddedWeightMatchesUnpadded) {
  const int64_t n = 50, d = 64, chunk = 16;
  for (int64_t vocab : {259, 1001}) {
    SCOPED_TRACE(fmt::format("vocab={}", vocab));
    const int64_t cols = ops::lm_head_logits_cols(vocab);
    ASSERT_TRUE(ops::lm_head_needs_padded_weight(vocab, Device::cuda, DType::bf16));
    const std::vector<uint16_t> h = random_bf16(static_cast<size_t>(n * d), 610 + vocab);
    const std::vector<uint16_t> w = random_bf16(static_cast<size_t>(vocab * d), 620 + vocab, 0.3);
    std::vector<int32_t> targets(n);
    for (int64_t i = 0; i < n; ++i) targets[i] = i % 9 == 4 ? -1 : static_cast<int32_t>((i * 31) % vocab);
    OwnedTensor h_dev = upload(h), w_dev = upload(w), t_dev = upload(targets);
    const Tensor hv(h_dev->raw(), DType::bf16, Device::cuda, Shape{n, d});
    const Tensor wv(w_dev->raw(), DType::bf16, Device::cuda, Shape{vocab, d});
    const Tensor tv(t_dev->raw(), DType::i32, Device::cuda, Shape{n});
    ops::LmHeadLossOptions o;
    o.chunk_rows = chunk, o.z_loss = 1e-2, o.loss_scale = 1.0 / 44;
    struct Run {
      ops::LossSums sums;
      std::vector<uint16_t> dh;
      std::vector<float> dw;
    };
    const auto run = [&](bool padded) {
      OwnedTensor logits = poisoned<uint16_t>(static_cast<size_t>(chunk * cols));
      OwnedTensor stats = poisoned<double>(static_cast<size_t>(chunk * 2));
      OwnedTensor copy = poisoned<uint16_t>(static_cast<size_t>(cols * d));
      OwnedTensor dh = poisoned<uint16_t>(static_cast<size_t>(n * d));
      OwnedTensor dw = upload(std::vector<float>(static_cast<size_t>(vocab * d), 0.f));
      ops::LmHeadScratch scratch{Tensor(logits->raw(), DType::bf16, Device::cuda, Shape{chunk, cols}),
                                 Tensor(stats->raw(), DType::f64, Device::cuda, Shape{chunk, 2}), Tensor()};
      if (padded) scratch.padded_weight = Tensor(copy->raw(), DType::bf16, Device::cuda, Shape{cols, d});
      Run r;
      r.sums = ops::lm_head_loss(process_exec(), hv, wv, tv, o, scratch,
                                 Tensor(dh->raw(), DType::bf16, Device::cuda, Shape{n, d}),
                                 Tensor(dw->raw(), DType::f32, Device::cuda, Shape{vocab, d}));
      r.dh = download<uint16_t>(*dh);
      r.dw = download<float>(*dw);
      if (padded) {
        const std::vector<uint16_t> held = download<uint16_t>(*copy);
        EXPECT_TRUE(std::equal(w.begin(), w.end(), held.begin())) << "the copy's first rows are the weight";
        EXPECT_TRUE(std::all_of(held.begin() + vocab * d, held.end(), [](uint16_t b) { return b == 0; }))
            << "the copy's padding rows are zero";
      }
      return r;
    };
    const Run plain = run(false), padded = run(true);
    EXPECT_EQ(padded.sums.count, plain.sums.count);
    EXPECT_NEAR(padded.sums.loss, plain.sums.loss, 1e-3 * std::fabs(plain.sums.loss));
    EXPECT_NEAR(padded.sums.z, plain.sums.z, 1e-3 * std::fabs(plain.sums.z));
    // Worst difference against the largest value: one bf16 rounding of a logit or a
    // gradient (2^-8) moves an element by at most that much of its scale.
    const auto worst = [](const std::vector<float>& a, const std::vector<float>& b) {
      return test::max_diff_over_max(std::vector<double>(a.begin(), a.end()), std::vector<double>(b.begin(), b.end()));
    };
    EXPECT_LT(worst(bf16_values(padded.dh), bf16_values(plain.dh)), kBf16Tol);
    EXPECT_LT(worst(padded.dw, plain.dw), kBf16Tol);
  }
}

// Decode-sized products (m = 1..9 rows against a weight): m <= kMaxSkinnyRows go to the
// skinny kernel of cuda::gemm, the rest to cuBLASLt: C = A B^T in f32 and bf16, and
// C = A B^T + C (beta 1). The reference sums the bf16 inputs' exact values in fp64; the
// f32 result is one fp32 dot product of k terms (judged against the terms' scale).
TEST_F(Bf16Kernels, SkinnyGemmMatchesReference) {
  const int64_t n = 1000, k = 1024;
  const std::vector<uint16_t> b = random_bf16(static_cast<size_t>(n * k), 7001);
  const std::vector<float> bv = bf16_values(b);
  OwnedTensor b_dev = upload(b);
  for (int64_t m : {1, 2, 3, 4, 5, 8, 9}) {
    for (bool f32_out : {true, false}) {
      for (float beta : {0.0f, 1.0f}) {
        SCOPED_TRACE(fmt::format("m={} {} beta={}", m, f32_out ? "f32" : "bf16", beta));
        const std::vector<uint16_t> a = random_bf16(static_cast<size_t>(m * k), 7100 + static_cast<uint64_t>(m));
        const std::vector<float> av = bf16_values(a);
        const std::vector<uint16_t> c0 = random_bf16(static_cast<size_t>(m * n), 7200 + static_cast<uint64_t>(m));
        const std::vector<float> c0v = bf16_values(c0);
        std::vector<double> ref(static_cast<size_t>(m * n)), scale(ref.size());
        for (int64_t r = 0; r < m; ++r)
          for (int64_t j = 0; j < n; ++j) {
            double sum = 0, terms = 0;
            for (int64_t i = 0; i < k; ++i) {
              const double t = static_cast<double>(av[static_cast<size_t>(r * k + i)]) * bv[static_cast<size_t>(j * k + i)];
              sum += t, terms += std::fabs(t);
            }
            ref[static_cast<size_t>(r * n + j)] = sum + beta * c0v[static_cast<size_t>(r * n + j)];
            scale[static_cast<size_t>(r * n + j)] = 1e-2 * (terms + std::fabs(c0v[static_cast<size_t>(r * n + j)]));
          }
        OwnedTensor a_dev = upload(a);
        if (f32_out) {
          OwnedTensor c_dev = upload(c0v);
          cuda::gemm(process_exec(), false, true, m, n, k, 1.0f, ptr<uint16_t>(a_dev), k, ptr<uint16_t>(b_dev), k, DType::bf16, beta,
                     ptr<float>(c_dev), n, DType::f32);
          expect_values_close("skinny gemm f32", download<float>(*c_dev), ref, 1e-3, 0, &scale);
        } else {
          OwnedTensor c_dev = upload(c0);
          cuda::gemm(process_exec(), false, true, m, n, k, 1.0f, ptr<uint16_t>(a_dev), k, ptr<uint16_t>(b_dev), k, DType::bf16, beta,
                     ptr<uint16_t>(c_dev), n, DType::bf16);
          expect_bf16_close("skinny gemm bf16", download<uint16_t>(*c_dev), ref, kBf16Tol, 0, &scale);
        }
      }
    }
  }
}

// The decoder's fused projections (ops/decode/decode_kernels.h) on awkward shapes: one to eight
// rows (instantiations of 1, 2, 4 and 8), k of 64 (lanes idle), 1032 (k split unevenly
// over warps) and 4096 (64 KiB of staged rows at 8 rows, past the default shared-memory
// limit), column counts that leave partial tiles, few columns (k split over all 8 warps).
// The reference stages RMSNorm(x) * gain as bf16 on the host and sums in fp64.
TEST_F(Bf16Kernels, DecodeProjectionsMatchReference) {
  struct Case {
    int64_t m, n, k;
  };
  for (const Case cs : {Case{1, 1000, 1032}, Case{3, 40, 4096}, Case{8, 259, 64}, Case{5, 1000, 1032},
                        Case{8, 300, 4096}, Case{2, 7, 1032}}) {
    const int64_t m = cs.m, n = cs.n, k = cs.k;
    SCOPED_TRACE(fmt::format("m={} n={} k={}", m, n, k));
    const uint64_t seed = 9000 + static_cast<uint64_t>(m * 7 + n + k);
    const std::vector<float> x = random_f32(static_cast<size_t>(m * k), seed, 2.0);
    std::vector<float> gain = random_f32(static_cast<size_t>(k), seed + 1, 0.1);
    for (float& g : gain) g += 1.0f;
    const std::vector<uint16_t> w = random_bf16(static_cast<size_t>(2 * n * k), seed + 2);  // [2n, k]: gate | up
    const std::vector<float> wv = bf16_values(w);
    // Host replica of the staged rows: bf16(x * inv * gain).
    std::vector<float> h(static_cast<size_t>(m * k));
    for (int64_t r = 0; r < m; ++r) {
      double ss = 0;
      for (int64_t c = 0; c < k; ++c) ss += static_cast<double>(x[r * k + c]) * x[r * k + c];
      const auto inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(k) + kEps));
      for (int64_t c = 0; c < k; ++c)
        h[r * k + c] = bf16_to_float(float_to_bf16(x[r * k + c] * inv * gain[c]));
    }
    // sums[r][j] and sum |terms| of the staged rows against W row j (j < 2n).
    auto dots = [&](const std::vector<float>& rows, std::vector<double>& sums, std::vector<double>& terms) {
      sums.assign(static_cast<size_t>(m * 2 * n), 0.0);
      terms.assign(sums.size(), 0.0);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < 2 * n; ++j)
          for (int64_t c = 0; c < k; ++c) {
            const double t = static_cast<double>(rows[r * k + c]) * wv[j * k + c];
            sums[r * 2 * n + j] += t, terms[r * 2 * n + j] += std::fabs(t);
          }
    };
    std::vector<double> sums, terms;
    dots(h, sums, terms);
    auto first_n = [&](const std::vector<double>& v) {  // columns 0..n-1 of [m, 2n]
      std::vector<double> out(static_cast<size_t>(m * n));
      for (int64_t r = 0; r < m; ++r) std::copy_n(v.begin() + r * 2 * n, n, out.begin() + r * n);
      return out;
    };
    const std::vector<double> ref = first_n(sums), floors = first_n(terms);
    OwnedTensor x_dev = upload(x), gain_dev = upload(gain), w_dev = upload(w);

    OwnedTensor f32_out = poisoned<float>(static_cast<size_t>(m * n));
    cuda::norm_gemv(process_exec(), DType::f32, ptr<float>(x_dev), ptr<float>(gain_dev), kEps, m, k, ptr<uint16_t>(w_dev), n,
                    ptr<float>(f32_out));
    const std::vector<float> first = download<float>(*f32_out);
    expect_values_close("norm_gemv f32", first, ref, 2e-4, 0, &floors);
    cuda::norm_gemv(process_exec(), DType::f32, ptr<float>(x_dev), ptr<float>(gain_dev), kEps, m, k, ptr<uint16_t>(w_dev), n,
                    ptr<float>(f32_out));
    EXPECT_EQ(std::memcmp(first.data(), download<float>(*f32_out).data(), first.size() * sizeof(float)), 0)
        << "norm_gemv is not bitwise repeatable";

    OwnedTensor bf16_out = poisoned<uint16_t>(static_cast<size_t>(m * n));
    cuda::norm_gemv(process_exec(), DType::bf16, ptr<float>(x_dev), ptr<float>(gain_dev), kEps, m, k, ptr<uint16_t>(w_dev), n,
                    ptr<uint16_t>(bf16_out));
    expect_bf16_close("norm_gemv bf16", download<uint16_t>(*bf16_out), ref, kBf16Tol, 0, &floors);

    // x0 [m, n] += bf16(a W^T), a bf16 rows (the attention output or SwiGLU activation).
    const std::vector<uint16_t> a = to_bf16(h);
    const std::vector<float> x0 = random_f32(static_cast<size_t>(m * n), seed + 3);
    OwnedTensor a_dev = upload(a), residual = upload(x0);
    cuda::gemv_add_residual(process_exec(), ptr<uint16_t>(a_dev), m, k, ptr<uint16_t>(w_dev), n, ptr<float>(residual));
    std::vector<double> added(ref.size()), added_floors(ref.size());
    for (size_t i = 0; i < ref.size(); ++i) added[i] = x0[i] + ref[i], added_floors[i] = std::fabs(x0[i]) + floors[i];
    expect_values_close("gemv_add_residual", download<float>(*residual), added, kBf16Tol, 0, &added_floors);

    // SwiGLU of gate | up: W rows j and n + j.
    OwnedTensor act = poisoned<uint16_t>(static_cast<size_t>(m * n));
    cuda::norm_gemv_swiglu(process_exec(), ptr<float>(x_dev), ptr<float>(gain_dev), kEps, m, k, ptr<uint16_t>(w_dev), n,
                           ptr<uint16_t>(act));
    std::vector<double> act_ref(ref.size()), act_floors(ref.size());
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) {
        const size_t gi = static_cast<size_t>(r * 2 * n + j), ui = gi + static_cast<size_t>(n);
        const double g = sums[gi], u = sums[ui];
        act_ref[static_cast<size_t>(r * n + j)] = g / (1.0 + std::exp(-g)) * u;
        act_floors[static_cast<size_t>(r * n + j)] =
            std::fabs(g * u) + 1e-3 * (terms[gi] * std::fabs(u) + terms[ui] * std::fabs(g));
      }
    expect_bf16_close("norm_gemv_swiglu", download<uint16_t>(*act), act_ref, 2e-2, 0, &act_floors);
  }
}

// A chunk of more than 2^31 logits (32769 rows of 65536): offsets past 2^31 must not wrap.
// Rows repeat 8 patterns (doubling device copies), so the reference is cheap; the first
// and last rows are checked in full and every row's stats.
TEST_F(Bf16Kernels, CrossEntropyRowsBeyond2To31Logits) {
  const int64_t vocab = 65536, rows = 32769, patterns = 8;
  const size_t bytes_needed = static_cast<size_t>(rows * vocab) * (sizeof(float) + sizeof(uint16_t));
  size_t free_bytes = 0, total_bytes = 0;
  cuda_memory_info(&free_bytes, &total_bytes);
  if (free_bytes < bytes_needed + (size_t{1} << 30)) GTEST_SKIP() << "needs " << bytes_needed << " bytes of GPU memory";
  const CeOptions o{1e-4f, 1.0f / 1000, 30};

  const std::vector<float> base = random_f32(static_cast<size_t>(patterns * vocab), 123, 2.5);
  OwnedTensor logits_dev(DType::f32, Device::cuda, Shape{rows, vocab});
  float* logits = ptr<float>(logits_dev);
  device_copy(logits, Device::cuda, base.data(), Device::cpu, base.size() * sizeof(float));
  for (int64_t done = patterns; done < rows; done *= 2) {  // row r holds pattern r % 8
    const int64_t count = std::min(done, rows - done);
    device_copy(logits + done * vocab, Device::cuda, logits, Device::cuda, static_cast<size_t>(count * vocab) * 4);
  }
  std::vector<int32_t> targets(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    targets[static_cast<size_t>(r)] = r % 5 == 2 ? -1 : static_cast<int32_t>((r * 7919 + 13) % vocab);
  ASSERT_GE(targets.back(), 0);  // the last row, past 2^31, has a target
  OwnedTensor targets_dev = upload(targets), stats_dev = poisoned<double>(static_cast<size_t>(2 * rows));
  OwnedTensor grad_dev(DType::bf16, Device::cuda, Shape{rows, vocab});
  uint16_t* grad = ptr<uint16_t>(grad_dev);
  // Poison the rows that are checked in full: the first, and the last three (one ignored).
  const std::vector<int64_t> checked = {0, rows - 3, rows - 2, rows - 1};
  const std::vector<uint16_t> poison_row(static_cast<size_t>(vocab), 0xFFFFu);
  for (int64_t r : checked)
    device_copy(grad + r * vocab, Device::cuda, poison_row.data(), Device::cpu, poison_row.size() * 2);

  cuda::cross_entropy_rows_to_bf16(process_exec(), logits, vocab, ptr<int32_t>(targets_dev), rows, vocab, o.z_loss, o.loss_scale, o.softcap,
                                   true, ptr<double>(stats_dev), grad);

  std::vector<double> lse(static_cast<size_t>(patterns));
  for (int64_t p = 0; p < patterns; ++p) lse[static_cast<size_t>(p)] = ce_lse(base.data() + p * vocab, vocab, o.softcap);
  const std::vector<double> stats = download<double>(*stats_dev);
  std::vector<double> stats_ref(stats.size()), stats_floor(stats.size());
  for (int64_t r = 0; r < rows; ++r) {
    const CeRow ref = ce_reference(base.data() + r % patterns * vocab, vocab, targets[static_cast<size_t>(r)], o, false,
                                   lse[static_cast<size_t>(r % patterns)]);
    stats_ref[static_cast<size_t>(2 * r)] = ref.loss;
    stats_ref[static_cast<size_t>(2 * r + 1)] = ref.lse_sq;
    stats_floor[static_cast<size_t>(2 * r)] = ref.loss_floor;
    stats_floor[static_cast<size_t>(2 * r + 1)] = ref.lse_sq;
  }
  expect_values_close("row_stats", std::vector<float>(stats.begin(), stats.end()), stats_ref, kStatsTol, 0, &stats_floor);

  for (int64_t r : checked) {
    SCOPED_TRACE(fmt::format("row {}", r));
    std::vector<uint16_t> got(static_cast<size_t>(vocab));
    device_copy(got.data(), Device::cpu, grad + r * vocab, Device::cuda, got.size() * 2);
    const CeRow ref = ce_reference(base.data() + r % patterns * vocab, vocab, targets[static_cast<size_t>(r)], o, true,
                                   lse[static_cast<size_t>(r % patterns)]);
    expect_bf16_close("grad", got, ref.grad, kBf16Tol, 0, &ref.floors);
  }
}

}  // namespace
}  // namespace kiln
