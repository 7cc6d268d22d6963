// The run configuration: TOML sections [model] [data] [train] [optim] [log] [checkpoint].
//
// Every key has a default here; a TOML file and `--set section.key=value` overrides
// change them. Unknown keys and ill-typed or out-of-range values are errors naming the
// key. The resolved configuration is written next to every run and saved model.
//
// Adding a key: the member here plus one KILN_FIELD line in config/config_fields.cpp,
// which drives parsing, --set, validation and config_to_toml.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

// The sparse MLP's keys ([model.moe]; the MLP registry name "moe"): routed SwiGLU experts
// of their own width, an optional always-on shared expert, a router from the router
// registry, and its losses. Which layers are sparse: model.mlp / model.alt_mlp_layers.
struct MoeConfig {
  int64_t experts = 8;                 // routed experts
  int64_t top_k = 2;                   // experts per token
  int64_t expert_hidden = 128;         // each routed expert's SwiGLU width (moe_intermediate_size)
  int64_t shared_hidden = 0;           // the shared expert's SwiGLU width, applied to every token; 0 = none
  int64_t latent_width = 0;            // LatentMoE: routed experts work in a projected latent of this width; 0 = off
  std::string router = "softmax_topk"; // registry: routers
  bool norm_topk_prob = true;          // routing weights renormalized over the chosen experts
  double routed_scaling = 1.0;         // routing weights x this (DeepSeek-V3's routed_scaling_factor)
  double aux_loss = 0.0;               // load-balancing loss coefficient (Switch form: E sum_i f_i P_i)
  double z_loss = 0.0;                 // router z-loss coefficient (mean logsumexp(router logits)^2)
  // What the balance loss's f_i and P_i average over: each micro-batch (micro_batch), or the
  // whole step, every micro-batch of every data-parallel rank (step; seed 004, transformers),
  // at one extra forward per step (docs/moe-routers.md).
  std::string balance_scope = "micro_batch";
  double bias_rate = 1e-3;             // sigmoid_bias: step of the load-balancing bias update
  std::string bias_update = "sign";    // sigmoid_bias: sign | proportional
  int64_t groups = 1;                  // group-limited routing: experts in this many groups ...
  int64_t top_groups = 1;              // ... of which the best top_groups are eligible
  // Capacity: token-choice routers drop an expert's routed pairs past ceil(cf T k / E) per
  // micro-batch in training (0: dropless); expert_choice's per-expert tokens (0: 1).
  double capacity_factor = 0.0;
  int64_t sinkhorn_iterations = 8;     // sinkhorn: balancing iterations over a micro-batch
  double l1_coef = 1e-8;               // relu: the L1 penalty's initial coefficient (ReMoE's lambda_0)
  double l1_rate = 1.2;                // relu: the coefficient's factor per step (ReMoE's alpha, > 1)
  // Training keeps the experts' output rows [T k, d] for the routing weights' gradient
  // (dout . y) when true; false (the default) forms that gradient from their activations
  // instead (SonicMoE's form, ops::moe_swiglu_backward) and keeps no output rows: T k d
  // elements less per sparse layer, at the same speed (docs/moe-routers.md).
  bool save_outputs = false;
};

// RoPE's frequency scaling ([model.rope]; used where model.position is "rope"): how the
// inverse frequencies of rope_theta are stretched for a context longer than the one the
// base frequencies suit, as transformers' rope_parameters express it (nn/rope_scaling.h).
struct RopeConfig {
  std::string scaling = "none";        // none | linear | ntk | yarn | llama3
  double factor = 1.0;                 // context stretch (linear, ntk, yarn, llama3)
  int64_t original_max_seq_len = 0;    // yarn, llama3: the context the base frequencies were trained at
  double low_freq_factor = 1.0;        // llama3: wavelengths above original / this are divided by factor
  double high_freq_factor = 4.0;       // llama3: wavelengths below original / this are kept
  double beta_fast = 32.0;             // yarn: rotations where extrapolation ends ...
  double beta_slow = 1.0;              // ... and where interpolation begins
  double attention_factor = 0.0;       // yarn: cos/sin x this; 0 = 0.1 ln(factor) + 1 (the paper's)
  double fraction = 1.0;               // partial rotary: the share of each head's dims rotated (transformers'
                                       // partial_rotary_factor); the frequencies are those of that many dims
  // The base of the windowed (local) layers' RoPE, plain (unscaled) as Gemma 3's local layers
  // (rope_local_base_freq); the global layers keep model.rope_theta and the scaling. 0 = one base.
  double local_theta = 0.0;
};

