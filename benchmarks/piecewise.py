"""Piecewise benchmark: split(fn, ops) and the dual modes on the varlen reference model.

On a GPU: the Qwen2.5-0.5B-shaped varlen decoder (bf16, paged KV cache, unified attention
as the split op) in one run:
- decode at B = 1, 8, 64 (KV length 256) under NONE, PIECEWISE, FULL, FULL_AND_PIECEWISE;
- prefill of 512 and 2048 tokens under NONE and PIECEWISE (SGLang's token schedule);
- a mixed batch (4 prefill chunks of 64 + 32 decodes) under every mode;
- capture time and pool memory of the whole piecewise schedule, largest-first vs
  smallest-first vs the largest size alone.
Every configuration's output is checked against eager on the same inputs.

On a CPU-only machine: the tiny model on the simulation backend (not GPU timings).

    python -m benchmarks.piecewise [--inductor] [--model 0.5b|8b]
"""

from __future__ import annotations

import argparse
import sys
import time

import attrs
import torch

from graphify import Options, Pool, graphify, sglang_piecewise_sizes, vllm_sizes
from graphify.models import BatchLayout, DecoderConfig, init_params, model_support, new_paged_cache, split_ops, varlen_axes, varlen_step
from graphify.transforms import split

from ._report import environment, publish, sync, table, time_per_call

ATTENTION = "unified"
MODELS = {"0.5b": DecoderConfig.qwen2_5_0_5b, "8b": DecoderConfig.llama3_8b}
MODEL_NAMES = {"0.5b": "qwen2.5-0.5b-shape", "8b": "llama-3-8b-shape"}
INPUT_SETS = 4


def max_err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


class Bench:
    def __init__(self, gpu: bool, inductor: bool, model: str = "0.5b"):
        self.gpu, self.device = gpu, ("cuda" if gpu else "cpu")
        self.cfg = MODELS[model](max_seq_len=2048) if gpu else DecoderConfig.tiny(max_seq_len=128)
        self.block = 16 if gpu else 4
        self.params = init_params(self.cfg, seed=0, device=self.device)
        self.step = varlen_step(self.cfg, self.params, ATTENTION)
        self.cache = new_paged_cache(self.cfg, 1400 if gpu else 800, self.block, device=self.device, seed=1)
        self.inductor = inductor
        self.rows: list[dict] = []
        self.captures: list[dict] = []

    def layout(self, q, ctx, max_blocks):
        return BatchLayout(tuple(q), tuple(ctx), block_size=self.block, max_blocks=max_blocks)

    def graphified(self, mode, sizes, max_blocks, label, **kw):
        example = self.layout((3, 1, 5), (4, 7, 0), max_blocks).build(self.cfg, device=self.device)
        fn = self.step
        if mode != "NONE" or kw.get("force_split"):
            fn = split(self.step, split_ops(ATTENTION), *example, self.cache, axes=varlen_axes(), compile=self.inductor)
        kw.pop("force_split", None)
        options = attrs.evolve(kw.pop("options", Options()), outputs="view")
        g = graphify(fn, mode=mode, sizes=sizes, axes=varlen_axes(), support=model_support(ATTENTION), options=options, **kw)
        if mode == "NONE":
            return g
        sync()
        t0 = time.perf_counter()  # capture seconds, timed once: a capture is not repeated
        g = g.capture(*example, self.cache)
        sync()
        self.captures.append({"what": label, "mode": mode, "graphs": len(g.table), "sizes": len(g.keys),
                              "seconds": time.perf_counter() - t0, "pool_mib": g.table.nbytes / 2**20})
        print(f"  captured {label}: {g.summary()}", file=sys.stderr)
        return g

    def measure(self, scenario, g, mode, lay: BatchLayout, seed: int):
        batches = [lay.build(self.cfg, device=self.device, seed=seed + i) for i in range(INPUT_SETS)]
        with torch.inference_mode():
            ref = self.step(*batches[0], self.cache).clone()
            err = max_err(g(*batches[0], self.cache), ref)
            ms = time_per_call(lambda i: g(*batches[i % INPUT_SETS], self.cache), calls=5, reps=15, warmup=3)
        tokens = sum(lay.query_lens)
        self.rows.append({"scenario": scenario, "mode": mode, "tokens": tokens, "reqs": len(lay.query_lens),
                          "ms": ms, "max_err": err, "runtime": _runtime_modes(g)})
        g.stats.reset()


def _runtime_modes(g) -> str:
    return ",".join(sorted({r.mode.value for r in g.stats.rows()}))


SCENARIOS = ("decode", "prefill", "mixed", "memory")


