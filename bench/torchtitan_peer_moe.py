#!/usr/bin/env python3
"""A torchtitan peer of `kiln bench` for MoE shapes: torchtitan 0.3.0's own Qwen3-MoE model
(torchtitan.models.qwen3: Qwen3Model, Qwen3TransformerBlock, common.moe.MoE with its
TokenChoiceTopKRouter, LocalTokenDispatcher and GroupedExperts on torch._grouped_mm, fused
QKV GQA with q/k RMSNorm, cos/sin RoPE, flex attention) built at a kiln config's shape and
timed like bench/torch_peer.py: bf16 autocast over fp32 master weights (torch_peer.py's
choice), fused AdamW, grad-norm clip 1.0, random token ids, one JSON line with the same
fields (peer, tokens_per_second, ms_per_step, peak_gib, loss, warmup_steps, warmup_seconds,
dynamo_graphs) plus the torchtitan mapping and the differences from kiln's model.

What is torchtitan's and what is the peer's: the model, its initialisation (init_states),
the attention masks (get_attention_masks from per-row positions), the summed cross entropy
divided by the token count (components.loss.CrossEntropyLoss), the aux-loss-free expert
bias update before each optimizer step (components.optimizer.register_moe_load_balancing_hook)
and --compile (distributed.compile.apply_compile: each block compiled with fullgraph, as
torchtitan's trainer does) are torchtitan's. The loop, AdamW, the clip and autocast are the
peer's: torchtitan's trainer (FSDP2 mixed precision, its data loader, checkpointing, metrics)
is not run. --cuda-graph wraps forward + backward in torchtitan's own CUDA-graph capture
(distributed.cudagraph.wrap_with_cuda_graph, on by default in torchtitan's trainer).

torch 2.11 and torchtitan 0.3.0 (which is written against a newer torch): three mismatches,
each checked before anything runs (MISMATCHES):
- torchtitan.models.qwen3 imports its parallelize module, whose torchtitan.distributed.fsdp
  imports torch.distributed.fsdp.DataParallelMeshDims, absent from torch 2.11 (used only to
  shard with FSDP2, which this single-GPU peer never calls);
- flex attention (torchtitan's language-model default): decoder.py passes
  create_block_mask(separate_full_blocks=...), a keyword torch 2.11 lacks (its create_block_mask
  always separates the full blocks, the value torchtitan passes);
- varlen attention: VarlenAttention passes varlen_attn(num_splits=, enable_gqa=), which torch
  2.11's varlen_attn lacks; no stand-in, --attention varlen stops.
Without --shim-missing the script stops with one line naming them. With it, the first two get
stand-ins (DataParallelMeshDims a class that raises if ever constructed; the mask keyword
dropped when True, refused when False) and the JSON's peer field lists them. No other model
is ever substituted. --attention sdpa takes torchtitan's own ScaledDotProductAttention module
(causal SDPA, cuDNN then flash then math: bench/torch_peer.py's kind of attention) in place of
flex: it needs only the first stand-in.

Offline use (the GPU machine has torch, transformers, numpy and triton, nothing else): the
wheels are extracted to a temporary folder (torchtitan has namespace subpackages that a
zipped wheel cannot import) and put on sys.path, torchtitan first, its dependencies after the
venv's own packages (the venv's copy wins). Fetch them with
    pip download torchtitan==0.3.0 --no-deps -d .whl/torchtitan
    pip download tyro docstring-parser typeguard spmd_types==0.2.3 --no-deps \
        --only-binary=:all: -d .whl/torchtitan-deps
TORCHTITAN_WHEELS (folders separated by os.pathsep) overrides the two default folders.

GPU (repo root as cwd, .whl carried; the flex arm's first steps include its max-autotune):
    for a in sdpa flex; do for c in "" --compile; do
      /opt/torch/.venv/bin/python bench/torchtitan_peer_moe.py --config configs/bench-moe-1b.toml \
          --shim-missing --attention $a $c --steps 10 --warmup 3; done; done
(--cuda-graph adds torchtitan's graph capture to any of them; not run here: CUDA only.)
CPU smoke run (tiny shape; flex has no backward on the CPU, so --attention sdpa there):
    python bench/torchtitan_peer_moe.py --config configs/bench-moe-1b.toml --device cpu \
        --shim-missing --attention sdpa --steps 2 --warmup 1 --set model.layers=2 \
        --set model.hidden=64 --set model.heads=4 --set model.kv_heads=2 --set model.head_dim=16 \
        --set model.vocab_size=512 --set model.max_seq_len=64 --set train.micro_batch_tokens=128 \
        --set model.moe.experts=8 --set model.moe.top_k=2 --set model.moe.expert_hidden=32
On the CPU torch._grouped_mm runs torch's own fallback, and the router's fp32 autocast is off
(CPU autocast has no fp32), so the router runs in bf16 there; both are CUDA-only differences.
"""
import argparse
import glob
import json
import os
import sys
import tempfile
import time
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WHEELS = os.pathsep.join([os.path.join(REPO, ".whl", "torchtitan"), os.path.join(REPO, ".whl", "torchtitan-deps")])
TORCHTITAN_VERSION = "0.3.0"


