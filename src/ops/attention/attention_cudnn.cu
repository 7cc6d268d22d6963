// bf16 causal GQA attention over packed sequences on cuDNN's SDPA, through the cuDNN
// frontend graph API (the contract is in attention_cudnn.h).
//
// How the packed layout is described to cuDNN: every tensor is a [B, H, S, D] view with THD
// strides (row stride H*D, head stride D) plus a ragged offset per batch entry, the element
// offset of sequence b's first row: cu_seqlens[b] * H * D. The softmax statistics (Stats) use
// the same trick: [B, Hq, S, 1] with strides {Hq*S, 1, Hq, 1} and offset cu_seqlens[b] * Hq,
// so they are the packed lse [tokens, Hq] (ragged Stats need cuDNN >= 9.6). A padding mask
// with seq_len_q = seq_len_kv = cu_seqlens[b+1] - cu_seqlens[b] (int32 [B,1,1,1]) bounds each
// sequence; causal is the diagonal band's right bound 0 (top-left aligned, the same as
// bottom-right since q and kv lengths are equal); a sliding window is its left bound
// (the frontend keeps key j for query i when j + left_bound > i, i.e. i - j < window).
// The offsets and lengths are computed on the device from cu_seqlens by a small kernel,
// every call, on the caller's stream: the host never reads cu_seqlens and never syncs.
//
// Uniform batches (AttentionArgs::uniform: every sequence holds exactly max_seqlen rows, one
// after the other, as the benchmark's and an unpacked run's rows do) take a plain graph
// instead: the same [B, H, S, D] strides without ragged offsets or a padding mask, the exact
// B and S, and lse head-major ([B, Hq, S]: see stats_stride). This is the graph PyTorch
// runs; cuDNN's ragged one is slower on the same rows (measured in docs/performance.md).
//
// Stats: cuDNN's Stats is max + log(sum exp(s - max)) of the scaled, masked scores s in
// natural log (stats_use_log2 is left off), i.e. the log-sum-exp the fp32 kernels save, so
// the forward writes it straight into lse and the backward reads it from there.
//
// Graphs: one per distinct (B, S, heads, head_dim, scale, window, direction) - building one
// costs from tens of milliseconds to seconds (runtime-compiled kernels), so the shapes are
// bucketed (see Bucket below) and the built graphs cached for the process.
//
// Determinism (AttentionArgs::deterministic, from train.deterministic; on by default): the
// backward asks for cuDNN's deterministic algorithm
// (SDPA_backward_attributes::set_deterministic_algorithm; honored on Hopper by cuDNN 9.0 and
// later - Transformer Engine sets it from 9.0 - and on Blackwell from cuDNN 9.18). On Hopper
// the frontend then builds the "dP workspace" variant: no atomic dQ accumulation, at the cost
// of a workspace of about B * Hq * S * S * 2 bytes. The forward has no atomics. A built graph
// always runs the same execution plan, so results are bitwise reproducible run to run.
// Off, the faster backward accumulates dQ with atomics, as PyTorch's SDPA backends do.
//
// Dropout of the probabilities (AttentionArgs::dropout_key set: model.attention_dropout in
// training): SDPA's own Philox dropout (set_dropout with seed and offset tensors), both
// directions with the same seed, so the backward drops what the forward dropped. The seed
// is a hash of the micro-batch's stream key and the layer's site, written to device memory
// by a small kernel before each call (the offset is 0): a captured graph reads each
// replay's key, and a layer's forward and backward compute the same seed. cuDNN's masks
// are not the CPU's (dropout::attention_keeps); docs/dropout.md says what is checked.
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/step_graphs.h"
#include "ops/attention/attention_cudnn.h"
#include "ops/dropout/dropout_mask.h"

#include <cudnn.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace kiln::cuda {

namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

constexpr const char* kWhere = "attention";
// Ragged Stats (lse as a packed [tokens, Hq] tensor) and ragged offsets with GQA in the
// backward both arrive in cuDNN 9.6.
constexpr int64_t kMinCudnnVersion = 90600;

// ---- shapes and buckets --------------------------------------------------------------