// Multi-token prediction ([model.mtp], training only; model/multi_token_prediction.h): heads
// that learn to predict tokens further ahead than the next, whose losses join the objective.
// Validation, evaluation, decode and exports use the main head only.
struct MtpConfig {
  int64_t depth = 0;                   // predicted tokens beyond the next (t+2 .. t+1+depth); 0 = off
  std::string form = "sequential";     // sequential (DeepSeek-V3's modules) | parallel (seed 002's heads)
  // Each depth's loss weight, comma-separated ("0.1,0.05"); "" = the form's default:
  // sequential 0.1 / depth each beside the main loss at 1 (DeepSeek-V3); parallel the plain
  // average of the main loss and every depth's, 1 / (depth + 1) each (seed 002).
  std::string weights;
};

// Kimi Delta Attention's keys ([model.kda]; the token mixer "kda", nn/kda_mixer.h,
// docs/kda.md). 0 = the default named beside each.
struct KdaConfig {
  int64_t heads = 0;        // KDA heads; 0 = model.heads
  int64_t head_dim = 0;     // d_k = d_v per head; 0 = model.head_dim
  int64_t conv_kernel = 4;  // the causal depthwise short convolution's width over q, k, v
  int64_t gate_rank = 0;    // the low-rank decay and output gates' inner width; 0 = head_dim
  // The delta rule's CUDA kernels: "recurrent" (token by token), "chunked" (the WY form by
  // 64-token chunks, d_k <= 128; docs/kda.md says which is faster where), "chunked_bf16"
  // (chunked, its backward's chunk gradients on bf16 tensor cores) or "auto" (chunked_bf16
  // where the head_dim allows, else recurrent: nn/kda_mixer.h). The CPU always trains on the
  // chunked form.
  std::string gpu_kernel = "auto";
  // The short convolution's CUDA kernels: "sweep" (a thread per channel and tile of tokens,
  // its window in registers; ops/short_conv/short_conv_sweep.h: 9.8% faster steps at K3's
  // 8 x 4096 on an H100) or "per_element" (a thread per token and channel, the first kernels).
  std::string conv_gpu_kernel = "sweep";
};

// NoPE multi-head latent attention's keys ([model.mla]; the token mixer "mla",
// nn/mla_mixer.h, docs/mla.md). 0 = the default named beside each; heads are model.heads.
struct MlaConfig {
  int64_t kv_rank = 0;      // the latent c's width (what decode caches); 0 = model.hidden / 4
  int64_t qk_head_dim = 0;  // d_qk per head; 0 = model.head_dim
  int64_t v_head_dim = 0;   // d_v per head; 0 = model.head_dim
};

