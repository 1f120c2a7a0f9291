"""The decode part of the tensor-parallel benchmark (`benchmarks.tensor_parallel`): one
model's steps at TP=1 and at each TP degree asked for, per all-reduce kind and per lever,
each beside its hand-written floor, the per-GPU weight-read floor and a profile of one step.

TP degrees below the world size run in groups of consecutive ranks at once (TP=2 on four
GPUs: ranks 0-1 and 2-3, each pair its own model), so one torchrun measures TP=1, 2 and 4;
rank 0's figures are reported. Levers:
- "plain": graphify FULL graphs of the step as written;
- "pieces": graphify FULL graphs of the step's inductor-compiled pieces (`split(...,
  compile=True)`: norms, RoPE, residual adds and the SiLU product fused into few kernels;
  the all-reduces and attention stay whole), the same pieces in the hand-written floor.
A model too large for one GPU (the 70B shape) is drawn sharded on each rank and compared
with its own TP step run eagerly; the others with the single-GPU model.
"""

from __future__ import annotations

import contextlib
import statistics
from typing import Any

import attrs
import torch
import torch.distributed as dist

from graphify import Options, graphify
from graphify.models import (
    BlockTables,
    Decoder,
    DecoderConfig,
    init_params,
    init_shard_params,
    new_paged_cache,
    shard_config,
    shard_paged_cache,
    split_ops,
    tp_varlen_step,
    varlen_axes,
    varlen_step,
)
from graphify.models import attention
from graphify.transforms import split

from ._floor import HandWrittenGraph
from ._ranks import maybe_fail
from ._report import cuda_spans, host_pipelined_us, peak_bandwidth, summarise, time_per_call

__all__ = ["BATCHES", "MODELS", "LEVERS", "Groups", "all_reduce_label", "decode_model", "model_setup", "max_err"]

BATCHES = (1, 8, 64)
BLOCK = 16
MODELS = {  # name -> (config, label, KV length)
    "0.5b": (lambda: DecoderConfig.qwen2_5_0_5b(max_seq_len=1024), "qwen2.5-0.5b-shape", 256),
    "8b": (lambda: DecoderConfig.llama3_8b(max_seq_len=1024), "llama-3-8b-shape", 256),
    "70b": (lambda: DecoderConfig.llama3_70b(max_seq_len=1024), "llama-3-70b-shape", 256),
}
TOO_LARGE_FOR_ONE = {"70b"}  # drawn sharded: no TP=1 and no single-GPU reference
TIMING = {  # time_per_call arguments per model: graphs, eager; host_pipelined_us repetitions
    "0.5b": ({"calls": 10, "reps": 30, "warmup": 5}, {"calls": 4, "reps": 6, "warmup": 2}, 50),
    "8b": ({"calls": 5, "reps": 20, "warmup": 3}, {"calls": 2, "reps": 4, "warmup": 1}, 15),
    "70b": ({"calls": 3, "reps": 12, "warmup": 3}, {"calls": 1, "reps": 3, "warmup": 1}, 8),
    "tiny": ({"calls": 2, "reps": 3, "warmup": 1}, {"calls": 2, "reps": 3, "warmup": 1}, 3),
}
LEVERS = {
    "plain": "graphify FULL graphs of the step as written",
    "pieces": "graphify FULL graphs of the step's inductor-compiled pieces (split(compile=True))",
    "pieces+vocab": "pieces, and a vocab-parallel LM head (each rank its slice of the logits, one all-gather)",
    "pieces+splitkv": "pieces, with split-KV attention (a token's keys over several programs, then joined)",
    "pieces+vocab+splitkv": "pieces+vocab with split-KV attention",
    "pieces+fused+splitkv": "pieces+splitkv, each all-reduce fused with the residual add and the next RMSNorm "
                            "(one launch through symmetric memory: models/_reduce_norm.py)",
}
PROFILE_STEPS = 5