// Building a graph per distinct (num_seqs, max_seqlen) would rebuild nearly every step when
// documents vary, so both are rounded up:
//  - B (batch entries): to a power of two. The extra entries are sequences of length 0
//    (seq_len 0, ragged offsets equal to the end of the packed rows), as Transformer Engine
//    pads its THD batches for the same reason (B up to 32, then powers of two, the extra
//    entries empty), so cuDNN takes empty sequences; they cost only CTAs that exit at once.
//  - S (the sequences' dimension, an upper bound of every length): to a power of two, at
//    least 64. Powers of two rather than multiples of 64: max_seqlen changes from batch to
//    batch, and with multiples of 64 every new value up to model.max_seq_len (32 of them for
//    2048) would build a forward and a backward graph, against log2(max_seq_len / 64) + 1
//    buckets here. The rows beyond a sequence's length are masked by seq_len and their tiles
//    skipped; what the padding does cost is the deterministic backward's dP workspace
//    (proportional to B * S^2: up to ~8x the exact shape's once S >= 64) and empty CTAs.
// KILN_CUDNN_BUCKET=0 (or set_attention_cudnn_bucketing(false)) uses the exact B and S (S at
// least 2: the frontend refuses s_q = s_kv = 1), e.g. to compare the two.
struct Bucket {
  int64_t batch, seq;
};

int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

Bucket bucket_of(int64_t num_seqs, int64_t max_seqlen, bool bucketing) {
  if (!bucketing) return {num_seqs, std::max<int64_t>(max_seqlen, 2)};
  return {next_pow2(num_seqs), std::max<int64_t>(next_pow2(max_seqlen), 64)};
}

// Everything a graph depends on.
struct Key {
  bool backward;
  int64_t batch, seq, q_heads, kv_heads, head_dim, window;
  uint32_t scale_bits, softcap_bits;  // softcap 0 = off
  bool deterministic;
  bool ragged;  // false: a uniform batch (no offsets, no padding mask)
  uint32_t dropout_bits;  // the drop probability's float bits; 0 = no dropout
  auto tie() const {
    return std::tie(backward, batch, seq, q_heads, kv_heads, head_dim, window, scale_bits, softcap_bits, deterministic,
                    ragged, dropout_bits);
  }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

// A built graph and the tensors its variant pack names.
struct SdpaGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  TensorPtr q, k, v, o, stats, d_o, dq, dk, dv;
  // Ragged offsets as Transformer Engine declares them: one tensor for Q and dQ, one for O
  // and dO, one each for K (dK) and V (dV). Q and O (and K and V) have equal offsets, so
  // their variant-pack entries share one device array.
  TensorPtr seq_q, seq_kv, offset_q, offset_o, offset_k, offset_v, offset_stats;
  // The logit softcap's modifier (its forward keeps the pre-tanh scores its backward reads)
  // and the cap as a scalar tensor; null without a softcap.
  std::shared_ptr<fe::graph::attn::score_modifiers::Softcap> softcap;
  TensorPtr cap;
  // Dropout's Philox seed and offset (int64 scalars in device memory); null without dropout.
  TensorPtr seed, offset;
  int64_t workspace_bytes = 0;
};

// ---- device buffers ------------------------------------------------------------------

// A device buffer that grows when a larger size is asked for. Growth is stream-ordered
// (cudaFreeAsync of the old buffer, cudaMallocAsync of the new one, on the stream the
// kernels run on): no host synchronization, and work already queued on the old buffer
// finishes before it is released. It must happen outside CUDA graph capture (a capture
// would record the allocation as a graph node): run every shape once before capturing;
// during a capture, growth is refused with an error.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;

  void reserve(size_t need, cudaStream_t stream, const char* what) {
    if (need <= bytes) return;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(stream, &capture), kWhere, "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone)
      fail(kWhere, "cuDNN {} must grow to {} bytes during CUDA graph capture; run this shape once before capturing",
           what, need);
    const size_t rounded = (need + (2u << 20) - 1) / (2u << 20) * (2u << 20);  // whole 2 MiB
    if (ptr != nullptr) check(cudaFreeAsync(ptr, stream), kWhere, "cudaFreeAsync");
    ptr = nullptr;
    bytes = 0;
    check(cudaMallocAsync(&ptr, rounded, stream), kWhere, what);
    bytes = rounded;
    bump_capture_generation();  // graphs captured with the old buffer must not run again
  }
};

// ---- process-wide state --------------------------------------------------------------

// The buffers of the calls on one stream (calls on one stream are ordered; two streams
// never share a buffer).
struct StreamBuffers {
  DeviceBuffer workspace;  // what the plans ask for
  DeviceBuffer layout;     // seq_len_q, seq_len_kv, ragged offsets of the current call
  DeviceBuffer philox;     // dropout's seed and offset of the current call
};