def run(inductor: bool = False, scenarios=SCENARIOS, model: str = "0.5b") -> dict:
    env = environment()
    b = Bench(env["gpu"], inductor, model)
    cfg = b.cfg
    decode_bs = (1, 8, 64) if b.gpu else (1, 8, 32)
    kv = 255 if b.gpu else 60
    decode_blocks = -(-(kv + 1) // b.block)
    print("decode", file=sys.stderr)
    for mode in ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE") if "decode" in scenarios else ():
        g = b.graphified(mode, vllm_sizes(max(decode_bs)), decode_blocks, "decode schedule")
        for bs in decode_bs:
            b.measure("decode", g, mode, b.layout([1] * bs, [kv] * bs, decode_blocks), seed=bs)
        del g

    prefill_tokens = (512, 2048) if b.gpu else (64, 128)
    prefill_blocks = -(-max(prefill_tokens) // b.block)
    schedule = sglang_piecewise_sizes(max(prefill_tokens))
    mixed = b.layout([64] * 4 + [1] * 32, [0] * 4 + [200] * 32, prefill_blocks) if b.gpu else \
        b.layout([8] * 4 + [1] * 8, [0] * 4 + [40] * 8, prefill_blocks)
    print("prefill and mixed", file=sys.stderr)
    for mode in ("NONE", "PIECEWISE") if {"prefill", "mixed"} & set(scenarios) else ():
        g = b.graphified(mode, schedule, prefill_blocks, "prefill schedule, largest first")
        for t in prefill_tokens if "prefill" in scenarios else ():
            b.measure(f"prefill {t}", g, mode, b.layout([t], [0], prefill_blocks), seed=t)
        if "mixed" in scenarios:
            b.measure("mixed", g, mode, mixed, seed=7)
        del g
    mixed_sizes = sglang_piecewise_sizes(sum(mixed.query_lens) + 200)
    for mode in ("FULL", "FULL_AND_PIECEWISE") if "mixed" in scenarios else ():
        g = b.graphified(mode, mixed_sizes, prefill_blocks, "mixed schedule")
        b.measure("mixed", g, mode, mixed, seed=7)
        del g

    print("capture order and memory", file=sys.stderr)
    for label, sizes, largest_first in (
        ("piecewise, largest size alone", schedule[-1:], True),
        ("piecewise, all sizes, smallest first", schedule, False),
        ("piecewise, all sizes, largest first", schedule, True),
    ) if "memory" in scenarios else ():
        g = b.graphified("PIECEWISE", sizes, prefill_blocks, label, pool=Pool(label), options=Options(largest_first=largest_first))
        del g
        if b.gpu:
            torch.cuda.empty_cache()
    return {"env": env, "rows": b.rows, "captures": b.captures,
            "config": {"model": MODEL_NAMES[model] if b.gpu else "tiny", "dtype": str(cfg.dtype),
                       "attention": ATTENTION, "inductor_pieces": inductor, "block_size": b.block}}


def summarize(result: dict) -> dict:
    """Ratios within one scenario and batch: vs NONE (speed-up) and vs FULL; targets."""
    rows = result["rows"]
    by = {(r["scenario"], r["mode"], r["tokens"]): r for r in rows}
    for r in rows:
        none = by.get((r["scenario"], "NONE", r["tokens"]))
        full = by.get((r["scenario"], "FULL", r["tokens"]))
        r["speedup_vs_none"] = none["ms"] / r["ms"] if none else None
        r["vs_full"] = r["ms"] / full["ms"] if full else None
    caps = {c["what"]: c for c in result["captures"]}
    alone = caps.get("piecewise, largest size alone")
    for what in ("piecewise, all sizes, largest first", "piecewise, all sizes, smallest first"):
        if alone and alone["pool_mib"] > 0 and what in caps:
            caps[what]["vs_largest_alone"] = caps[what]["pool_mib"] / alone["pool_mib"]
    prefill = sorted((r for r in rows if r["scenario"].startswith("prefill") and r["mode"] == "PIECEWISE"),
                     key=lambda r: r["tokens"])
    return {
        "piecewise_decode_vs_full (target <= 1.3)": [r["vs_full"] for r in rows if r["scenario"] == "decode" and r["mode"] == "PIECEWISE"],
        "piecewise_prefill_speedup (target >= 3.5 at the smaller size)": [r["speedup_vs_none"] for r in prefill],
        "all_sizes_memory_vs_largest_alone (target <= 1.05)": caps.get("piecewise, all sizes, largest first", {}).get("vs_largest_alone"),
    }


COLUMNS = [("scenario", "scenario", "s"), ("mode", "mode", "s"), ("tokens", "tokens", "d"), ("reqs", "reqs", "d"),
           ("runtime", "ran as", "s"), ("ms", "ms / step", ".3f"), ("speedup_vs_none", "× vs NONE", ".2f"),
           ("vs_full", "÷ FULL", ".2f"), ("max_err", "max err vs eager", ".3g")]
CAPTURE_COLUMNS = [("what", "capture", "s"), ("mode", "mode", "s"), ("graphs", "keys", "d"),
                   ("seconds", "seconds", ".2f"), ("pool_mib", "pool MiB", ".1f"), ("vs_largest_alone", "÷ largest alone", ".3f")]


def render(result: dict) -> str:
    lines = []
    if not result["env"]["gpu"]:
        lines.append("**CPU-only machine: tiny varlen decoder on the simulation backend. These timings are not GPU "
                     "timings; run on a CUDA machine for real numbers.**\n")
    c = result["config"]
    lines.append(f"Model {c['model']} ({c['dtype']}), attention `{c['attention']}` as the split op, paged KV cache "
                 f"(block {c['block_size']}), inductor pieces: {c['inductor_pieces']}.\n")
    lines.append(table(result["rows"], COLUMNS))
    lines.append("\nCapture (PIECEWISE keys capture one graph per piece: layers + 1 per size):\n")
    lines.append(table(result["captures"], CAPTURE_COLUMNS))
    lines.append("\nTargets:\n")
    for name, value in result["checks"].items():
        shown = ", ".join(f"{v:.3f}" for v in value) if isinstance(value, list) else ("-" if value is None else f"{value:.3f}")
        lines.append(f"- {name}: {shown}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inductor", action="store_true", help="compile graph pieces with inductor before capture")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--model", choices=sorted(MODELS), default="0.5b", help="model shape on a GPU")
    args = parser.parse_args(argv)
    result = run(args.inductor, tuple(args.scenarios), args.model)
    result["checks"] = summarize(result)
    markdown = render(result)
    name = "piecewise-inductor" if args.inductor else "piecewise"
    if args.model != "0.5b":
        name += f"-{args.model}"
    if tuple(args.scenarios) != SCENARIOS:
        name += "-" + "-".join(args.scenarios)
    publish(name, result, markdown)
    return result


if __name__ == "__main__":
    main()
