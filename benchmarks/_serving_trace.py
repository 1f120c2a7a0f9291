"""The serving trace every serving benchmark runs: the varlen model, its paged cache, the
seeded synthetic trace cut into steps, and how one configuration is run and timed over it.
`benchmarks.serving` (the main job), `benchmarks.peers` (torch.compile's row) and
`benchmarks.tensor_parallel` build on it; it imports none of them.
"""

from __future__ import annotations

import time

import attrs
import torch

from graphify import Options, graphify, sglang_piecewise_sizes
from graphify.capture import freeze_gc
from graphify.models import BlockTables, DecoderConfig, init_params, model_support, new_paged_cache, split_ops, varlen_axes, varlen_step
from graphify.transforms import split

from ._report import host_pipelined_us, kernels, sync, time_per_call
from .trace import schedule, synthetic_requests

ATTENTION = "unified"
SPECIALISE_FROM = 256  # tokens: inductor + specialised sizes compile their pieces for these exact sizes
SERVING_MODELS = {  # name -> (config, label): the trace's model on a GPU; "tiny" on the CPU
    "0.5b": (lambda: DecoderConfig.qwen2_5_0_5b(max_seq_len=1024), "qwen2.5-0.5b-shape"),
    "8b": (lambda: DecoderConfig.llama3_8b(max_seq_len=1024), "llama-3-8b-shape"),
    "tiny": (lambda: DecoderConfig.tiny(max_seq_len=256), "tiny"),
}
MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def build_batches(cfg, steps, requests, *, block, max_blocks, num_blocks, device):
    """The trace's steps as model batches, KV blocks kept per request across steps."""
    tables = BlockTables(num_blocks, block, max_blocks)
    total = {r.id: r.prompt_len + r.output_len for r in requests}
    done = {r.id: 0 for r in requests}
    batches = []
    for i, s in enumerate(steps):
        batches.append(tables.batch(cfg, s.request_ids, s.query_lens, s.context_lens, device=device, seed=i))
        for rid, q in zip(s.request_ids, s.query_lens):
            done[rid] += q
            if done[rid] == total[rid]:
                tables.release(rid)
    return batches


def step_timer(gpu: bool):
    """Per-step latency (ms): CUDA events on a GPU, a host clock otherwise. By hand, not a
    `Timer`: the trace runs each step once, every step a different batch."""
    if gpu:
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end)
    else:
        def timed(fn):
            t0 = time.perf_counter()
            out = fn()
            return out, (time.perf_counter() - t0) * 1e3
    return timed