struct State {
  std::mutex mutex;
  cudnnHandle_t handle = nullptr;
  cudaStream_t handle_stream = nullptr;  // the stream the handle is bound to
  std::map<Key, std::unique_ptr<SdpaGraph>> graphs;
  std::map<cudaStream_t, StreamBuffers> buffers;  // per stream, kept for the process
  int bucketing = -1;      // -1: not decided yet (KILN_CUDNN_BUCKET, default on)
  int64_t atomic_fallbacks = 0;  // deterministic backward calls too large for their workspace
};

// Never destroyed: cuDNN handles and plans must not be torn down after the CUDA context is
// (static destruction order at exit); the process exit releases them.
State& state() {
  static State* s = new State;
  return *s;
}

bool bucketing_enabled(State& st) {
  if (st.bucketing < 0) {
    const char* env = std::getenv("KILN_CUDNN_BUCKET");
    st.bucketing = (env != nullptr && std::strcmp(env, "0") == 0) ? 0 : 1;
  }
  return st.bucketing != 0;
}

void check_cudnn(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS) fail(kWhere, "cuDNN {}: {}", what, cudnnGetErrorString(status));
}

void check_fe(fe::error_t status, const char* what) {
  if (status.is_bad()) fail(kWhere, "cuDNN {}: {}", what, status.get_message());
}

// Created on first use, bound to the process-wide context's stream, where plans are built
// (handle_on binds it to each call's stream).
cudnnHandle_t handle(State& st) {
  if (st.handle == nullptr) {
    const size_t version = cudnnGetVersion();
    if (static_cast<int64_t>(version) < kMinCudnnVersion)
      fail(kWhere, "cuDNN {}.{}.{} is loaded; ragged (packed) attention needs cuDNN 9.6 or newer", version / 10000,
           version / 100 % 100, version % 100);
    cudnnHandle_t h = nullptr;
    check_cudnn(cudnnCreate(&h), "cudnnCreate");
    const cudaStream_t s = stream(process_exec());
    check_cudnn(cudnnSetStream(h, s), "cudnnSetStream");
    st.handle = h;
    st.handle_stream = s;
  }
  return st.handle;
}

// The handle, bound to `s` (the calls hold the state's mutex, so one call at a time sets it).
cudnnHandle_t handle_on(State& st, cudaStream_t s) {
  const cudnnHandle_t h = handle(st);
  if (st.handle_stream != s) {
    check_cudnn(cudnnSetStream(h, s), "cudnnSetStream");
    st.handle_stream = s;
  }
  return h;
}

// ---- device layout: lengths and ragged offsets ----------------------------------------

// Where the layout arrays lie in State::layout (each 256-byte aligned).
struct LayoutSpans {
  size_t seq_q, seq_kv, offset_q, offset_kv, offset_stats, bytes;
};

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

LayoutSpans layout_spans(int64_t batch) {
  LayoutSpans s{};
  const size_t lens = align256(sizeof(int32_t) * static_cast<size_t>(batch));
  const size_t offsets = align256(sizeof(int64_t) * static_cast<size_t>(batch + 1));
  s.seq_q = 0;
  s.seq_kv = s.seq_q + lens;
  s.offset_q = s.seq_kv + lens;
  s.offset_kv = s.offset_q + offsets;
  s.offset_stats = s.offset_kv + offsets;
  s.bytes = s.offset_stats + offsets;
  return s;
}

// Entry b < num_seqs is sequence b; entries num_seqs..batch-1 are empty sequences at the end
// of the packed rows. Offsets are in elements of each tensor: q/out/dq/dout rows hold
// q_heads * head_dim, k/v/dk/dv rows kv_heads * head_dim, lse rows q_heads.
__global__ void ragged_layout_kernel(const int32_t* cu_seqlens, int64_t num_seqs, int64_t batch, int64_t q_row,
                                     int64_t kv_row, int64_t stats_row, int32_t* seq_q, int32_t* seq_kv,
                                     int64_t* offset_q, int64_t* offset_kv, int64_t* offset_stats) {
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b <= batch;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t start = cu_seqlens[b < num_seqs ? b : num_seqs];
    if (b < batch) {
      const int32_t len = b < num_seqs ? cu_seqlens[b + 1] - cu_seqlens[b] : 0;
      seq_q[b] = len;
      seq_kv[b] = len;
    }
    offset_q[b] = start * q_row;
    offset_kv[b] = start * kv_row;
    offset_stats[b] = start * stats_row;
  }
}