def all_reduce_label(kind: str, used: str, crossover: dict | None) -> str:
    """An all-reduce's label in the rows: the kind asked for, what it fell back to, and a crossover
    other than the default (`benchmarks.tensor_parallel --one-shot-max-bytes/--two-shot-max-bytes`),
    so that runs with another crossover are never aggregated with the default's."""
    label = used if used == kind else f"{kind}→{used}"
    if crossover and used == "symm_mem":
        one, two = crossover["one_shot_max_bytes"], crossover["two_shot_max_bytes"]
        label += f" (one-shot ≤ {'default' if one is None else f'{one >> 10} KiB'}, two-shot ≤ " \
                 f"{'buffer' if two is None else f'{two >> 10} KiB'})"
    return label


def tp1_lever(lever: str) -> str:
    """The lever TP=1 is measured with for a TP lever: a vocab-parallel head and the fused all-reduce
    change nothing at TP=1 (no all-reduce; inductor fuses the add and the norm itself)."""
    return lever.replace("+vocab", "").replace("+fused", "")


@contextlib.contextmanager
def lever_kernels(lever: str):
    """Split-KV attention on while a `+splitkv` lever captures (the choice is made at capture;
    Triton's kernels are not used on the CPU)."""
    kernels = attention._load_triton()
    if kernels is None:
        yield
        return
    old = kernels.SPLIT_KV
    kernels.SPLIT_KV = lever.endswith("+splitkv")
    try:
        yield
    finally:
        kernels.SPLIT_KV = old


def model_setup(name: str, device: torch.device) -> tuple[DecoderConfig, str, int]:
    """(config, label, KV length) of model `name` ("tiny": the smoke test's)."""
    if name == "tiny":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return DecoderConfig.tiny(max_seq_len=128, hidden=128, heads=8, kv_heads=4, ffn=128, dtype=dtype), "tiny", 24
    make, label, kv_len = MODELS[name]
    return make(), label, kv_len


