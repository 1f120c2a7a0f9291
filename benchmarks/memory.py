"""Graph memory: how capture order and pool sharing change what the graphs reserve.

1. Every capture size of the decode step (vLLM's schedule up to 512) under one shared pool
   captured largest first, the same smallest first, and a pool per size.
2. Two models (a draft and a target decoder, as in speculative decoding) in one shared
   pool vs a pool each.
3. The same three orders for a CuPy function on the cupy backend (CuPy memory pools).

Memory is read from the allocators themselves: `torch.cuda.memory_reserved()` before and
after (static buffers included), each pool's own count (`Pool.report()`: torch's segment
table, CuPy's `MemoryPool.total_bytes()`), and what is left after the callables are dropped.
Every configuration is checked against eager at a few sizes.

On a CPU-only machine it runs the tiny decoder on the simulation backend, where graph
memory means the output buffers each capture keeps, and says so.

    python -m benchmarks.memory [--max-size 512]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable, Sequence

import torch

from graphify import Options, Pool, graphify, persistent, tokens, vllm_sizes
from graphify.models import DecoderConfig, decode_step, init_params, new_kv_cache

from ._report import environment, publish, sync, table

MiB = 1 << 20
CHECK_SIZES = (1, 3, 8, 100, 512)


def _clean() -> None:
    """Device memory back to the allocator's pools and then the device, before a reading.
    Without CUDA there is nothing to read (a full collection in the CPU suite's process is
    most of this benchmark's time there)."""
    if torch.cuda.is_available():
        gc.collect()
        sync()
        torch.cuda.empty_cache()


def _reserved() -> int:
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0


def decode_inputs(cfg: DecoderConfig, n: int, device, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).to(device)
    pos = torch.randint(1, cfg.max_seq_len, (n,), generator=gen).to(device)
    rows = torch.randperm(n, generator=gen).to(device) + 1
    return ids, pos, rows


class DecodeModel:
    """One decoder: parameters, a KV cache with a row per request, and its step."""

    def __init__(self, cfg: DecoderConfig, max_size: int, device, seed: int):
        self.cfg = cfg
        self.cache = new_kv_cache(cfg, max_size, device=device, seed=seed + 1)
        self.step = decode_step(cfg, init_params(cfg, seed=seed, device=device))
        self.device = device

    def graphify(self, sizes: Sequence[int], pool: Pool, largest_first: bool = True):
        g = graphify(self.step, mode="FULL", sizes=sizes, axes=(tokens(), tokens(), tokens(), persistent()),
                     pool=pool, options=Options(largest_first=largest_first))
        return g.capture(*decode_inputs(self.cfg, 1, self.device, 0), self.cache)

    def max_err(self, graphs: Sequence, sizes: Sequence[int]) -> float:
        """Max |graph - eager| over fresh random batches of the checked sizes."""
        worst = 0.0
        for n in sizes:
            g = next(g for g in graphs if n <= g.table.keys.max_tokens() and any(
                e.key.num_tokens >= n for e in g.table))
            args = decode_inputs(self.cfg, n, self.device, seed=n)
            want = self.step(*args, self.cache).float()
            got = g(*args, self.cache).float()
            worst = max(worst, (got - want).abs().max().item())
        return worst


def measure(name: str, build: Callable[[], tuple[list, list[Pool]]], check: Callable[[list], float]) -> dict:
    """Capture with `build`, read memory three ways, check outputs, drop, read again."""
    _clean()
    base = _reserved()
    t0 = time.perf_counter()  # capture seconds, timed once: a capture is not repeated
    graphs, pools = build()
    seconds = time.perf_counter() - t0
    _clean()
    reports = [p.report() for p in pools]
    row = {
        "config": name,
        "graphs": sum(len(r.per_graph) for r in reports),
        "pools": len(pools),
        "reserved_mib": (_reserved() - base) / MiB,
        "pool_mib": sum(r.reserved_bytes for r in reports) / MiB,
        "in_use_mib": sum(r.used_bytes for r in reports) / MiB,
        "per_graph_mib": sum(r.total_bytes for r in reports) / MiB,
        "capture_s": seconds,
        "max_err": check(graphs),
    }
    del graphs
    _clean()
    for p in pools:
        p.trim()
    row["left_after_drop_mib"] = (_reserved() - base) / MiB
    return row


def _checked_sizes(sizes: Sequence[int]) -> list[int]:
    return [n for n in CHECK_SIZES if n <= max(sizes)]


def order_rows(model: DecodeModel, sizes: Sequence[int], label: str) -> list[dict]:
    def shared(largest_first: bool):
        def build():
            pool = Pool(f"{label} shared")
            return [model.graphify(sizes, pool, largest_first)], [pool]
        return build

    def per_size():
        pools = [Pool(f"{label} size {n}") for n in sizes]
        return [model.graphify((n,), p) for n, p in zip(sizes, pools)], pools

    check = lambda gs: model.max_err(gs, _checked_sizes(sizes))  # noqa: E731
    return [
        measure(f"{label}: one pool, largest first", shared(True), check),
        measure(f"{label}: one pool, smallest first", shared(False), check),
        measure(f"{label}: a pool per size", per_size, check),
    ]


def two_model_rows(draft: DecodeModel, target: DecodeModel, sizes: Sequence[int]) -> list[dict]:
    def check(gs):
        return max(draft.max_err(gs[:1], _checked_sizes(sizes)), target.max_err(gs[1:], _checked_sizes(sizes)))

    def one_pool():
        pool = Pool("draft+target")
        return [draft.graphify(sizes, pool), target.graphify(sizes, pool)], [pool]

    def two_pools():
        pools = [Pool("draft"), Pool("target")]
        return [draft.graphify(sizes, pools[0]), target.graphify(sizes, pools[1])], pools

    return [
        measure("draft + target: one shared pool", one_pool, check),
        measure("draft + target: a pool each", two_pools, check),
    ]


def cupy_rows(sizes: Sequence[int]) -> list[dict]:
    """The three capture orders for a CuPy function on the cupy backend: four
    norm + gated-activation blocks (elementwise and reductions; CuPy will not capture
    cuBLAS, so no matrix products)."""
    import cupy as cp

    rs = cp.random.RandomState(0)
    ws = [rs.standard_normal((1024,), dtype=cp.float32) for _ in range(4)]

    def mlp(x, w0, w1, w2, w3):
        for w in (w0, w1, w2, w3):
            h = x / cp.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6) * w
            x = x + h * (1 / (1 + cp.exp(-h))) * cp.tanh(h)
        return x

    axes = (tokens(), persistent(), persistent(), persistent(), persistent())

    def capture(szs, pool, largest_first=True):
        g = graphify(mlp, mode="FULL", sizes=szs, axes=axes, pool=pool, options=Options(largest_first=largest_first))
        return g.capture(rs.standard_normal((1, 1024), dtype=cp.float32), *ws)

    def check(gs):
        worst = 0.0
        for n in _checked_sizes(sizes):
            g = next(g for g in gs if any(e.key.num_tokens >= n for e in g.table))
            x = cp.random.RandomState(n).standard_normal((n, 1024), dtype=cp.float32)
            worst = max(worst, float(cp.abs(g(x, *ws) - mlp(x, *ws)).max()))
        return worst

    def shared(largest_first):
        def build():
            pool = Pool("cupy shared")
            return [capture(sizes, pool, largest_first)], [pool]
        return build

    def per_size():
        pools = [Pool(f"cupy size {n}") for n in sizes]
        return [capture((n,), p) for n, p in zip(sizes, pools)], pools

    rows = [
        measure("CuPy norm+gate: one pool, largest first", shared(True), check),
        measure("CuPy norm+gate: one pool, smallest first", shared(False), check),
        measure("CuPy norm+gate: a pool per size", per_size, check),
    ]
    for r in rows:  # CuPy memory is not torch's: the pools' own counts are the measure
        r["reserved_mib"] = r["left_after_drop_mib"] = None
    return rows