struct ModelConfig {
  std::string name = "qwen3-byte-tiny";
  int64_t vocab_size = 259;        // byte-level: 256 bytes + BOS, EOS, PAD
  int64_t hidden = 192;
  int64_t layers = 4;
  int64_t heads = 6;               // query heads
  int64_t kv_heads = 2;            // grouped-query attention: heads % kv_heads == 0
  int64_t head_dim = 32;           // independent of hidden / heads, as in Qwen3
  int64_t ffn_hidden = 512;        // SwiGLU intermediate size
  int64_t max_seq_len = 256;       // longest sequence attention sees (context)
  std::string norm = "rmsnorm";    // registry: norms
  // The norm before the LM head; "" = model.norm. A DyT model needs a rescaling norm here or
  // embed_scale about 2 / init_std, else it stays at the unigram plateau (docs/dyt.md).
  std::string final_norm;
  // Sandwich norms (Gemma 2/3): a model.norm on each branch's output too, before its
  // residual add: h = x + norm(attn(norm(x))), y = h + norm(mlp(norm(h))).
  bool sandwich_norms = false;
  double norm_eps = 1e-6;
  std::string mlp = "swiglu";      // registry: mlps
  std::string attention = "gqa";   // registry: token mixers (attention)
  std::string position = "rope";   // registry: position encodings
  double rope_theta = 10000.0;
  RopeConfig rope;                 // [model.rope]: its scaling
  bool qk_norm = true;             // per-head norm on q and k before RoPE (Qwen3)
  std::string qk_norm_type = "rmsnorm";  // that norm: rmsnorm | gemma_rmsnorm | dyt
  double dyt_alpha = 0.5;          // DyT norms (model.norm or qk_norm_type "dyt"): alpha's initial value
  int64_t ungated_ffn_hidden = 0;  // the ungated MLPs' (gelu, relu2) width; 0 = 4 x hidden (GPT-2)
  bool tie_embeddings = true;
  double embed_scale = 1.0;        // the embedding's output x this (Gemma: sqrt(hidden))
  // Dropout, training only (evaluation, sampling and decode drop nothing): the probability
  // of zeroing each element of every block's attention and MLP output before its residual
  // add, and of the embedding's output (ops/dropout); and of each attention layer's softmax
  // probabilities (ops/attention/attention.h: AttentionOptions::dropout).
  double dropout = 0.0;
  double embed_dropout = 0.0;
  double attention_dropout = 0.0;
  bool attention_bias = false;     // bias on q/k/v projections (Qwen2-style)
  double init_std = 0.02;
  // muP (docs/mup.md): the width the hyperparameters were tuned at; hidden init std, residual
  // writers, the LM head's init and AdamW learning rates then scale with hidden / this, so
  // they transfer across widths. 0 = off.
  int64_t mup_base_width = 0;
  int64_t sliding_window = 0;      // query i sees keys j with i - j < window; 0 = full causal
  // Per-layer patterns, each a layer set (config/layer_pattern.h: "3", "0-5", "every:4",
  // "first:2", "from:2", "all", "~..." for the complement, "" for none).
  std::string full_attention_layers = "";  // layers exempt from sliding_window (global layers)
  std::string nope_layers = "";            // layers without model.position (NoPE)
  std::string alt_mlp = "";                // registry: mlps; the MLP of the layers below
  std::string alt_mlp_layers = "";         // layers whose MLP is alt_mlp instead of mlp
  std::string alt_attention = "";          // registry: token mixers; the mixer of the layers below
  std::string alt_attention_layers = "";   // layers whose token mixer is alt_attention instead of attention
  double attention_softcap = 0;    // attention logits -> cap * tanh(logits / cap); 0 = off
  // A learnable sink logit per query head in every attention softmax's denominator, with no
  // value (GPT-OSS's sinks; docs/attention-sinks.md). CPU only.
  bool attention_sinks = false;
  double logit_softcap = 0;        // LM head logits -> cap * tanh(logits / cap); 0 = off
  // Block Attention Residuals (Kimi, docs/attn-res.md): each sublayer (an attention or MLP
  // output) reads a learned softmax mix over depth of the embedding and the block sums
  // instead of the plain residual stream; this many sublayers make one block. 0 = off.
  // CPU only.
  int64_t attn_res_block = 0;
  MoeConfig moe;                   // [model.moe]: used by layers whose MLP is "moe"
  MtpConfig mtp;                   // [model.mtp]: multi-token prediction (training only)
  KdaConfig kda;                   // [model.kda]: used by layers whose token mixer is "kda"
  MlaConfig mla;                   // [model.mla]: used by layers whose token mixer is "mla"
};

// One source of a weighted mixture ([[data.sources]], docs/data.md "Mixtures"): any path
// data.path takes, drawn in proportion to `weight` (normalized over the sources).
struct DataSource {
  std::string path;  // file, directory or glob; relative to the config file that gives it
  double weight = 0.0;  // > 0; required
  std::string name;  // for logs and metrics; "" = the path's file name
  bool operator==(const DataSource&) const = default;
};