def die(msg):
    print(f"torchtitan_peer_moe: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def put_wheels_on_path():
    """Extracts the carried wheels once per run; torchtitan's goes first on sys.path, its
    dependencies last (after the venv). Returns where torchtitan came from."""
    import importlib.util
    if importlib.util.find_spec("torchtitan") is not None:
        return "venv"
    folders = os.environ.get("TORCHTITAN_WHEELS", DEFAULT_WHEELS)
    wheels = [w for f in folders.split(os.pathsep) if f for w in sorted(glob.glob(os.path.join(f, "*.whl")))]
    own = [w for w in wheels if os.path.basename(w).startswith("torchtitan-")]
    if len(own) != 1:
        die(f"torchtitan is not installed and TORCHTITAN_WHEELS={folders} holds {len(own)} torchtitan wheels (want 1)")
    root = tempfile.mkdtemp(prefix="torchtitan_wheels_")
    for w in wheels:
        d = os.path.join(root, os.path.basename(w)[:-4])
        with zipfile.ZipFile(w) as z:
            z.extractall(d)
        if w in own:
            sys.path.insert(0, d)
        else:
            sys.path.append(d)
    return os.path.basename(own[0])


# What torchtitan 0.3.0 asks of torch that torch 2.11 lacks: (name, check, why, stand-in).
# Found by running this peer on torch 2.11.0; each check is made before anything runs.
def _lacks_fsdp_mesh_dims():
    import torch.distributed.fsdp as fsdp
    return not hasattr(fsdp, "DataParallelMeshDims")


def _shim_fsdp_mesh_dims():
    import torch.distributed.fsdp as fsdp

    def refuse(*args, **kwargs):
        raise RuntimeError("torchtitan_peer_moe: torch.distributed.fsdp.DataParallelMeshDims is a stand-in "
                           "(torch lacks it); the single-GPU peer must not reach FSDP")

    fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {"__init__": refuse})


def _lacks_separate_full_blocks():
    import inspect
    from torch.nn.attention.flex_attention import create_block_mask
    return "separate_full_blocks" not in inspect.signature(create_block_mask).parameters


def _shim_separate_full_blocks():
    """torch 2.11's create_block_mask always separates the full blocks (it calls
    _convert_mask_to_block_mask with separate_full_blocks=True), which is what torchtitan asks
    outside batch-invariant mode: the keyword is dropped when True and refused when False."""
    from torchtitan.models.common import attention, decoder

    def create_attention_mask(*args, separate_full_blocks=True, **kwargs):
        if not separate_full_blocks:
            raise RuntimeError("torchtitan_peer_moe: create_block_mask(separate_full_blocks=False) needs a newer torch")
        return attention._compiled_create_block_mask(*args, **kwargs)

    decoder.create_attention_mask = create_attention_mask


def _lacks_varlen_kwargs():
    import inspect
    from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    return not all(k in params for k in ("num_splits", "enable_gqa"))