def _percentile(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Setup:
    """The model, its paged cache, the trace as batches, and an example batch for split."""

    def __init__(self, gpu: bool, num_requests: int, seed: int, specialise_from: int = SPECIALISE_FROM,
                 model: str = "0.5b"):
        device = "cuda" if gpu else "cpu"
        self.specialise_from = specialise_from
        self.gpu, self.device = gpu, device
        self.model = model if gpu else "tiny"
        self.cfg = cfg = SERVING_MODELS[self.model][0]()
        self.block, self.max_blocks = 16, 64
        self.max_tokens = 512 if gpu else 64
        self.requests = synthetic_requests(seed, num_requests, prompt_range=(16, 400) if gpu else (4, 60),
                                           output_range=(8, 64) if gpu else (2, 12))
        self.steps = schedule(self.requests, max_tokens=self.max_tokens, chunk=self.max_tokens // 2, spec_tokens=2,
                              spec_every=4)
        self.params = init_params(cfg, seed=0, device=device)
        self.step = varlen_step(cfg, self.params, ATTENTION)
        self.num_blocks = 1 + sum(-(-(r.prompt_len + r.output_len) // self.block) for r in self.requests) + 32
        self.cache = new_paged_cache(cfg, self.num_blocks, self.block, device=device, seed=1)
        self.batches = build_batches(cfg, self.steps, self.requests, block=self.block, max_blocks=self.max_blocks,
                                     num_blocks=self.num_blocks, device=device)
        self.example = next(b for b in self.batches if b[3].shape[0] >= 2)  # split needs >= 2 tokens and requests
        self.tokens = sum(s.num_tokens for s in self.steps)

    def graphify(self, mode: str, inductor: bool = False):
        """(callable, start-up seconds): split (+ inductor) and capture, timed once."""
        sync()
        t0 = time.perf_counter()
        fn = self.step
        if mode != "NONE":
            fn = split(self.step, split_ops(ATTENTION), *self.example, self.cache, axes=varlen_axes(), compile=inductor)
        sizes = sglang_piecewise_sizes(self.max_tokens)
        options = Options(compile_sizes=self.compile_sizes(sizes)) if inductor else None
        g = graphify(fn, mode=mode, sizes=sizes, axes=varlen_axes(), support=model_support(ATTENTION),
                     options=attrs.evolve(options or Options(), outputs="view"))
        if mode != "NONE":
            g = g.capture(*self.example, self.cache)
        sync()
        return g, time.perf_counter() - t0

    def compile_sizes(self, sizes) -> tuple[int, ...]:
        """The capture sizes whose inductor pieces get a compile of their own: the large ones,
        where it pays (2.7% at 512 tokens on the H100, nothing measurable at decode sizes:
        benchmarks/results/compile-sizes-*.md), each ~4 s of cold start."""
        return tuple(s for s in sizes if s >= self.specialise_from)

    def decode_batch(self, b: int, context: int = 256) -> tuple:
        """A uniform decode batch of `b` requests at KV length `context` (own KV blocks)."""
        tables = BlockTables(self.num_blocks, self.block, self.max_blocks)
        return tables.batch(self.cfg, tuple(range(b)), (1,) * b, (context,) * b, device=self.device, seed=b)


def run_trace(setup: Setup, call, name: str, timed) -> tuple[float, list[float]]:
    """Check `call` against eager step by step (each on its own copy of the cache), then
    time every step. Returns (largest difference, latencies ms)."""
    from tqdm.auto import tqdm

    cache, ref_cache = setup.cache, setup.cache.clone()
    worst = 0.0
    with torch.inference_mode():
        for batch in tqdm(setup.batches, desc=f"{name}: check", leave=False, disable=None):
            out = call(*batch, cache)
            worst = max(worst, (out.float() - setup.step(*batch, ref_cache).float()).abs().max().item())
        with freeze_gc():  # a GC pass mid-trace is a host stall that says nothing about the configuration
            latencies = [timed(lambda: call(*batch, cache))[1]  # noqa: B023 - called at once
                         for batch in tqdm(setup.batches, desc=f"{name}: run", leave=False, disable=None)]
    del ref_cache
    return worst, latencies


def slowest_steps(setup: Setup, latencies: list[float], g=None, count: int = 3) -> list[dict]:
    """The `count` slowest steps: what they were and (for graphify) where they ran."""
    out = []
    for i in sorted(range(len(latencies)), key=latencies.__getitem__, reverse=True)[:count]:
        s, batch = setup.steps[i], setup.batches[i]
        row = {"step": i, "ms": latencies[i], "kind": s.kind, "tokens": s.num_tokens, "reqs": len(s.request_ids)}
        if g is not None and g.table is not None:
            n, r = batch[0].shape[0], batch[3].shape[0]
            row["ran_as"] = str(g._runtime.dispatcher.lookup(n, n == r).mode.value)
        out.append(row)
    return out


STEP_KINDS = ("prefill", "mixed", "decode", "spec")


def step_kinds(setup: Setup) -> dict[str, int]:
    """How many steps of the trace are of each kind."""
    return {k: sum(s.kind == k for s in setup.steps) for k in STEP_KINDS}


def ms_by_kind(setup: Setup, latencies: list[float]) -> dict[str, float]:
    """Milliseconds spent per step kind over the trace (prefill, mixed, decode, spec): where a
    configuration wins or loses against another on the same trace."""
    out: dict[str, float] = {}
    for s, ms in zip(setup.steps, latencies):
        out[s.kind] = out.get(s.kind, 0.0) + ms
    return out


def decode_rows(setup: Setup, candidates: dict, b: int = 8) -> list[dict]:
    """Batch-`b` decode: step time (CUDA events, back to back), host cost per step
    (issued while the device is busy) and, on a GPU, kernels per step (torch.profiler), each
    against eager on the same inputs."""
    batch = setup.decode_batch(b)
    cache = setup.cache
    rows = []
    with torch.inference_mode():
        ref = setup.step(*batch, cache).float()
        for name, call in candidates.items():
            err = (call(*batch, cache).float() - ref).abs().max().item()
            rows.append({
                "config": name,
                "step_ms": time_per_call(lambda i: call(*batch, cache)),  # noqa: B023
                "host_us": host_pipelined_us(lambda i: call(*batch, cache)),  # noqa: B023
                "max_err_vs_eager": err,
            })
        for row in rows if torch.cuda.is_available() else ():  # after every timing: the profiler slows later launches
            row["kernels_per_step"], _, row["gpu_idle_us"], _ = kernels(lambda: candidates[row["config"]](*batch, cache))  # noqa: B023
    return rows