struct DataConfig {
  // "" when data.sources is given (the two are mutually exclusive).
  std::string path = "data/tinyshakespeare.txt";
  std::string tokenizer = "byte";      // "byte", or a tokenizer.json path (byte-level BPE, docs/data.md)
  std::string format = "auto";         // auto | text | jsonl | parquet | arrow | shards | llmc | raw_u16 | raw_u32
  std::string text_key = "text";       // JSONL field / Parquet or Arrow column holding the document
  std::string doc_separator = "\n\n";  // text files: documents are separated by this
  double val_fraction = 0.05;          // share of documents held out, chosen by hash
  std::string long_doc = "split";      // split | drop | error: documents over max_seq_len
  // Where split documents are cut: per_epoch (each epoch after the first at a fresh random
  // offset, so a long text does not meet the same rows at the same positions every epoch)
  // | zero (always at multiples of max_seq_len).
  std::string long_doc_offset = "per_epoch";
  uint64_t seed = 1234;                // document order shuffling
  // Readers, shards and loader (docs/data.md): data.path may be a file, a directory or a
  // glob; .zst/.gz are decompressed; pre-tokenized formats are memory-mapped.
  std::string val_path = "";           // validation data; "" = split data.path by hash (val_fraction)
  bool lenient = false;                // skip and count bad input instead of stopping
  int64_t eot_id = -1;                 // llm.c/raw token files: document delimiter; -1 = tokenizer BOS
  int64_t prefetch = 4;                // micro-batches packed ahead by a background thread; 0 = off
  int64_t rank = 0;                    // data-parallel rank (used when world_size > 0)
  int64_t world_size = 0;              // data-parallel ranks; 0 = env RANK/WORLD_SIZE, else 1
  // [[data.sources]]: a weighted mixture instead of data.path; empty = data.path. Not a
  // KILN_FIELD (an array of tables): config.cpp reads, checks and writes it by hand.
  std::vector<DataSource> sources;
};

struct TrainConfig {
  int64_t steps = 600;
  // A token budget instead: train.steps becomes ceil(tokens / tokens per step), the step's
  // tokens over every rank (micro_batch_tokens x grad_accum x ranks). 0 = train.steps.
  int64_t tokens = 0;
  int64_t micro_batch_tokens = 4096;   // fixed token budget per micro-batch
  int64_t grad_accum = 1;              // micro-batches per optimizer step
  uint64_t seed = 1337;                // weight init and sampling
  // Continued pretraining: the initial weights from a kiln model directory, checkpoint or
  // run directory, or a Hugging Face folder (train/init_from.h); "" = random init. The
  // optimizer, step count, schedule and data position start fresh; a resume ignores it.
  std::string init_from;
  std::string device = "auto";         // auto | cpu | cuda
  // auto = bf16 on the GPU (bf16 activations, fp32 masters, gradients and optimizer
  // state), fp32 on the CPU; fp32 forces fp32 everywhere; bf16 needs the GPU.
  std::string precision = "auto";      // auto | fp32 | bf16 | fp8_tensorwise | fp8_blockwise
  // fp8_blockwise's GPU quantize kernels: "vector" (16-byte vectors, one read for a tile's
  // both kinds) or "scalar" (one element a thread); the same bits (docs/fp8.md).
  std::string fp8_blockwise_kernels = "vector";
  // The blocks whose dense projections are FP8 (a layer set: "all", "~first:1", "1-26"...);
  // the rest stay in the device's precision. Needs an FP8 precision unless "all".
  std::string fp8_layers = "all";
  // FP8 recipes: each dense projection keeps its input's FP8 operand from forward to
  // backward (1 byte per input element per micro-batch: faster, x quantized once); false
  // quantizes x again in backward and keeps nothing.
  bool fp8_keep_inputs = true;
  // fp8_tensorwise: the routed experts' grouped GEMMs in FP8 too (one scale per expert weight,
  // one for the gathered activations, one for their gradient); refused with other precisions.
  bool fp8_experts = false;
  // Activation recompute: the first N blocks save only their input and run their forward
  // again in backward (same results; less memory, ~1/3 more compute for those blocks).
  int64_t recompute_blocks = 0;
  // Bitwise-reproducible kernels (and so exact resume) where a faster non-deterministic one
  // exists: today cuDNN's attention backward (atomic dQ accumulation when false, as
  // PyTorch's SDPA backends). The CPU is deterministic either way.
  bool deterministic = true;
  // GPU: the step keeps its scalars (loss, gradient norm, guard verdict, clip, learning
  // rate) in device memory, reads them once when it has run, and replays each micro-batch
  // and the update as CUDA graphs (train/step_program.h). false: the op-by-op step that
  // reads the loss after each micro-batch and the norm before the update (same results).
  bool cuda_graphs = true;
  int64_t threads = 0;                 // CPU threads; 0 = all cores
  std::string out_dir = "runs/default";
  double z_loss = 0.0;                 // coefficient of mean(logsumexp^2)
  int64_t loss_chunk_tokens = 1024;    // LM head rows per chunk (logits never whole)
  // A periodic action's cadence is steps (*_every) or tokens (*_every_tokens: each time
  // the tokens trained cross a multiple), one of them: a tokens key > 0 makes its steps
  // key's default 0, and both given > 0 are refused (validate_config).
  int64_t eval_every = 100;            // steps between validation; 0 = only at the end
  int64_t eval_every_tokens = 0;       // tokens between validation instead; 0 = off
  int64_t eval_batches = 8;            // micro-batches of held-out data per validation
  int64_t sample_every = 200;          // steps between samples; 0 = only at the end
  int64_t sample_every_tokens = 0;     // tokens between samples instead; 0 = off
  int64_t sample_tokens = 200;
  double sample_temperature = 0.8;
  int64_t sample_top_k = 40;
  std::string sample_prompt = "ROMEO:";
  // Numerical fault guard (train/fault_guard.h): a non-finite loss or gradient norm skips
  // the update; so does, when spike_window > 0, a loss or gradient norm above ratio x its
  // mean over the last spike_window applied steps.
  int64_t max_consecutive_skips = 5;   // stop after this many skipped updates in a row; 0 = never
  int64_t spike_window = 0;            // applied steps in the spike guard's window; 0 = off
  double spike_loss_ratio = 2.0;       // skip when loss > ratio x window mean
  double spike_grad_ratio = 10.0;      // skip when grad norm (before clipping) > ratio x window mean
  // Dynamic loss scaling (train/loss_scaler.h), fp16's: "none" | "dynamic".
  std::string loss_scale = "none";
  double loss_scale_init = 65536;             // the first scale, a power of two >= 1
  int64_t loss_scale_growth_interval = 2000;  // applied steps without overflow before the scale doubles
};