MISMATCHES = [
    dict(name="torch.distributed.fsdp.DataParallelMeshDims", lacks=_lacks_fsdp_mesh_dims, shim=_shim_fsdp_mesh_dims,
         attention=None, when="import",
         why="torch.distributed.fsdp has no DataParallelMeshDims, imported at load by torchtitan/distributed/fsdp.py "
             "(torchtitan.models.qwen3 -> qwen3.parallelize) for FSDP2 sharding, which the single-GPU peer never calls"),
    dict(name="create_block_mask(separate_full_blocks=)", lacks=_lacks_separate_full_blocks,
         shim=_shim_separate_full_blocks, attention="flex", when="after import",
         why="torch.nn.attention.flex_attention.create_block_mask takes no separate_full_blocks keyword, which "
             "torchtitan/models/common/decoder.py passes for every flex attention mask (torch 2.11 always separates "
             "the full blocks, the value torchtitan passes)"),
    dict(name="varlen_attn(num_splits=, enable_gqa=)", lacks=_lacks_varlen_kwargs, shim=None, attention="varlen",
         when="import",
         why="torch.nn.attention.varlen.varlen_attn takes neither num_splits nor enable_gqa, which "
             "torchtitan/models/common/attention.py's VarlenAttention passes (GQA, FA2/default impl)"),
]


def import_torchtitan(shim, attn):
    """torchtitan's pieces the peer uses, or one line saying what torch lacks; with shim, the
    stand-ins (listed) for the mismatches that have one."""
    import torch
    found = [m for m in MISMATCHES if m["attention"] in (None, attn) and m["lacks"]()]
    head = f"torchtitan {TORCHTITAN_VERSION} cannot run with torch {torch.__version__}"
    for m in found:
        if m["shim"] is None:
            die(f"{head} (attention {attn}): {m['why']}; no stand-in (try --attention flex or sdpa)")
    if found and not shim:
        die(f"{head}: " + "; ".join(m["why"] for m in found) + ". --shim-missing stands in for "
            + ("it" if len(found) == 1 else "them") + " (see the docstring)")
    for m in found:
        if m["when"] == "import":
            m["shim"]()
    try:
        import torchtitan.models.qwen3 as qwen3
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import register_moe_load_balancing_hook
        from torchtitan.config import CompileConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.compile import apply_compile
        from torchtitan.distributed.cudagraph import wrap_with_cuda_graph
        from torchtitan.models.common import CosSinRoPE, Embedding, Linear
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.common.config_utils import make_ffn_config
    except ImportError as e:
        die(f"{head}: {e} (module {e.name or '?'})")
    for m in found:
        if m["when"] == "after import":
            m["shim"]()
    return dict(qwen3=qwen3, CrossEntropyLoss=CrossEntropyLoss, hook=register_moe_load_balancing_hook,
                CompileConfig=CompileConfig, ParallelDims=ParallelDims, apply_compile=apply_compile,
                wrap_with_cuda_graph=wrap_with_cuda_graph, CosSinRoPE=CosSinRoPE, Embedding=Embedding,
                Linear=Linear, ScaledDotProductAttention=ScaledDotProductAttention,
                make_ffn_config=make_ffn_config), [m["name"] for m in found]