struct LayoutPointers {
  void *seq_q, *seq_kv, *offset_q, *offset_kv, *offset_stats;
};

LayoutPointers prepare_layout(StreamBuffers& buffers, cudaStream_t s, const AttentionArgs& a, int64_t batch) {
  const LayoutSpans spans = layout_spans(batch);
  buffers.layout.reserve(spans.bytes, s, "layout buffer");
  char* base = static_cast<char*>(buffers.layout.ptr);
  LayoutPointers p{base + spans.seq_q, base + spans.seq_kv, base + spans.offset_q, base + spans.offset_kv,
                   base + spans.offset_stats};
  constexpr int kThreads = 256;
  ragged_layout_kernel<<<blocks_for(batch + 1, kThreads), kThreads, 0, s>>>(
      a.cu_seqlens, a.num_seqs, batch, a.q_heads * a.head_dim, a.kv_heads * a.head_dim, a.q_heads,
      static_cast<int32_t*>(p.seq_q), static_cast<int32_t*>(p.seq_kv), static_cast<int64_t*>(p.offset_q),
      static_cast<int64_t*>(p.offset_kv), static_cast<int64_t*>(p.offset_stats));
  check_launch(kWhere, "ragged_layout_kernel");
  return p;
}

// Dropout's Philox seed (a hash of the stream key and the site) and offset (0), read from
// the key's device words at run time.
__global__ void philox_seed_kernel(const int32_t* key_words, uint32_t site, int64_t* seed_offset) {
  const uint64_t key = dropout::key_of_words(key_words);
  seed_offset[0] = static_cast<int64_t>(dropout::mix64(key ^ dropout::mix64(static_cast<uint64_t>(site) << 40)));
  seed_offset[1] = 0;
}

void add_philox(std::unordered_map<TensorPtr, void*>& pack, const SdpaGraph& g, StreamBuffers& buffers,
                cudaStream_t s, const AttentionArgs& a) {
  buffers.philox.reserve(2 * sizeof(int64_t), s, "dropout seed buffer");
  int64_t* seed_offset = static_cast<int64_t*>(buffers.philox.ptr);
  philox_seed_kernel<<<1, 1, 0, s>>>(a.dropout_key, a.dropout_site, seed_offset);
  check_launch(kWhere, "philox_seed_kernel");
  pack[g.seed] = seed_offset;
  pack[g.offset] = seed_offset + 1;
}

// The ragged graphs' variant-pack entries for the lengths and offsets.
void add_layout(std::unordered_map<TensorPtr, void*>& pack, const SdpaGraph& g, const LayoutPointers& p) {
  pack[g.seq_q] = p.seq_q;
  pack[g.seq_kv] = p.seq_kv;
  pack[g.offset_q] = p.offset_q;
  pack[g.offset_o] = p.offset_q;
  pack[g.offset_k] = p.offset_kv;
  pack[g.offset_v] = p.offset_kv;
  pack[g.offset_stats] = p.offset_stats;
}

// ---- graph construction --------------------------------------------------------------

TensorPtr index_tensor(fe::graph::Graph& g, const char* name, int64_t n, fe::DataType_t type) {
  return g.tensor(
      fe::graph::Tensor_attributes().set_name(name).set_dim({n, 1, 1, 1}).set_stride({1, 1, 1, 1}).set_data_type(type));
}

// [B, H, S, D] view of a packed [tokens, H, D] tensor.
std::vector<int64_t> thd_dim(const Key& k, int64_t heads) { return {k.batch, heads, k.seq, k.head_dim}; }
std::vector<int64_t> thd_stride(const Key& k, int64_t heads) {
  return {k.seq * heads * k.head_dim, k.head_dim, heads * k.head_dim, 1};
}

// `offset` is null in a uniform graph.
TensorPtr thd_tensor(fe::graph::Graph& g, const char* name, const Key& k, int64_t heads, const TensorPtr& offset) {
  TensorPtr t = g.tensor(
      fe::graph::Tensor_attributes().set_name(name).set_dim(thd_dim(k, heads)).set_stride(thd_stride(k, heads)));
  if (offset) t->set_ragged_offset(offset);
  return t;
}