// One parameter role's optimizer ([optim.<role>], nn/param_role.h). -1 takes the [optim]
// value. Roles whose settings resolve alike share one optimizer instance (a group).
struct RoleOptimConfig {
  std::string optimizer = "auto";  // registry: optimizers; auto = optim.name where it takes the role, else adamw
  double lr_scale = 1.0;           // this role's learning rate = the schedule's x lr_scale
  double weight_decay = -1;        // decoupled; -1 = optim.weight_decay
  double beta1 = -1;               // AdamW's first-moment decay (Muon: its momentum); -1 = optim.beta1 (muon.momentum)
  double beta2 = -1;               // AdamW's second-moment decay; -1 = optim.beta2

  static RoleOptimConfig undecayed() {
    RoleOptimConfig r;
    r.weight_decay = 0;
    return r;
  }
};

// Muon ([optim.muon]; train/muon.h): momentum, then its Newton-Schulz orthogonalization,
// scaled so the update's RMS matches AdamW's.
struct MuonConfig {
  double momentum = 0.95;
  bool nesterov = true;
  bool ema = false;                   // m = mu m + (1 - mu) g, instead of m = mu m + g
  int64_t ns_steps = 5;               // Newton-Schulz iterations (quintic 3.4445, -4.7750, 2.0315)
  std::string scale = "moonlight";    // moonlight: 0.2 sqrt(max(rows, cols)) | shape: sqrt(max(1, rows / cols))
};

// QK-Clip ([optim.qk_clip]; nn/qk_clip.h): after each applied update, the query and key
// weights of the heads whose largest attention logit of the step exceeded tau are scaled
// so it would have been tau (MuonClip; with any optimizer).
struct QkClipConfig {
  bool enabled = false;
  double tau = 100;
};