def build_config(tt, c, attn):
    """kiln's config c -> torchtitan's Qwen3Model.Config (its Qwen3-MoE layer builder, as its
    30B-A3B / debugmodel_moe flavors, tied like its 0.6B); the mapping and what differs."""
    q, m = tt["qwen3"], c["moe"]
    if c["mlp"] != "moe" or c["alt_mlp"]:
        die(f"model.mlp={c['mlp']!r} alt_mlp={c['alt_mlp']!r}: the peer builds torchtitan's all-MoE Qwen3 only")
    if m["groups"] != 1:
        die(f"model.moe.groups={m['groups']}: torchtitan's node-limited routing needs num_limited_groups, not modelled")
    if not c["qk_norm"]:
        die("model.qk_norm=false: torchtitan's Qwen3 always has q/k RMSNorm")
    if m["router"] not in ("softmax_topk", "sigmoid_bias"):
        die(f"model.moe.router={m['router']!r}: torchtitan's router has softmax and sigmoid scores only")
    d, hd, layers, vocab = c["hidden"], c["head_dim"], c["layers"], c["vocab_size"]
    layer_cfgs = q._build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=layers, dim=d, n_heads=c["heads"], n_kv_heads=c["kv_heads"], head_dim=hd,
        moe_hidden_dim=m["expert_hidden"], num_experts=m["experts"], top_k=m["top_k"],
        attn_backend="flex" if attn == "sdpa" else attn,
        moe_comm_backend="standard",
        rope=tt["CosSinRoPE"].Config(dim=hd, max_seq_len=c["max_seq_len"], theta=c["rope_theta"]))
    for layer in layer_cfgs:
        if attn == "sdpa":  # torchtitan's ScaledDotProductAttention module (causal; its builder refuses "sdpa")
            layer.attention.inner_attention = tt["ScaledDotProductAttention"].Config()
        router = layer.moe.router
        router.score_func = "softmax" if m["router"] == "softmax_topk" else "sigmoid"
        router.route_norm = m["norm_topk_prob"]
        router.route_scale = m["routed_scaling"]
        if m["shared_hidden"] > 0:
            layer.moe.shared_experts = tt["make_ffn_config"](
                dim=d, hidden_dim=m["shared_hidden"], w1_param_init=q._LINEAR_INIT, w2w3_param_init=q._LINEAR_INIT)
    tied = c["tie_embeddings"]
    cfg = q.Qwen3Model.Config(
        vocab_size=vocab, dim=d, norm=q._qwen3_norm(d), enable_weight_tying=tied,
        tok_embeddings=tt["Embedding"].Config(num_embeddings=vocab, embedding_dim=d,
                                              param_init=q._EMBEDDING_SKIP_INIT if tied else q._EMBEDDING_INIT),
        lm_head=tt["Linear"].Config(in_features=d, out_features=vocab, param_init=q._LINEAR_INIT),
        layers=layer_cfgs)
    r = layer_cfgs[0].moe.router
    mapping = dict(dim=d, n_layers=layers, n_heads=c["heads"], n_kv_heads=c["kv_heads"], head_dim=hd,
                   vocab_size=vocab, enable_weight_tying=tied, num_experts=m["experts"], top_k=m["top_k"],
                   moe_hidden_dim=m["expert_hidden"], shared_experts_hidden=m["shared_hidden"] or None,
                   score_func=r.score_func, route_norm=r.route_norm, route_scale=r.route_scale,
                   load_balance_coeff=layer_cfgs[0].moe.load_balance_coeff, rope_theta=c["rope_theta"],
                   norm_eps=q._EPS, attention=attn)
    differences = []
    if m["aux_loss"] > 0:
        differences.append(f"model.moe.aux_loss={m['aux_loss']} (Switch balance loss): torchtitan 0.3.0 has no "
                           "balance loss; its Qwen3-MoE balances with the aux-loss-free expert bias "
                           f"(load_balance_coeff {mapping['load_balance_coeff']}, updated before each optimizer step), "
                           "added to the softmax scores for the top-k choice only")
    elif m["router"] == "softmax_topk":
        differences.append("softmax_topk: torchtitan adds its aux-loss-free expert bias (load_balance_coeff "
                           f"{mapping['load_balance_coeff']}) to the scores for the top-k choice; kiln has none")
    if c["norm_eps"] != q._EPS:
        differences.append(f"model.norm_eps={c['norm_eps']}: torchtitan's Qwen3 norms use {q._EPS}")
    if attn == "sdpa":
        differences.append("attention: torchtitan's ScaledDotProductAttention module (is_causal, cuDNN then flash "
                           "then math), not its language-model default flex; bench/torch_peer.py uses SDPA too")
    else:
        differences.append(f"attention: torchtitan's {attn} attention (block-causal mask from per-row positions, "
                           "one document a row = causal); bench/torch_peer.py uses SDPA")
    differences.append("experts: w1/w3 [E, F, D] as two grouped matmuls (kiln and torch_peer.py: one gate_up); "
                       "routed outputs weighted in bf16 then scatter-added (deterministic_scatter_add)")
    differences.append("mixed precision: bf16 autocast over fp32 weights as bench/torch_peer.py; torchtitan's "
                       "trainer would use FSDP2's MixedPrecisionPolicy (bf16 params, fp32 reduce)")
    return cfg, mapping, differences