void set_thd_output(const TensorPtr& t, const Key& k, int64_t heads, const TensorPtr& offset) {
  t->set_output(true).set_dim(thd_dim(k, heads)).set_stride(thd_stride(k, heads));
  if (offset) t->set_ragged_offset(offset);
}

// lse as [B, Hq, S, 1]: ragged, the packed [tokens, Hq]; plain, head-major [B, Hq, S] (cuDNN
// before 9.26 takes a non-ragged Stats in the backward only as a packed BHSD tensor).
std::vector<int64_t> stats_dim(const Key& k) { return {k.batch, k.q_heads, k.seq, 1}; }
std::vector<int64_t> stats_stride(const Key& k) {
  if (k.ragged) return {k.q_heads * k.seq, 1, k.q_heads, 1};
  return {k.q_heads * k.seq, k.seq, 1, 1};
}

float float_of(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}
float scale_of(const Key& k) { return float_of(k.scale_bits); }

// Tensors shared by both directions: the graph, the lengths and offsets.
void begin_graph(SdpaGraph& s, const Key& k) {
  s.graph = std::make_shared<fe::graph::Graph>();
  s.graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  fe::graph::Graph& g = *s.graph;
  if (k.ragged) {
    s.seq_q = index_tensor(g, "seq_q", k.batch, fe::DataType_t::INT32);
    s.seq_kv = index_tensor(g, "seq_kv", k.batch, fe::DataType_t::INT32);
    s.offset_q = index_tensor(g, "offset_q", k.batch + 1, fe::DataType_t::INT64);
    s.offset_o = index_tensor(g, "offset_o", k.batch + 1, fe::DataType_t::INT64);
    s.offset_k = index_tensor(g, "offset_k", k.batch + 1, fe::DataType_t::INT64);
    s.offset_v = index_tensor(g, "offset_v", k.batch + 1, fe::DataType_t::INT64);
    s.offset_stats = index_tensor(g, "offset_stats", k.batch + 1, fe::DataType_t::INT64);
  }
  s.q = thd_tensor(g, "Q", k, k.q_heads, s.offset_q);
  s.k = thd_tensor(g, "K", k, k.kv_heads, s.offset_k);
  s.v = thd_tensor(g, "V", k, k.kv_heads, s.offset_v);
}

// A logit softcap (cap * tanh(s / cap) of the scaled scores s) goes through the frontend's
// score modifier. cuDNN then takes none of its built-in masks, so the causal band, the
// window and the padding mask are built into the same modifier, after the cap: a masked
// score is -inf, which tanh would turn back into -cap. The backward recomputes the scores
// through the same modifier and takes the cap's derivative through its bprop modifier
// (masked scores have probability 0, hence gradient 0).
template <typename Attributes>
void set_softcap_and_masks(Attributes& attr, SdpaGraph& s, const Key& k) {
  namespace mods = fe::graph::attn::score_modifiers;
  auto cap = std::make_shared<fe::graph::Tensor_attributes>(float_of(k.softcap_bits));
  auto softcap = std::make_shared<mods::Softcap>();
  s.softcap = softcap;
  s.cap = cap;
  const std::optional<int64_t> left = k.window > 0 ? std::optional<int64_t>(k.window) : std::nullopt;
  const TensorPtr seq_q = s.seq_q, seq_kv = s.seq_kv;  // null in a plain graph
  // The lengths also bound the kernel's own loads and stores of each ragged sequence: with
  // the padding mask only in the modifier, the packed layout faulted (illegal address) on
  // the H200 with cuDNN 9.19.
  if (seq_q) attr.set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
  attr.set_score_mod([softcap, cap, left, seq_q, seq_kv](std::shared_ptr<fe::graph::Graph> g, TensorPtr score) {
    TensorPtr x = softcap->forward(g, score, cap);
    x = mods::sliding_window_mask(g, x, fe::DiagonalAlignment_t::TOP_LEFT, left, 0, 0, 0, nullptr, nullptr, nullptr,
                                  nullptr);
    if (seq_q) x = mods::padding_mask(g, x, seq_kv, seq_q);
    return x;
  });
}

// Masks common to both directions, on either attributes type.
template <typename Attributes>
void set_masks(Attributes& attr, SdpaGraph& s, const Key& k) {
  attr.set_attn_scale(scale_of(k));
  if (k.softcap_bits != 0) return set_softcap_and_masks(attr, s, k);
  attr.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
  if (k.ragged) attr.set_padding_mask(true).set_seq_len_q(s.seq_q).set_seq_len_kv(s.seq_kv);
  if (k.window > 0) attr.set_diagonal_band_left_bound(static_cast<int>(k.window));
}