struct OptimConfig {
  std::string name = "adamw";        // registry: optimizers (the matrices'; others per [optim.<role>])
  double lr = 3e-3;
  double min_lr_ratio = 0.1;         // cosine decays to lr * min_lr_ratio
  int64_t warmup_steps = 50;
  int64_t warmup_tokens = 0;         // > 0: the warmup in tokens instead (rounded up to whole steps)
  std::string schedule = "cosine";   // registry: schedules
  // wsd (warmup-stable-decay): the decay tail's length in steps (0: decay_fraction of
  // train.steps) and shape (linear | cosine | 1-sqrt), down to lr * min_lr_ratio.
  int64_t decay_steps = 0;
  int64_t decay_tokens = 0;          // > 0: the tail in tokens instead (rounded up to whole steps)
  double decay_fraction = 0.2;
  std::string decay_shape = "linear";
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;            // global L2 norm; 0 disables
  // How AdamW stores its moments m and v (ops/optim/adamw_lowmem.h): fp32 (8 bytes a
  // parameter) | bf16 (4) | int8 (2 + 8/256: blockwise 8-bit codes, tensors under 4096
  // elements stay fp32). Fixed for a run: a checkpoint's state is in its own format.
  std::string adamw_state = "fp32";
  // The masters of the 2-D weights (ops/optim/stochastic_round.h): fp32 (a bf16 compute copy
  // beside each) | bf16 (the bf16 weights are the masters, updated in fp32 and written back
  // with stochastic rounding: 2 bytes a weight instead of 4 + 2). GPU mixed precision only.
  std::string master_weights = "fp32";
  // Per role: matrices, experts and an untied head decay; the embedding (and a tied head),
  // routers, norm gains and biases do not.
  RoleOptimConfig embedding = RoleOptimConfig::undecayed();
  RoleOptimConfig head;
  RoleOptimConfig matrix;
  RoleOptimConfig expert;
  RoleOptimConfig router = RoleOptimConfig::undecayed();
  RoleOptimConfig norm = RoleOptimConfig::undecayed();
  RoleOptimConfig bias = RoleOptimConfig::undecayed();
  MuonConfig muon;
  QkClipConfig qk_clip;
};

struct LogConfig {
  int64_t every = 10;                 // console/metrics line every N steps (0 only with every_tokens)
  int64_t every_tokens = 0;           // a line each time the tokens cross a multiple instead; 0 = off
  std::string metrics_file = "metrics.jsonl";
  bool plot = true;                   // draw the run's curves into <out_dir>/plot.png at the end (kiln plot)
  // TensorBoard event files of every record metrics.jsonl has (train/tensorboard_log.h).
  bool tensorboard = true;
  std::string tensorboard_dir = "tensorboard";  // inside out_dir
};

struct CheckpointConfig {
  bool save_final = true;  // write <out_dir>/model at the end of training
  // Resumable checkpoints (train/checkpoint.h): DIR/step-NNNNNNNN/ plus DIR/latest.
  int64_t every = 100;                 // steps between checkpoints (and one at the end); 0 = off
  int64_t every_tokens = 0;            // tokens between checkpoints instead; 0 = off
  // A stock Hugging Face export (io/hf_export.h, fp32) of the model every N steps into
  // <train.out_dir>/hf/step-N, from that step's checkpoint (saved then if none was due); 0 = off.
  int64_t export_hf_every = 0;
  int64_t export_hf_every_tokens = 0;  // tokens between exports instead; 0 = off
  std::string dir = "";                // "" = <train.out_dir>/checkpoints
  int64_t keep_last = 2;               // newest checkpoints kept; 0 = keep all
  int64_t keep_every = 0;              // also keep every checkpoint whose step is a multiple; 0 = none
  // Also keep the checkpoint of the best validation loss so far (saved at that evaluation
  // when none was due; DIR/best names it).
  bool keep_best = false;
  std::string on_save_error = "stop";  // stop | continue: a failed save or metrics write ends the run or warns
};

// Downstream evaluation during training (eval/eval_suite.h, `kiln eval`): multiple-choice
// tasks scored by log-likelihood and the perplexity of text files, every N steps and at the
// end, on the device the model trains on; logged, in metrics.jsonl and TensorBoard.
struct EvalConfig {
  std::string tasks = "";   // multiple-choice task files (JSONL), comma-separated; "" = none
  std::string texts = "";   // text or JSONL files whose perplexity is measured, comma-separated
  int64_t every = 0;        // steps between evaluations; 0 = only at the end of training
  int64_t every_tokens = 0; // tokens between evaluations instead; 0 = off
  int64_t limit = 0;        // examples per task (the first ones); 0 = all
  int64_t slots = 8;        // sequences scored at once (the evaluation decoder's KV-cache slots)
  bool bos = true;          // BOS before each context, as training documents start
};

