#include "config/config_fields.h"

#include <array>

namespace kiln {
namespace {

constexpr ConfigRule none() { return {}; }
constexpr ConfigRule positive() { return {ConfigRule::kPositive}; }
constexpr ConfigRule non_negative() { return {ConfigRule::kNonNegative}; }
constexpr ConfigRule unit_open() { return {ConfigRule::kUnitOpen}; }
constexpr ConfigRule unit_closed() { return {ConfigRule::kUnitClosed}; }
constexpr ConfigRule non_empty() { return {ConfigRule::kNonEmpty}; }
constexpr ConfigRule one_of(std::string_view choices) { return {ConfigRule::kOneOf, choices}; }

// Upper bounds: far past any real run, low enough that a typo (2^62, 1e9) is refused by
// name before a plan, a reservation or a 32-bit index goes wrong.
constexpr int64_t kMaxPositions = 2147483647;  // INT32_MAX: positions, cu_seqlens, rows
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxWidth = int64_t{1} << 16;
constexpr int64_t kMaxFfn = int64_t{1} << 18;
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxHeadDim = 1024;
constexpr int64_t kMaxHeldBatches = 65536;
constexpr int64_t kMaxThreads = 4096;
constexpr int64_t kMaxSpikeWindow = 100000;
// Kimi K2 routes over 384 experts; each expert's matrices are allocated, so 2^31 of them
// was a 16 s bad_alloc naming nothing.
constexpr int64_t kMaxExperts = 4096;
// Sinkhorn converges in tens of passes; a billion made the first step endless, and SIGTERM
// waits for a step boundary.
constexpr int64_t kMaxSinkhornIterations = 1000;
// A week: a collective that waits longer is hung, and 1e308 s overflowed Gloo's
// millisecond timeout ("Invalid timeout", after the rendezvous).
constexpr int64_t kMaxTimeoutSeconds = 7 * 24 * 3600;
// Multi-token prediction depths: each takes three of the step's loss slots
// (nn/loss_terms.h); DeepSeek-V3 uses 1, seed 001 up to 4.
constexpr int64_t kMaxMtpDepth = 8;


// One line per key: section, member of Config, rule, help.
#define KILN_FIELD(section, key, rule, help) \
  ConfigField { #section, #key, rule, help, [](Config& c) -> ConfigValueRef { return &c.section.key; } }
// The five keys of one parameter role's [optim.<role>] section.
#define KILN_ROLE_FIELDS(role, what)                                                                       \
  KILN_FIELD(optim.role, optimizer, non_empty(), "optimizer of " what "; auto = optim.name if it takes them"), \
      KILN_FIELD(optim.role, lr_scale, positive(), "learning rate multiplier"),                             \
      KILN_FIELD(optim.role, weight_decay, non_negative().or_unset(), "-1 = optim.weight_decay"),            \
      KILN_FIELD(optim.role, beta1, unit_open().or_unset(), "AdamW beta1 (Muon: momentum); -1 = optim.beta1"), \
      KILN_FIELD(optim.role, beta2, unit_open().or_unset(), "AdamW beta2; -1 = optim.beta2")

const std::array kFields = {
    KILN_FIELD(model, name, none(), "label recorded with the run"),
    KILN_FIELD(model, vocab_size, positive().up_to(kMaxVocab, "64x the largest vocabularies in use"),
               "byte-level: 256 bytes + BOS, EOS, PAD"),
    KILN_FIELD(model, hidden, positive().up_to(kMaxWidth, "4x the widest models in use"), "residual stream width"),
    KILN_FIELD(model, layers, positive().up_to(kMaxLayers, "8x the deepest models in use; each layer is planned"),
               "transformer blocks"),
    KILN_FIELD(model, heads, positive().up_to(kMaxHeads, "8x the most heads in use"), "query heads"),
    KILN_FIELD(model, kv_heads, positive().up_to(kMaxHeads, "8x the most heads in use"),
               "key/value heads; heads % kv_heads == 0"),
    KILN_FIELD(model, head_dim, positive().up_to(kMaxHeadDim, "4x the widest heads in use"),
               "per-head width, independent of hidden / heads"),
    KILN_FIELD(model, ffn_hidden, positive().up_to(kMaxFfn, "4x the widest MLPs in use"), "MLP intermediate size"),
    KILN_FIELD(model, max_seq_len, positive().up_to(kMaxPositions, "positions are 32-bit"),
               "longest sequence attention sees"),
    KILN_FIELD(model, norm, none(), "registry: norms"),
    KILN_FIELD(model, final_norm, none(), "registry: norms, the norm before the LM head; \"\" = model.norm"),
    KILN_FIELD(model, sandwich_norms, none(),
               "a model.norm on each branch's output before its residual add too (Gemma 2/3's post-norms)"),
    KILN_FIELD(model, norm_eps, positive(), "epsilon inside the norm"),
    KILN_FIELD(model, mlp, none(), "registry: mlps"),
    KILN_FIELD(model, attention, none(), "registry: token mixers (attention)"),
    KILN_FIELD(model, position, none(), "registry: position encodings"),
    KILN_FIELD(model, rope_theta, positive(), "RoPE base frequency"),
    KILN_FIELD(model, qk_norm, none(), "per-head norm on q and k before RoPE (model.qk_norm_type)"),
    KILN_FIELD(model, qk_norm_type, one_of("rmsnorm|gemma_rmsnorm|dyt"), "the q/k norm: rmsnorm | gemma_rmsnorm | dyt"),
    KILN_FIELD(model, dyt_alpha, positive(), "DyT norms: alpha's initial value (Zhu et al. 2025: 0.5)"),
    KILN_FIELD(model, ungated_ffn_hidden, non_negative().up_to(kMaxFfn, "4x the widest MLPs in use"),
               "width of the ungated MLPs (gelu, relu2); 0 = 4 x model.hidden (GPT-2)"),
    KILN_FIELD(model, tie_embeddings, none(), "LM head shares the embedding matrix"),
    KILN_FIELD(model, embed_scale, positive(), "the embedding's output x this (Gemma: sqrt(hidden)); 1 = none"),
    KILN_FIELD(model, attention_bias, none(), "bias on q/k/v projections"),
    KILN_FIELD(model, init_std, non_negative(), "std of the normal weight init"),
    KILN_FIELD(model, mup_base_width, non_negative(),
               "muP: the width hyperparameters were tuned at (docs/mup.md); 0 = off"),
    KILN_FIELD(model, sliding_window, non_negative(), "attention window in tokens; 0 = full causal"),
    KILN_FIELD(model, full_attention_layers, none(), "layer set exempt from sliding_window, e.g. \"every:6\""),
    KILN_FIELD(model, nope_layers, none(), "layer set without model.position (NoPE layers)"),
    KILN_FIELD(model, alt_mlp, none(), "registry: mlps, for the layers of alt_mlp_layers"),
    KILN_FIELD(model, alt_mlp_layers, none(), "layer set whose MLP is alt_mlp instead of mlp"),
    KILN_FIELD(model, alt_attention, none(), "registry: token mixers, for the layers of alt_attention_layers"),
    KILN_FIELD(model, alt_attention_layers, none(), "layer set whose token mixer is alt_attention instead of attention"),
    KILN_FIELD(model, dropout, non_negative(), "drop probability of each block's attention and MLP output (training)"),
    KILN_FIELD(model, embed_dropout, non_negative(), "drop probability of the embedding's output (training)"),
    KILN_FIELD(model, attention_dropout, non_negative(),
               "drop probability of each attention layer's softmax probabilities (training)"),
    KILN_FIELD(model, attention_softcap, non_negative(), "cap * tanh(x / cap) of attention logits; 0 = off"),
    KILN_FIELD(model, attention_sinks, none(),
               "a learned per-head logit in each attention softmax's denominator (GPT-OSS)"),
    KILN_FIELD(model, logit_softcap, non_negative(), "cap * tanh(x / cap) of the LM head's logits; 0 = off"),
    KILN_FIELD(model, attn_res_block, non_negative().up_to(2 * kMaxLayers, "a block past every sublayer is one block"),
               "Block Attention Residuals: sublayers (attention or MLP outputs) per block; 0 = plain residual stream "
               "(docs/attn-res.md)"),

    KILN_FIELD(model.rope, scaling, one_of("none|linear|ntk|yarn|llama3"),
               "RoPE frequency scaling: none | linear | ntk | yarn | llama3"),
    KILN_FIELD(model.rope, factor, positive(), "context stretch of the scaling (>= 1)"),
    KILN_FIELD(model.rope, original_max_seq_len, non_negative().up_to(kMaxPositions, "positions are 32-bit"),
               "yarn, llama3: the context the base frequencies suit"),
    KILN_FIELD(model.rope, low_freq_factor, positive(), "llama3: wavelengths above original / this are scaled"),
    KILN_FIELD(model.rope, high_freq_factor, positive(), "llama3: wavelengths below original / this are kept"),
    KILN_FIELD(model.rope, beta_fast, positive(), "yarn: rotations where extrapolation ends"),
    KILN_FIELD(model.rope, beta_slow, positive(), "yarn: rotations where interpolation begins"),
    KILN_FIELD(model.rope, attention_factor,
               non_negative().up_to(16, "its default 0.1 ln(factor) + 1 stays below 4 for any stretch"),
               "yarn: cos/sin x this; 0 = 0.1 ln(factor) + 1"),
    KILN_FIELD(model.rope, fraction, positive(), "partial rotary: the share of each head's dims rotated; 1 = all"),
    KILN_FIELD(model.rope, local_theta, non_negative(),
               "RoPE base of the windowed layers, unscaled (Gemma 3: 10000); 0 = model.rope_theta"),

    KILN_FIELD(model.moe, experts, positive().up_to(kMaxExperts, "10x the most experts in use; each is allocated"),
               "routed experts"),
    KILN_FIELD(model.moe, top_k, positive(), "experts per token"),
    KILN_FIELD(model.moe, expert_hidden, positive(), "each routed expert's SwiGLU width"),
    KILN_FIELD(model.moe, shared_hidden, non_negative(), "the always-on shared expert's width; 0 = none"),
    KILN_FIELD(model.moe, latent_width, non_negative().up_to(kMaxWidth, "a latent wider than any model width"),
               "LatentMoE: the routed experts' latent width (x projected down, their sum up); 0 = off"),
    KILN_FIELD(model.moe, router, none(), "registry: routers"),
    KILN_FIELD(model.moe, norm_topk_prob, none(), "renormalize the routing weights over the chosen experts"),
    KILN_FIELD(model.moe, routed_scaling, positive(), "routing weights x this"),
    KILN_FIELD(model.moe, aux_loss, non_negative(), "load-balancing loss coefficient (E sum f_i P_i)"),
    KILN_FIELD(model.moe, z_loss, non_negative(), "router z-loss coefficient"),
    KILN_FIELD(model.moe, balance_scope, one_of("micro_batch|step"),
               "the balance loss's f_i, P_i over: micro_batch | step (all micro-batches and ranks)"),
    KILN_FIELD(model.moe, bias_rate, non_negative(), "sigmoid_bias: bias update step"),
    KILN_FIELD(model.moe, bias_update, one_of("sign|proportional"), "sigmoid_bias: sign | proportional"),
    KILN_FIELD(model.moe, groups, positive(), "group-limited routing: expert groups"),
    KILN_FIELD(model.moe, top_groups, positive(), "group-limited routing: groups a token may use"),
    KILN_FIELD(model.moe, capacity_factor,
               non_negative().up_to(kMaxExperts, "from E / k on nothing is dropped, and E <= 4096"),
               "per-expert capacity x T k / E; 0 = dropless (expert_choice: 1)"),
    KILN_FIELD(model.moe, sinkhorn_iterations,
               positive().up_to(kMaxSinkhornIterations, "each is a pass over the routing matrix in every step"),
               "sinkhorn: balancing iterations per micro-batch"),
    KILN_FIELD(model.moe, l1_coef, positive(), "relu: the L1 penalty's initial coefficient"),
    KILN_FIELD(model.moe, l1_rate, positive(), "relu: the coefficient's adaptation factor per step (> 1)"),
    KILN_FIELD(model.moe, save_outputs, none(),
               "keep the experts' output rows for the routing weights' gradient; false: form it from their "
               "activations (less memory)"),

    KILN_FIELD(model.mtp, depth, non_negative().up_to(kMaxMtpDepth, "each depth takes three loss slots"),
               "multi-token prediction: tokens predicted beyond the next; 0 = off"),
    KILN_FIELD(model.mtp, form, one_of("sequential|parallel"),
               "sequential (DeepSeek-V3's modules) | parallel (extra heads on the final hidden state)"),
    KILN_FIELD(model.mtp, weights, none(),
               "each depth's loss weight, comma-separated; \"\" = sequential 0.1/depth, parallel the average"),

    KILN_FIELD(model.kda, heads, non_negative(), "kda mixer: heads; 0 = model.heads"),
    KILN_FIELD(model.kda, head_dim, non_negative(), "kda mixer: d_k = d_v per head; 0 = model.head_dim"),
    KILN_FIELD(model.kda, conv_kernel, positive().up_to(64, "a short convolution; its decode state keeps kernel - 1 rows"),
               "kda mixer: the causal depthwise convolution's width over q, k, v"),
    KILN_FIELD(model.kda, gate_rank, non_negative(), "kda mixer: the low-rank decay and output gates' width; 0 = head_dim"),
    KILN_FIELD(model.kda, gpu_kernel, one_of("auto|recurrent|chunked|chunked_bf16"),
               "kda mixer: the delta rule's CUDA kernels: auto (chunked_bf16 where head_dim <= 128, else "
               "recurrent) | recurrent (token by token) | chunked (64-token chunks, head_dim <= 128) | chunked_bf16 "
               "(chunked, its backward's chunk gradients on bf16 tensor cores)"),
    KILN_FIELD(model.kda, conv_gpu_kernel, one_of("sweep|per_element"),
               "kda mixer: the short convolution's CUDA kernels: sweep (a thread per channel and tile of tokens) | "
               "per_element"),

    KILN_FIELD(model.mla, kv_rank, non_negative(), "mla mixer: the cached latent's width; 0 = model.hidden / 4"),
    KILN_FIELD(model.mla, qk_head_dim, non_negative(), "mla mixer: query/key width per head; 0 = model.head_dim"),
    KILN_FIELD(model.mla, v_head_dim, non_negative(), "mla mixer: value width per head; 0 = model.head_dim"),

    KILN_FIELD(data, path, non_empty().as(ConfigRule::kPath),
               "training data: a file, directory or glob (text, JSONL, .zst/.gz, Parquet, .arrow/HF save_to_disk, shards, .bin)"),
    KILN_FIELD(data, tokenizer, non_empty().as(ConfigRule::kTokenizer),
               "\"byte\", or a Hugging Face tokenizer.json path (byte-level BPE)"),
    KILN_FIELD(data, format, one_of("auto|text|jsonl|parquet|arrow|shards|llmc|raw_u16|raw_u32"),
               "auto | text | jsonl | parquet | arrow | shards | llmc | raw_u16 | raw_u32"),
    KILN_FIELD(data, text_key, non_empty(), "JSONL field / Parquet or Arrow string column holding the document"),
    KILN_FIELD(data, doc_separator, none(), "text files: separator between documents"),
    KILN_FIELD(data, val_fraction, unit_open(), "share of documents held out, by hash"),
    KILN_FIELD(data, long_doc, one_of("split|drop|error"), "documents over max_seq_len: split | drop | error"),
    KILN_FIELD(data, long_doc_offset, one_of("per_epoch|zero"),
               "split documents cut at a fresh random offset each epoch after the first | at multiples of max_seq_len"),
    KILN_FIELD(data, seed, none(), "document order shuffling"),
    KILN_FIELD(data, val_path, none().as(ConfigRule::kPath), "validation data; \"\" = split data.path by hash"),
    KILN_FIELD(data, lenient, none(), "skip and count bad input instead of stopping"),
    KILN_FIELD(data, eot_id, none(), "llm.c/raw token files: document delimiter id; -1 = tokenizer BOS"),
    KILN_FIELD(data, prefetch, non_negative().up_to(kMaxHeldBatches, "each is a micro-batch held in memory"),
               "micro-batches packed ahead by a background thread; 0 = off"),
    KILN_FIELD(data, rank, non_negative(), "data-parallel rank, used when world_size > 0"),
    KILN_FIELD(data, world_size, non_negative(), "data-parallel ranks; 0 = env RANK/WORLD_SIZE, else 1"),

    KILN_FIELD(train, steps, positive(), "optimizer steps"),
    KILN_FIELD(train, tokens, non_negative(), "token budget: steps = ceil(tokens / tokens per step); 0 = train.steps"),
    KILN_FIELD(train, micro_batch_tokens, positive().up_to(kMaxPositions, "positions and offsets are 32-bit"),
               "token budget per micro-batch"),
    KILN_FIELD(train, grad_accum, positive().up_to(kMaxHeldBatches, "each is a micro-batch held in memory"),
               "micro-batches per optimizer step"),
    KILN_FIELD(train, seed, none(), "weight init and sampling"),
    KILN_FIELD(train, init_from, none().as(ConfigRule::kPath),
               "continued pretraining: start from a kiln model, checkpoint or HF folder; empty = random init"),
    KILN_FIELD(train, device, one_of("auto|cpu|cuda"), "auto | cpu | cuda"),
    KILN_FIELD(train, precision, one_of("auto|fp32|bf16|fp16|fp8_tensorwise|fp8_blockwise"),
               "auto (bf16 on the GPU, fp32 on the CPU) | fp32 | bf16 | fp8_tensorwise (dense GEMMs in per-tensor "
               "FP8) | fp8_blockwise (dense GEMMs in DeepSeek-V3's blockwise FP8); fp16 is not built yet"),
    KILN_FIELD(train, fp8_blockwise_kernels, one_of("scalar|vector"),
               "fp8_blockwise on the GPU: vector quantize kernels (16-byte loads, one read for a tile's row and "
               "column tiles) or scalar ones (one element a thread); the same bits"),
    KILN_FIELD(train, fp8_layers, none(),
               "FP8 precisions: the layer set whose dense projections are FP8 (e.g. '1-26' keeps the first and "
               "last of 28 blocks in bf16); all = every block"),
    KILN_FIELD(train, fp8_keep_inputs, none(),
               "FP8: each dense projection keeps its input's FP8 codes for backward (1 byte an element); false "
               "quantizes the input again"),
    KILN_FIELD(train, fp8_experts, none(),
               "fp8_tensorwise: the routed experts' grouped GEMMs in FP8 too (a scale per expert weight); "
               "false keeps them bf16"),
    KILN_FIELD(train, recompute_blocks, non_negative(), "blocks (the first N) whose activations are recomputed in backward"),
    KILN_FIELD(train, deterministic, none(), "bitwise-reproducible kernels; false allows cuDNN's faster atomic attention backward"),
    KILN_FIELD(train, cuda_graphs, none(), "GPU: the step as CUDA graphs with its scalars on the device; false: op by op"),
    KILN_FIELD(train, threads, non_negative().up_to(kMaxThreads, "OpenMP starts each one"),
               "CPU threads; 0 = all cores"),
    KILN_FIELD(train, out_dir, none().as(ConfigRule::kPath), "run directory"),
    KILN_FIELD(train, z_loss, non_negative(), "coefficient of mean(logsumexp^2)"),
    KILN_FIELD(train, loss_chunk_tokens, positive().up_to(kMaxPositions, "rows are 32-bit"),
               "LM head rows per chunk"),
    KILN_FIELD(train, eval_every, non_negative(), "steps between validation; 0 = only at the end"),
    KILN_FIELD(train, eval_every_tokens, non_negative(), "tokens between validation, instead of eval_every; 0 = off"),
    KILN_FIELD(train, eval_batches, non_negative().up_to(kMaxHeldBatches, "each is a micro-batch held in memory"),
               "held-out micro-batches per validation"),
    KILN_FIELD(train, sample_every, non_negative(), "steps between samples; 0 = only at the end"),
    KILN_FIELD(train, sample_every_tokens, non_negative(), "tokens between samples, instead of sample_every; 0 = off"),
    KILN_FIELD(train, sample_tokens, non_negative().up_to(kMaxPositions, "positions are 32-bit"),
               "tokens generated per sample; with the prompt, at most model.max_seq_len"),
    KILN_FIELD(train, sample_temperature, non_negative(), "sampling temperature"),
    KILN_FIELD(train, sample_top_k, non_negative(), "top-k sampling; 0 = off"),
    KILN_FIELD(train, sample_prompt, none(), "prompt for samples"),
    KILN_FIELD(train, max_consecutive_skips, non_negative(), "stop after this many skipped updates in a row; 0 = never"),
    KILN_FIELD(train, spike_window, non_negative().up_to(kMaxSpikeWindow, "reserved and saved with checkpoints"),
               "spike guard window in applied steps; 0 = off"),
    KILN_FIELD(train, spike_loss_ratio, positive(), "spike guard: skip when loss > ratio x window mean"),
    KILN_FIELD(train, spike_grad_ratio, positive(), "spike guard: skip when grad norm > ratio x window mean"),
    KILN_FIELD(train, loss_scale, one_of("none|dynamic"), "dynamic loss scaling (fp16's): none | dynamic"),
    KILN_FIELD(train, loss_scale_init, positive(), "dynamic loss scaling: the first scale, a power of two >= 1"),
    KILN_FIELD(train, loss_scale_growth_interval, positive(),
               "dynamic loss scaling: applied steps without overflow before the scale doubles"),

    KILN_FIELD(optim, name, none(), "registry: optimizers"),
    KILN_FIELD(optim, lr, positive(), "peak learning rate"),
    KILN_FIELD(optim, min_lr_ratio, unit_closed(), "schedule decays to lr * min_lr_ratio"),
    KILN_FIELD(optim, warmup_steps, non_negative(), "linear warmup steps"),
    KILN_FIELD(optim, warmup_tokens, non_negative(), "> 0: the warmup in tokens, rounded up to steps (not warmup_steps)"),
    KILN_FIELD(optim, schedule, none(), "registry: schedules"),
    KILN_FIELD(optim, decay_steps, non_negative(), "wsd: steps of the decay tail; 0 = decay_fraction of train.steps"),
    KILN_FIELD(optim, decay_tokens, non_negative(), "wsd: > 0: the tail in tokens, rounded up to steps (not decay_steps)"),
    KILN_FIELD(optim, decay_fraction, unit_closed(), "wsd: the decay tail's share of train.steps"),
    KILN_FIELD(optim, decay_shape, one_of("linear|cosine|1-sqrt"), "wsd's decay tail: linear | cosine | 1-sqrt"),
    KILN_FIELD(optim, beta1, unit_open(), "first-moment decay"),
    KILN_FIELD(optim, beta2, unit_open(), "second-moment decay"),
    KILN_FIELD(optim, eps, positive(), "denominator epsilon"),
    KILN_FIELD(optim, weight_decay, non_negative(), "decoupled weight decay"),
    KILN_FIELD(optim, grad_clip, non_negative(), "global L2 norm; 0 disables"),
    KILN_FIELD(optim, adamw_state, one_of("fp32|bf16|int8"),
               "AdamW moments stored as fp32 | bf16 | int8 (blockwise 8-bit); fixed on resume"),
    KILN_FIELD(optim, master_weights, one_of("fp32|bf16"),
               "2-D weights' masters: fp32 (+ bf16 copy) | bf16 (stochastic rounding; GPU bf16 only); fixed on resume"),
    KILN_ROLE_FIELDS(embedding, "the token embedding (and a tied head)"),
    KILN_ROLE_FIELDS(head, "an untied LM head"),
    KILN_ROLE_FIELDS(matrix, "attention and MLP projections"),
    KILN_ROLE_FIELDS(expert, "routed experts' matrices"),
    KILN_ROLE_FIELDS(router, "MoE routers"),
    KILN_ROLE_FIELDS(norm, "norm gains"),
    KILN_ROLE_FIELDS(bias, "biases"),
    KILN_FIELD(optim.muon, momentum, unit_open(), "momentum decay mu"),
    KILN_FIELD(optim.muon, nesterov, none(), "Nesterov: orthogonalize g + mu m instead of m"),
    KILN_FIELD(optim.muon, ema, none(), "m = mu m + (1 - mu) g instead of m = mu m + g"),
    KILN_FIELD(optim.muon, ns_steps, positive().up_to(100, "each step costs 3 GEMMs per matrix"),
               "Newton-Schulz iterations"),
    KILN_FIELD(optim.muon, scale, one_of("moonlight|shape"),
               "update RMS: moonlight 0.2 sqrt(max(rows, cols)) | shape sqrt(max(1, rows / cols))"),
    KILN_FIELD(optim.qk_clip, enabled, none(), "measure each head's largest attention logit and clip its q/k weights"),
    KILN_FIELD(optim.qk_clip, tau, positive(), "the largest logit a head keeps (Kimi K2: 100)"),

    KILN_FIELD(log, every, non_negative(), "console/metrics line every N steps (0 only with every_tokens)"),
    KILN_FIELD(log, every_tokens, non_negative(), "a line every N tokens, instead of every; 0 = off"),
    KILN_FIELD(log, metrics_file, none(), "metrics file inside out_dir"),
    KILN_FIELD(log, plot, none(), "draw the run's curves into <out_dir>/plot.png at the end (kiln plot)"),
    KILN_FIELD(log, tensorboard, none(), "TensorBoard event files of every metrics record"),
    KILN_FIELD(log, tensorboard_dir, non_empty(), "TensorBoard directory inside out_dir"),

    KILN_FIELD(checkpoint, save_final, none(), "write <out_dir>/model at the end"),
    KILN_FIELD(checkpoint, every, non_negative(), "steps between resumable checkpoints (and at the end); 0 = off"),
    KILN_FIELD(checkpoint, every_tokens, non_negative(), "tokens between checkpoints, instead of every; 0 = off"),
    KILN_FIELD(checkpoint, export_hf_every, non_negative(), "steps between Hugging Face exports into <out_dir>/hf/step-N; 0 = off"),
    KILN_FIELD(checkpoint, export_hf_every_tokens, non_negative(), "tokens between exports, instead of export_hf_every; 0 = off"),
    KILN_FIELD(checkpoint, dir, none().as(ConfigRule::kPath), "checkpoint directory; \"\" = <train.out_dir>/checkpoints"),
    KILN_FIELD(checkpoint, keep_last, non_negative(), "newest checkpoints kept; 0 = keep all"),
    KILN_FIELD(checkpoint, keep_every, non_negative(), "also keep steps that are multiples of this; 0 = none"),
    KILN_FIELD(checkpoint, keep_best, none(), "also keep the best validation loss's checkpoint (DIR/best names it)"),
    KILN_FIELD(checkpoint, on_save_error, one_of("stop|continue"), "a failed save or metrics write: stop | continue"),

    KILN_FIELD(eval, tasks, none().as(ConfigRule::kPathList), "multiple-choice task files (JSONL), comma-separated; \"\" = none"),
    KILN_FIELD(eval, texts, none().as(ConfigRule::kPathList), "text or JSONL files whose perplexity is measured, comma-separated"),
    KILN_FIELD(eval, every, non_negative(), "steps between evaluations; 0 = only at the end"),
    KILN_FIELD(eval, every_tokens, non_negative(), "tokens between evaluations, instead of every; 0 = off"),
    KILN_FIELD(eval, limit, non_negative(), "examples per task (the first ones); 0 = all"),
    KILN_FIELD(eval, slots, positive().up_to(4096, "sequences scored at once"), "sequences scored at once"),
    KILN_FIELD(eval, bos, none(), "BOS before each context, as training documents start"),

    KILN_FIELD(dist, pipeline_stages, positive().up_to(kMaxLayers, "a stage needs a layer"),
               "pipeline stages, one per rank (CPU); 1 = off"),
    KILN_FIELD(dist, pipeline_schedule, one_of("gpipe|1f1b|interleaved|zb_h1"),
               "pipeline schedule: gpipe | 1f1b | interleaved | zb_h1"),
    KILN_FIELD(dist, pipeline_virtual_stages, positive().up_to(kMaxLayers, "a stage needs a layer"),
               "stages per rank of the interleaved schedule (v)"),
    KILN_FIELD(dist, pipeline_split, none(), "first layer of each stage, \"0,3,6\"; \"\" = planned from costs"),
    KILN_FIELD(dist, pipeline_costs, one_of("estimate|measure"),
               "per-layer times the split is planned from: estimate (FLOPs) | measure (timed at startup)"),
    KILN_FIELD(dist, pipeline_activations, one_of("frames|recompute"),
               "a stage's forward state until its backward: frames (saved, one per micro-batch in flight) | "
               "recompute (its input only, the forward run again)"),
    KILN_FIELD(dist, pipeline_split_backward, none(),
               "zb_h1: weight gradients of the dense projections in the W pass (true) or all in B (false)"),
    KILN_FIELD(dist, pipeline_model, one_of("whole|stages"),
               "what each pipeline rank builds: whole (every parameter) | stages (only its stages' layers)"),
    KILN_FIELD(dist, timeout, positive().up_to(kMaxTimeoutSeconds, "a week; a collective waiting longer is hung"),
               "seconds a collective waits for the other ranks before failing"),
    KILN_FIELD(dist, bucket_mb, non_negative().up_to(65536, "64 GiB; more than any model's gradients"),
               "MiB of gradients per bucket reduced during backward; 0 = one reduction after backward"),
    KILN_FIELD(dist, zero, non_negative().up_to(2, "stage 3 (sharded parameters) is not built yet"),
               "ZeRO stage: 0 = whole optimizer state on every rank, 1 = each rank updates its shard, "
               "2 = and receives only its shard's summed gradients (CPU only)"),
};

#undef KILN_ROLE_FIELDS
#undef KILN_FIELD

constexpr std::array<std::string_view, 22> kSections = {
    "model",        "model.rope",   "model.moe",    "model.mtp",    "model.kda",    "model.mla",    "data",        "train",
    "optim",        "optim.embedding", "optim.head", "optim.matrix", "optim.expert", "optim.router", "optim.norm",
    "optim.bias",   "optim.muon",   "optim.qk_clip", "log",         "checkpoint",  "eval",
    "dist"};

}  // namespace

std::string ConfigField::name() const {
  std::string s(section);
  s += '.';
  s += key;
  return s;
}

std::span<const ConfigField> config_fields() { return kFields; }

std::span<const std::string_view> config_sections() { return kSections; }

const ConfigField* find_config_field(std::string_view section, std::string_view key) {
  for (const ConfigField& f : kFields)
    if (f.section == section && f.key == key) return &f;
  return nullptr;
}

bool config_equal(const Config& a, const Config& b) {
  for (const ConfigField& f : kFields) {
    const bool same = std::visit(
        [&](auto* pa) { return *pa == *std::get<decltype(pa)>(f.get(b)); }, f.get(a));
    if (!same) return false;
  }
  return a.data.sources == b.data.sources;  // not a field: an array of tables
}

}  // namespace kiln