// Dropout (the probability's bits nonzero): Philox seed and offset as int64 scalars.
template <typename Attributes>
void set_dropout(Attributes& attr, SdpaGraph& s, const Key& k) {
  if (k.dropout_bits == 0) return;
  auto scalar = [&](const char* name) {
    return s.graph->tensor(fe::graph::Tensor_attributes()
                               .set_name(name)
                               .set_dim({1, 1, 1, 1})
                               .set_stride({1, 1, 1, 1})
                               .set_data_type(fe::DataType_t::INT64));
  };
  s.seed = scalar("dropout_seed");
  s.offset = scalar("dropout_offset");
  attr.set_dropout(float_of(k.dropout_bits), s.seed, s.offset);
}

void finish_graph(State& st, SdpaGraph& s) {
  fe::graph::Graph& g = *s.graph;
  const cudnnHandle_t h = handle(st);
  check_fe(g.validate(), "graph validation");
  check_fe(g.build_operation_graph(h), "operation graph");
  check_fe(g.create_execution_plans({fe::HeurMode_t::A}), "execution plans");
  check_fe(g.check_support(), "support check");
  check_fe(g.build_plans(), "plan build");
  check_fe(g.get_workspace_size(s.workspace_bytes), "workspace size");
}

std::unique_ptr<SdpaGraph> build_forward(State& st, const Key& k) {
  auto s = std::make_unique<SdpaGraph>();
  begin_graph(*s, k);
  fe::graph::SDPA_attributes attr;
  attr.set_name("sdpa_forward").set_generate_stats(true);
  set_masks(attr, *s, k);
  set_dropout(attr, *s, k);
  auto [o, stats] = s->graph->sdpa(s->q, s->k, s->v, attr);
  s->o = o;
  s->stats = stats;
  set_thd_output(s->o, k, k.q_heads, s->offset_o);
  s->stats->set_output(true)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(stats_dim(k))
      .set_stride(stats_stride(k));
  if (k.ragged) s->stats->set_ragged_offset(s->offset_stats);
  finish_graph(st, *s);
  return s;
}

std::unique_ptr<SdpaGraph> build_backward(State& st, const Key& k) {
  auto s = std::make_unique<SdpaGraph>();
  begin_graph(*s, k);
  fe::graph::Graph& g = *s->graph;
  s->o = thd_tensor(g, "O", k, k.q_heads, s->offset_o);
  s->d_o = thd_tensor(g, "dO", k, k.q_heads, s->offset_o);
  s->stats = g.tensor(fe::graph::Tensor_attributes()
                          .set_name("Stats")
                          .set_dim(stats_dim(k))
                          .set_stride(stats_stride(k))
                          .set_data_type(fe::DataType_t::FLOAT));
  if (k.ragged) s->stats->set_ragged_offset(s->offset_stats);
  fe::graph::SDPA_backward_attributes attr;
  attr.set_name("sdpa_backward").set_deterministic_algorithm(k.deterministic);
  set_masks(attr, *s, k);
  set_dropout(attr, *s, k);
  if (s->softcap) {
    auto softcap = s->softcap;
    auto cap = s->cap;
    attr.set_score_mod_bprop([softcap, cap](std::shared_ptr<fe::graph::Graph> g, TensorPtr d_score) {
      return softcap->backward(g, d_score, cap);
    });
  }
  // No max_total_seq_len_q/kv: it only shrinks internal workspaces (sizing them by the
  // packed token count rather than B * S), and would make the graph depend on the tokens.
  auto [dq, dk, dv] = g.sdpa_backward(s->q, s->k, s->v, s->o, s->d_o, s->stats, attr);
  s->dq = dq;
  s->dk = dk;
  s->dv = dv;
  set_thd_output(s->dq, k, k.q_heads, s->offset_q);
  set_thd_output(s->dk, k, k.kv_heads, s->offset_k);
  set_thd_output(s->dv, k, k.kv_heads, s->offset_v);
  finish_graph(st, *s);
  return s;
}