def run(c, args):
    import torch
    import torch._dynamo
    tt, shimmed = import_torchtitan(args.shim_missing, args.attention)
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev == "cuda"
    cfg, mapping, differences = build_config(tt, c, args.attention)
    print(f"torchtitan_peer_moe: kiln -> torchtitan {json.dumps(mapping)}", file=sys.stderr, flush=True)
    for d in differences:
        print(f"torchtitan_peer_moe: differs: {d}", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.device(dev):
        model = cfg.build()
    model.init_states(buffer_device=torch.device(dev))
    model.train()
    params = sum(p.numel() for p in model.parameters())
    # One rank, as torchtitan's trainer under torchrun --nproc_per_node 1: ParallelDims builds
    # its (size-1) device mesh from the default process group when the expert bias hook asks.
    if not torch.distributed.is_initialized():
        store = tempfile.NamedTemporaryFile(prefix="torchtitan_peer_store_", delete=False).name
        torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                                             rank=0, world_size=1)
    dims = tt["ParallelDims"](dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    compile_cfg = tt["CompileConfig"](enable=args.compile, components=["model", "loss"] if args.compile else [])
    if args.compile:
        tt["apply_compile"](model, compile_config=compile_cfg, parallel_dims=dims)
    loss_fn = tt["CrossEntropyLoss"].Config().build(compile_config=compile_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
    tt["hook"](opt, [model], dims)  # the expert bias update, before each opt.step()

    seq = min(c["max_seq_len"], c["micro_batch_tokens"])
    batch = c["micro_batch_tokens"] // seq
    ids = torch.randint(0, c["vocab_size"], (batch, seq), device=dev)
    labels = torch.roll(ids, -1, 1)
    positions = torch.arange(seq, device=dev).expand(batch, seq).contiguous()
    ntokens = torch.tensor(labels.numel(), device=dev)

    def fwd_bwd(inputs, step_labels, valid_tokens, extra):
        with torch.autocast(dev, dtype=torch.bfloat16):
            pred = model(inputs, **extra)
            loss, _ = loss_fn(pred, step_labels, valid_tokens)
        loss.backward()
        return loss

    if args.cuda_graph:
        if not cuda:
            die("--cuda-graph needs --device cuda")
        fwd_bwd = tt["wrap_with_cuda_graph"](fwd_bwd)

    def step():
        extra = dict(positions=positions)
        if args.attention != "sdpa":  # as torchtitan's trainer: masks for the flex/varlen backends only
            extra["attention_masks"] = model.get_attention_masks(positions=positions)
        loss = fwd_bwd(ids, labels, ntokens, extra)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=not args.cuda_graph)  # a captured graph keeps its gradient buffers
        return loss

    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warmup_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = batch * seq * args.steps
    mode = ("compile" if args.compile else "eager") + (" cuda_graph" if args.cuda_graph else "") + f" {args.attention}"
    peer = f"torchtitan {TORCHTITAN_VERSION} qwen3-moe torch {torch.__version__} {mode} bf16" + ("" if cuda else " cpu")
    if shimmed:
        peer += " shims:" + ",".join(shimmed)
    bias = [blk.moe.expert_bias_E for blk in model.layers.values() if blk.moe.expert_bias_E is not None]
    return dict(peer=peer, tokens_per_second=tokens / seconds, ms_per_step=1e3 * seconds / args.steps,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None, loss=float(loss.item()),
                warmup_steps=args.warmup, warmup_seconds=warmup_seconds,
                dynamo_graphs=counters["stats"]["unique_graphs"], parameters=params,
                expert_bias_abs_max=max((float(b.abs().max()) for b in bias), default=0.0),
                torchtitan=mapping, differences=differences)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torchtitan's per-block torch.compile (and compiled loss)")
    p.add_argument("--cuda-graph", action="store_true", help="torchtitan's CUDA-graph capture of forward + backward")
    p.add_argument("--attention", default="flex", choices=["flex", "sdpa", "varlen"],
                   help="torchtitan's inner attention: flex (its LM default), sdpa (its SDPA module), varlen")
    p.add_argument("--device", choices=["cuda", "cpu"])
    p.add_argument("--shim-missing", action="store_true",
                   help="stand in for the torch symbols torchtitan 0.3.0 imports but torch 2.11 lacks")
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch_peer import load_config
    c = load_config(a.config, a.set, extra=dict(model=dict(tie_embeddings=True, qk_norm=True)))
    print(f"torchtitan_peer_moe: torchtitan from {put_wheels_on_path()}", file=sys.stderr, flush=True)
    print(json.dumps(dict(model=c, **run(c, a))), flush=True)


if __name__ == "__main__":
    main()