def run(max_size: int = 512) -> dict:
    env = environment()
    gpu = env["gpu"]
    device = "cuda" if gpu else "cpu"
    if gpu:
        target_cfg, draft_cfg = DecoderConfig.qwen2_5_0_5b(), DecoderConfig.qwen2_5_0_5b(layers=4)
    else:
        max_size = min(max_size, 32)
        target_cfg, draft_cfg = DecoderConfig.tiny(), DecoderConfig.tiny(layers=1)
    sizes = vllm_sizes(max_size)
    target = DecodeModel(target_cfg, max_size, device, seed=0)
    draft = DecodeModel(draft_cfg, max_size, device, seed=10)
    rows = []
    with torch.inference_mode():
        rows += order_rows(target, sizes, "decode")
        rows += two_model_rows(draft, target, sizes)
        if gpu:
            try:
                import cupy  # noqa: F401
            except ImportError:
                print("CuPy not installed: skipping the CuPy rows", file=sys.stderr)
            else:
                try:
                    rows += cupy_rows(sizes)
                except Exception as exc:  # report, keep the torch rows
                    print(f"CuPy rows failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                    rows.append({"config": f"CuPy rows failed: {type(exc).__name__}"})
    return {
        "env": env,
        "config": {"model": "qwen2.5-0.5b-shape" if gpu else "tiny", "draft_layers": draft_cfg.layers,
                   "dtype": str(target_cfg.dtype), "kv_len": target_cfg.max_seq_len, "sizes": list(sizes)},
        "rows": rows,
    }


COLUMNS = [
    ("config", "configuration", "s"),
    ("graphs", "graphs", "d"),
    ("pools", "pools", "d"),
    ("pool_mib", "pools reserve MiB", ".1f"),
    ("in_use_mib", "in use MiB", ".1f"),
    ("per_graph_mib", "sum per graph MiB", ".1f"),
    ("reserved_mib", "torch reserved +MiB", ".1f"),
    ("left_after_drop_mib", "left after drop MiB", ".1f"),
    ("capture_s", "capture s", ".2f"),
    ("max_err", "max err vs eager", ".3g"),
]


def render(result: dict) -> str:
    cfg = result["config"]
    lines = []
    if not result["env"]["gpu"]:
        lines.append("**CPU-only machine: tiny decoder on the simulation backend. Memory here is the output "
                     "buffers each simulated capture keeps, not GPU memory.**\n")
    lines.append(f"Decode step of the {cfg['model']} decoder ({cfg['dtype']}, KV length {cfg['kv_len']}), FULL graphs "
                 f"for {len(cfg['sizes'])} sizes {cfg['sizes'][0]}..{cfg['sizes'][-1]}; draft model {cfg['draft_layers']} "
                 "layers. 'pools reserve' is each pool's own allocator count; 'torch reserved' is "
                 "torch.cuda.memory_reserved() after capture minus before (static buffers included).\n")
    lines.append(table(result["rows"], COLUMNS))
    by = {r["config"]: r for r in result["rows"]}
    first, smallest, per = (by.get(f"decode: {k}") for k in ("one pool, largest first", "one pool, smallest first",
                                                           "a pool per size"))
    if first and smallest and per and first["pool_mib"]:
        lines.append(f"\nSmallest first reserves {smallest['pool_mib'] / first['pool_mib']:.2f}x and a pool per size "
                     f"{per['pool_mib'] / first['pool_mib']:.2f}x what one pool captured largest first does.")
    one, two = by.get("draft + target: one shared pool"), by.get("draft + target: a pool each")
    if one and two and one["pool_mib"]:
        lines.append(f"Two models: separate pools reserve {two['pool_mib'] / one['pool_mib']:.2f}x one shared pool.")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-size", type=int, default=512)
    args = parser.parse_args(argv)
    result = run(args.max_size)
    publish("memory", result, render(result))
    return result


if __name__ == "__main__":
    main()