// Multi-process runs (docs/distributed.md); the ranks come from the launcher's environment.
struct DistConfig {
  // Seconds a collective, or the rendezvous at start, waits for the other ranks before
  // this rank stops with an error naming it: a dead or hung rank never hangs the others.
  // Longer than the longest pause of rank 0 alone (a checkpoint save).
  double timeout = 300;
  // Data parallelism reduces the gradients in buckets of about this many MiB, each launched
  // as soon as backward has written its last gradient, overlapping the rest of backward
  // (train/gradient_buckets.h). 0: one reduction of every gradient after backward.
  double bucket_mb = 25;
  // ZeRO stage (docs/distributed.md): 0 keeps the optimizer state whole on every rank; 1
  // gives each rank the state of one contiguous shard of the parameters, which it alone
  // updates, and all-gathers the updated parameters (docs/distributed.md).
  int64_t zero = 0;
  // Pipeline parallelism on the CPU (docs/distributed.md, "Training with a pipeline"): the
  // model's layers cut into this many stages, one per rank; 1 = off.
  int64_t pipeline_stages = 1;
  std::string pipeline_schedule = "1f1b";  // gpipe | 1f1b | interleaved | zb_h1
  int64_t pipeline_virtual_stages = 1;     // interleaved: stages per rank (v)
  std::string pipeline_split = "";         // first layer of each stage ("0,3,6"); "" = planned
  // Where the planned split's per-layer costs come from: "estimate" (FLOPs and planned bytes
  // from the config) or "measure" (block kinds timed, each layer's bytes read, at startup).
  std::string pipeline_costs = "estimate";
  // What a stage keeps of a micro-batch's forward until its backward: "frames" (its saved
  // activations, one activation frame per micro-batch in flight) or "recompute" (its input
  // only, the forward run again before the backward: less memory, a third more compute).
  std::string pipeline_activations = "frames";
  // zb_h1 with frames: split each backward into the input-gradient pass (B) and the
  // LinearLayers' weight gradients (W), which is the schedule's gain; false runs the whole
  // backward at B (same results, 1F1B's bubble). Other schedules never split.
  bool pipeline_split_backward = true;
  // What each pipeline rank builds: "whole" (the whole model, running only its stages'
  // layers: every rank holds every parameter, gradient and optimizer state) or "stages"
  // (only its stages' layers, with the embedding on the first stage and the final norm and
  // head on the last: a rank's parameters, gradients and optimizer state are its stages').
  std::string pipeline_model = "whole";
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  OptimConfig optim;
  LogConfig log;
  CheckpointConfig checkpoint;
  EvalConfig eval;
  DistConfig dist;
  // The keys the user chose: given by --set, or by the config file with a value other than
  // the default (a file such as configs/default.toml lists every key). Where the user chose
  // nothing a default may give way: a token cadence's steps key, a shard set's tokenizer
  // (data/shards/shard_tokenizer.h). Filled by load_config; not written to TOML.
  std::vector<std::string> chosen;
  bool was_chosen(const std::string& key) const;
};

// Loads a TOML file (empty path = defaults only), then applies "section.key=value"
// overrides in order, then validates. Throws kiln::Error naming the file, key or value.
// Path keys (ConfigRule::PathKind) come back absolute: relative ones given by the file
// against its directory, the others (--set, defaults) against the working directory.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Applies one "section.key=value" override; throws naming the key on error.
void apply_override(Config& config, const std::string& assignment);
// Checks ranges and cross-field rules (heads % kv_heads == 0, ...); throws naming the key.
void validate_config(const Config& config);
// The head dims RoPE rotates: model.rope.fraction x model.head_dim, which validate_config
// holds to an even whole number (pairs (j, j + head_dim / 2) for j < this / 2 rotate).
int64_t rotary_dims(const ModelConfig& model);
// The fully resolved configuration as TOML, every key present; load_config reads it back.
std::string config_to_toml(const Config& config);

}  // namespace kiln