// The cached graph for `k`, built on first use (never during CUDA graph capture).
SdpaGraph& graph_for(State& st, const Key& k, cudaStream_t s) {
  auto it = st.graphs.find(k);
  if (it != st.graphs.end()) return *it->second;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(s, &capture), kWhere, "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone)
    fail(kWhere, "cuDNN graph for a new shape (batch {}, seq {}) requested during CUDA graph capture; run this "
         "shape once before capturing", k.batch, k.seq);
  std::unique_ptr<SdpaGraph> built;
  try {
    built = k.backward ? build_backward(st, k) : build_forward(st, k);
  } catch (const std::exception& e) {  // kiln::Error from check_fe, or the frontend's own
    if (k.dropout_bits == 0) throw;
    fail(kWhere, "model.attention_dropout: cuDNN has no attention with dropout for this configuration (window {}, "
         "softcap {}): {}", k.window, float_of(k.softcap_bits), e.what());
  }
  return *st.graphs.emplace(k, std::move(built)).first->second;
}

// ---- calls ---------------------------------------------------------------------------

void validate(const AttentionArgs& a, const char* direction) {
  if (a.softcap < 0) fail(kWhere, "logit softcap {} is negative (the {} takes 0 = off or a positive cap)", a.softcap,
                          direction);
  if (a.q_heads <= 0 || a.kv_heads <= 0 || a.q_heads % a.kv_heads != 0)
    fail(kWhere, "cuDNN attention needs q_heads ({}) to be a multiple of kv_heads ({})", a.q_heads, a.kv_heads);
  if (a.head_dim % 8 != 0 || a.head_dim > 256)
    fail(kWhere, "cuDNN attention needs head_dim ({}) a multiple of 8, at most 256", a.head_dim);
  if (a.window < 0) fail(kWhere, "sliding window {} is negative", a.window);
}

// A uniform batch with sequences of one token stays ragged (the frontend refuses S = 1);
// its lse, [B, Hq, 1], is the same either way.
bool plain_layout(const AttentionArgs& a, int64_t max_seqlen) {
  if (!a.uniform) return false;
  if (a.tokens != a.num_seqs * max_seqlen)
    fail(kWhere, "a uniform batch must be {} sequences of {} tokens, but it has {} tokens", a.num_seqs, max_seqlen,
         a.tokens);
  return max_seqlen >= 2;
}

// The deterministic backward's dP workspace, about B * Hq * S * S * 2 bytes, grows with the
// square of the longest sequence times the count of sequences: a packed batch of many short
// documents and one long one (256 entries of up to 4096 positions, 16 heads: 137 GB) cannot
// have it. Above a sixteenth of the GPU's memory that shape's backward takes the atomic
// algorithm instead, said once per process; the runs that can be reproducible stay so.
bool deterministic_workspace_fits(const Key& k) {
  static const double limit = [] {
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    return static_cast<double>(total) / 16;
  }();
  const double bytes = 2.0 * static_cast<double>(k.batch) * static_cast<double>(k.q_heads) *
                       static_cast<double>(k.seq) * static_cast<double>(k.seq);
  if (bytes <= limit) return true;
  static std::once_flag said;
  std::call_once(said, [&] {
    warn(kWhere, fmt::format("train.deterministic: the deterministic backward of {} sequences of up to {} positions "
                             "({} heads) would need {:.1f} GiB of workspace (more than {:.1f} GiB, a sixteenth of the "
                             "GPU); such batches' attention backward accumulates with atomics instead, which is not "
                             "bitwise reproducible (shorter model.max_seq_len or fewer, longer documents per batch "
                             "avoid it)",
                             k.batch, k.seq, k.q_heads, bytes / 1073741824.0, limit / 1073741824.0));
  });
  return false;
}

Key key_of(State& st, const AttentionArgs& a, int64_t max_seqlen, bool backward) {
  const bool plain = plain_layout(a, max_seqlen);
  // A uniform batch has its exact shape: nothing to pad, and the runs that have them keep one shape.
  const Bucket b = plain ? Bucket{a.num_seqs, max_seqlen} : bucket_of(a.num_seqs, max_seqlen, bucketing_enabled(st));
  Key k{};
  k.ragged = !plain;
  const float p = a.dropout_key != nullptr ? a.dropout_p : 0.0f;
  std::memcpy(&k.dropout_bits, &p, sizeof(k.dropout_bits));
  k.backward = backward;
  k.batch = b.batch;
  k.seq = b.seq;
  k.q_heads = a.q_heads;
  k.kv_heads = a.kv_heads;
  k.head_dim = a.head_dim;
  // A window of at least S sees every key the causal mask allows: no left bound.
  k.window = (a.window > 0 && a.window < b.seq) ? a.window : 0;
  std::memcpy(&k.scale_bits, &a.scale, sizeof(k.scale_bits));
  const float softcap = a.softcap > 0 ? a.softcap : 0.0f;
  std::memcpy(&k.softcap_bits, &softcap, sizeof(k.softcap_bits));
  // The deterministic backward (the default) costs a dP workspace and time; without it dQ
  // is accumulated with atomics (not bitwise reproducible, so exact resume no longer holds).
  k.deterministic = backward && a.deterministic && deterministic_workspace_fits(k);
  if (backward && a.deterministic && !k.deterministic) ++st.atomic_fallbacks;
  return k;
}