def weight_bytes(cfg: DecoderConfig, vocab_parallel: bool = False) -> int:
    """Bytes of the weights one rank's decode step reads at least once (`cfg.tp` ranks): its
    shards, the replicated norms, and the tied embedding as the LM head, whole or (a
    vocab-parallel head) its rows alone."""
    size = torch.empty((), dtype=cfg.dtype).element_size()
    count = sum(p.numel() for p in Decoder(cfg).to("meta").parameters())
    if vocab_parallel:
        count -= cfg.vocab_size * cfg.hidden - (cfg.vocab_size // cfg.tp) * cfg.hidden
    return count * size


@attrs.frozen
class Groups:
    """The process groups of each TP degree: ranks in consecutive blocks of `tp`."""

    world: int
    made: dict = attrs.field(factory=dict)

    def of(self, tp: int):
        """This rank's group of `tp` ranks (collective the first time: every rank calls it)."""
        if tp == self.world:
            return dist.group.WORLD
        if tp not in self.made:
            if self.world % tp:
                raise ValueError(f"TP={tp} does not divide the {self.world} ranks")
            self.made[tp] = dist.new_subgroups(group_size=tp)[0]
        return self.made[tp]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _is_all_reduce(kernel: str) -> bool:
    name = kernel.lower().replace("_", "")
    return "allreduce" in name


def profile(call) -> dict:
    """One step's GPU activity (torch.profiler over back-to-back calls, which sees kernels
    inside graph replays): kernels, GPU ms (sum of their times), idle µs between them, and
    the all-reduces: how many and the median µs of one; the 15 kernels of most time (name,
    count and µs a step). Empty on the CPU."""
    if not torch.cuda.is_available():
        return {}
    spans = cuda_spans(call, PROFILE_STEPS)
    if not spans:
        return {}
    n = PROFILE_STEPS
    reduces = [end - start for start, end, name in spans if _is_all_reduce(name)]
    count, gpu_ms, idle_us, top = summarise(spans, n, top=15, width=80)
    return {"kernels": count, "gpu_ms": gpu_ms, "idle_us": idle_us, "all_reduces": len(reduces) / n,
            "all_reduce_us": statistics.median(reduces) if reduces else None,
            "all_reduce_ms": sum(reduces) / n / 1e3, "top_kernels": top}


@attrs.frozen
class Model:
    """What every TP degree, kind and lever of one model shares."""

    name: str
    label: str
    cfg: DecoderConfig
    batches: dict  # batch size -> batch (all but the cache)
    example: tuple  # a batch of 2+ requests: what `split` traces
    num_blocks: int
    options: Options
    sizes: tuple
    args: Any
    device: torch.device


def _build(lever: str, step, m: Model, cache: torch.Tensor, group=None):
    """(graphify's captured function, the function the floor captures) for one lever."""
    fn = step
    if lever.startswith("pieces"):
        fn = split(step, split_ops("unified"), *m.example, cache, axes=varlen_axes(), compile=True)
    options = m.options if group is None else attrs.evolve(m.options, group=group)
    g = graphify(fn, mode="FULL", sizes=m.sizes, axes=varlen_axes(), options=options)
    return g.capture(*m.example, cache), fn


def _measure(lever: str, step, m: Model, cache: torch.Tensor, refs: dict, tp_cfg: DecoderConfig, group=None) -> dict:
    """Per batch size: graphify's step, the floor's, the profile, the error against `refs`."""
    graph_timing, _, host_reps = TIMING[m.name]
    cuda = m.device.type == "cuda"
    with lever_kernels(lever):
        g, fn = _build(lever, step, m, cache, group)
        floors = {b: HandWrittenGraph(fn, batch, cache) for b, batch in m.batches.items()} if cuda else {}
    bandwidth = peak_bandwidth(m.device)
    floor_ms = weight_bytes(tp_cfg, "+vocab" in lever) / bandwidth * 1e3 if bandwidth else None
    out = {}
    with torch.inference_mode():
        for b, batch in m.batches.items():
            row = out[b] = {"lever": lever, "weight_floor_ms": floor_ms,
                            "max_err": max_err(g(*batch, cache), refs[b])}
            if group is not None:  # the tests' failures come as TP graphs are about to be timed
                maybe_fail(m.args, dist.get_rank(), "timing")
            row["graphify_ms"] = time_per_call(lambda i: g(*batch, cache), **graph_timing)  # noqa: B023
            if floors:
                floor = floors[b]
                row["hand_max_err"] = max_err(floor(*batch), refs[b])
                row["hand_ms"] = time_per_call(lambda i: floor(*batch), **graph_timing)  # noqa: B023
            row.update(profile(lambda: g(*batch, cache)))  # noqa: B023
            row["graphify_host_us"] = host_pipelined_us(lambda i: g(*batch, cache), reps=host_reps)  # noqa: B023
    g.release()
    if cuda:
        torch.cuda.empty_cache()
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def decode_model(name: str, args, groups: Groups, device: torch.device) -> tuple[list[dict], list[dict]]:
    """(TP rows, TP=1 rows) of model `name`: a row per TP degree > 1, all-reduce kind, lever
    and batch size; TP=1 rows per lever and batch size (none for a model too large for one GPU)."""
    cfg, label, kv_len = model_setup(name, device)
    batch_sizes = tuple(args.batches)
    max_blocks = -(-(kv_len + 1) // BLOCK)
    num_blocks = 1 + max(max(batch_sizes), 2) * max_blocks
    tables = BlockTables(num_blocks, BLOCK, max_blocks)
    batches = {b: tables.batch(cfg, tuple(range(b)), (1,) * b, (kv_len,) * b, device=device, seed=b)
               for b in batch_sizes}
    example = next((batches[b] for b in batch_sizes if b >= 2), None)
    if example is None:  # split traces batch axes on 2+ tokens and requests
        example = tables.batch(cfg, (0, 1), (1, 1), (kv_len, kv_len), device=device, seed=2)
    m = Model(name, label, cfg, batches, example, num_blocks, Options(outputs="view"), tuple(sorted(batch_sizes)),
              args, device)
    whole = name not in TOO_LARGE_FOR_ONE
    tp1_rows, tp1, full, full_cache, single_refs = [], {}, None, None, {}
    if whole:
        full = init_params(cfg, seed=0, device=device)
        full_cache = new_paged_cache(cfg, num_blocks, BLOCK, device=device, seed=1)
        single = varlen_step(cfg, full)
        with torch.inference_mode():
            single_refs = {b: single(*batch, full_cache.clone()) for b, batch in batches.items()}
        for lever in dict.fromkeys(tp1_lever(lever) for lever in args.lever):
            for b, row in _measure(lever, single, m, full_cache, single_refs, cfg).items():
                tp1[lever, b] = row["graphify_ms"]
                tp1_rows.append({"model": label, "batch": b, "tp": 1, **row,
                                 "vs_weight_floor": _ratio(row["graphify_ms"], row["weight_floor_ms"])})
        del single
    rows = []
    for tp in args.tp:
        if tp < 2:
            continue
        try:
            tcfg = shard_config(cfg, tp)
        except ValueError as exc:  # the model's heads or MLP do not split over this many ranks
            rows.append({"model": label, "tp": tp, "batch": None, "skipped": str(exc)})
            continue
        group = groups.of(tp)
        local = dist.get_rank(group)
        maybe_fail(args, dist.get_rank(), "capture")
        params = full if whole else init_shard_params(tcfg, local, seed=0, device=device)
        cache = (shard_paged_cache(tcfg, full_cache, local) if whole
                 else new_paged_cache(tcfg, num_blocks, BLOCK, device=device, seed=1))
        for kind in args.all_reduce:
            rows += _tp_kind(m, tcfg, params, cache, group, local, kind, whole, single_refs, tp1)
        del params, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del full, full_cache, single_refs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, tp1_rows


def _tp_kind(m: Model, tcfg, params, cache, group, local: int, kind: str, whole: bool, single_refs: dict,
             tp1: dict) -> list[dict]:
    """One TP degree's rows for one all-reduce kind: eager, then each lever."""
    _, eager_timing, _ = TIMING[m.name]
    crossover = getattr(m.args, "crossover", None)
    step = tp_varlen_step(tcfg, params, local, group=group, all_reduce=kind, sharded=not whole, crossover=crossover)
    used = step.all_reduce.kind
    label = all_reduce_label(kind, used, crossover)
    head = {"model": m.label, "tp": tcfg.tp, "all_reduce": kind if crossover is None else label,
            "all_reduce_used": used, "all_reduce_label": label, "crossover": crossover,
            "fallback_reason": step.all_reduce.fallback_reason,
            "reference": "single-GPU eager" if whole else f"TP={tcfg.tp} eager"}
    eager, refs = {}, dict(single_refs)
    with torch.inference_mode():
        for b, batch in m.batches.items():
            if not whole:
                refs[b] = step(*batch, cache.clone())
            eager[b] = time_per_call(lambda i: step(*batch, cache), **eager_timing)  # noqa: B023
    rows, steps = [], {("replicated", False): step}
    for lever in m.args.lever:
        how = ("vocab" if "+vocab" in lever else "replicated", "+fused" in lever)
        if how not in steps:  # collective: every rank builds the same levers in the same order
            steps[how] = tp_varlen_step(tcfg, params, local, group=group, all_reduce=kind, sharded=not whole,
                                        lm_head=how[0], crossover=crossover, fuse_norm=how[1])
        built = steps[how]
        fused = {"fused_norm": built.add_norm.fused, "fused_norm_reason": built.add_norm.reason} if how[1] else {}
        for b, row in _measure(lever, built, m, cache, refs, tcfg, group).items():
            one, plain = tp1.get((tp1_lever(lever), b)), tp1.get(("plain", b))
            rows.append({**head, **fused, "batch": b, **row, "eager_ms": eager[b], "tp1_ms": one, "tp1_plain_ms": plain,
                         "max_err_vs_single_gpu": row["max_err"] if whole else None,
                         "graphify_vs_hand": _ratio(row["graphify_ms"], row.get("hand_ms")),
                         "tp_vs_tp1": _ratio(row["graphify_ms"], one),
                         "tp_vs_tp1_plain": _ratio(row["graphify_ms"], plain),
                         "hand_vs_tp1": _ratio(row.get("hand_ms"), one),
                         "speedup_vs_eager": _ratio(eager[b], row["graphify_ms"]),
                         "vs_weight_floor": _ratio(row["graphify_ms"], row["weight_floor_ms"])})
    return rows