// Frontend failures arrive as error_t (turned into kiln::Error by check_fe) or, from a few
// helpers, as exceptions: all become "[attention] cuDNN ...".
template <typename Fn>
void guarded(const char* direction, Fn&& fn) {
  try {
    fn();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(kWhere, "cuDNN {}: {}", direction, e.what());
  }
}

}  // namespace

void set_attention_cudnn_bucketing(bool on) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  st.bucketing = on ? 1 : 0;
}

int64_t attention_cudnn_atomic_fallbacks() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  return st.atomic_fallbacks;
}

int64_t attention_cudnn_graph_count() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  return static_cast<int64_t>(st.graphs.size());
}

void attention_forward_bf16(const ExecContext& ctx, const AttentionArgs& a, int64_t max_seqlen, const bf16_bits* q, const bf16_bits* k,
                            const bf16_bits* v, bf16_bits* out, float* lse) {
  validate(a, "forward");
  if (a.tokens <= 0 || a.num_seqs <= 0 || max_seqlen <= 0) return;
  guarded("forward", [&] {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    const Key key = key_of(st, a, max_seqlen, false);
    const cudaStream_t s = stream(ctx);
    SdpaGraph& g = graph_for(st, key, s);
    StreamBuffers& buffers = st.buffers[s];
    buffers.workspace.reserve(static_cast<size_t>(g.workspace_bytes), s, "workspace");
    std::unordered_map<TensorPtr, void*> pack = {{g.q, const_cast<bf16_bits*>(q)},
                                                 {g.k, const_cast<bf16_bits*>(k)},
                                                 {g.v, const_cast<bf16_bits*>(v)},
                                                 {g.o, out},
                                                 {g.stats, lse}};
    if (key.ragged) add_layout(pack, g, prepare_layout(buffers, s, a, key.batch));
    if (key.dropout_bits != 0) add_philox(pack, g, buffers, s, a);
    check_fe(g.graph->execute(handle_on(st, s), pack, buffers.workspace.ptr), "forward execute");
  });
}

void attention_backward_bf16(const ExecContext& ctx, const AttentionArgs& a, int64_t max_seqlen, const bf16_bits* q, const bf16_bits* k,
                             const bf16_bits* v, const bf16_bits* out, const float* lse, const bf16_bits* dout,
                             bf16_bits* dq, bf16_bits* dk, bf16_bits* dv) {
  validate(a, "backward");
  if (a.tokens <= 0 || a.num_seqs <= 0 || max_seqlen <= 0) return;
  guarded("backward", [&] {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    const Key key = key_of(st, a, max_seqlen, true);
    const cudaStream_t s = stream(ctx);
    SdpaGraph& g = graph_for(st, key, s);
    StreamBuffers& buffers = st.buffers[s];
    buffers.workspace.reserve(static_cast<size_t>(g.workspace_bytes), s, "workspace");
    std::unordered_map<TensorPtr, void*> pack = {{g.q, const_cast<bf16_bits*>(q)},
                                                 {g.k, const_cast<bf16_bits*>(k)},
                                                 {g.v, const_cast<bf16_bits*>(v)},
                                                 {g.o, const_cast<bf16_bits*>(out)},
                                                 {g.d_o, const_cast<bf16_bits*>(dout)},
                                                 {g.stats, const_cast<float*>(lse)},
                                                 {g.dq, dq},
                                                 {g.dk, dk},
                                                 {g.dv, dv}};
    if (key.ragged) add_layout(pack, g, prepare_layout(buffers, s, a, key.batch));
    if (key.dropout_bits != 0) add_philox(pack, g, buffers, s, a);
    check_fe(g.graph->execute(handle_on(st, s), pack, buffers.workspace.ptr), "backward execute");
  });
}

}  // namespace kiln::cuda
