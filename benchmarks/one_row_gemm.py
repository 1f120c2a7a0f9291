"""Decode's one-row matmuls against HBM's peak: `y = x @ w.T` for x [M, K] and w [N, K] in bf16
at the Llama-3-8B weight shapes, M = 1 and 8, done four ways: (a) `F.linear` (cuBLAS, torch's
default), (b) the same with cuBLASLt preferred, (c) `torch.compile(F.linear,
mode="max-autotune-no-cudagraphs")` and (d) the Triton kernel of `models._triton_gemv`
(`--sweep` adds (e): the fastest of its `candidates`). At batch 1 an 8B token's GEMMs ran at
71% of an H200's peak under cuBLAS (with split-K reduce kernels of their own): this tells
how much nearer the peak each shape can get.

Each variant of each shape is captured in one CUDA graph of `--calls` back-to-back calls
over enough copies of the weight that L2 (50 MB) cannot hold them (`--min-bytes` in all),
warmed up, replayed `--reps` times between CUDA events; the time is the median per call.
GB/s counts the weight, x and y once per call. Every variant is first checked, replayed on
fresh random inputs, against an fp32 product; one that fails to build is reported with its
error. The summary: per M, one 8B layer's GEMM time (q, k, v, o, gate, up and down, as the
model launches them), and a token's (32 layers and the LM head), each against (a).

    python3 -m benchmarks.one_row_gemm [--rows 1 8] [--shapes q/o down] [--variants linear triton] [--sweep]
    python3 -m benchmarks.one_row_gemm --smoke --cpu   # tiny shapes on the CPU, (a) and (d) interpreted; no files

On the CPU, (d) runs in Triton's interpreter (TRITON_INTERPRET=1, set when run as a script with
`--cpu` or without a GPU: Triton reads it at its import).

Writes benchmarks/results/one-row-gemm-<device>.{json,md} (`--name`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._floor import BackToBack
from ._report import environment, peak_bandwidth, publish, table

__all__ = ["SHAPES", "LAYER", "FUSED_LAYER", "summarise", "render", "run", "main"]


class Shape(NamedTuple):
    name: str
    n: int  # w's rows: the output features
    k: int  # the input features


SHAPES = (Shape("q/o", 4096, 4096), Shape("k/v", 1024, 4096), Shape("qkv", 6144, 4096),
          Shape("gate/up", 14336, 4096), Shape("gate+up", 28672, 4096), Shape("down", 4096, 14336),
          Shape("lm_head", 128256, 4096))
SMOKE_SHAPES = (Shape("q/o", 64, 128), Shape("k/v", 16, 128), Shape("gate/up", 96, 128), Shape("down", 64, 96))
LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}  # one 8B layer's GEMMs as the model launches them
FUSED_LAYER = {"qkv": 1, "q/o": 1, "gate+up": 1, "down": 1}  # the same with q, k, v and gate, up fused
LAYERS = 32
VARIANTS = {"linear": "(a) F.linear", "linear-lt": "(b) F.linear, cuBLASLt",
            "inductor": "(c) torch.compile max-autotune", "triton": "(d) Triton GEMV",
            "triton-best": "(e) Triton GEMV, best of sweep"}
BASE = "linear"


def moved_bytes(m: int, n: int, k: int, size: int = 2) -> int:
    """What one call must move at least: the weight, x and y, once each."""
    return (n * k + m * k + m * n) * size


def _row_us(rows: list[dict]) -> dict:
    return {(r["shape"], r["m"], r["variant"]): r["us"] for r in rows if r.get("us") is not None}


def group_us(rows: list[dict], m: int, variant: str, counts: dict) -> float | None:
    """The time of a group of GEMMs (`counts`: shape name -> how many the group launches):
    each shape's µs per call times its count, so each shape weighs by its bytes moved (None
    where a shape has no time for the variant)."""
    times = _row_us(rows)
    parts = [times.get((name, m, variant)) for name in counts]
    if any(t is None for t in parts):
        return None
    return sum(count * t for count, t in zip(counts.values(), parts))


def summarise(rows: list[dict], shapes, ms, variants, peak: float | None) -> list[dict]:
    """Per M, variant and group (the 8B layer as launched, fused, a token's): µs, GB/s, % of
    `peak` (bytes/s) and the ratio of times to (a)'s."""
    dims = {s.name: s for s in shapes}
    token = {name: count * LAYERS for name, count in LAYER.items()} | {"lm_head": 1}
    groups = {"layer": LAYER, "layer, fused": FUSED_LAYER, "token": token}
    out = []
    for m in ms:
        for group, counts in groups.items():
            if not all(name in dims for name in counts):
                continue
            moved = sum(c * moved_bytes(m, dims[name].n, dims[name].k) for name, c in counts.items())
            base = group_us(rows, m, BASE, counts)
            for variant in variants:
                us = group_us(rows, m, variant, counts)
                gbs = None if us is None else moved / us / 1e3
                out.append({"m": m, "group": group, "variant": variant, "us": us, "mb": moved / 1e6, "gb_s": gbs,
                            "peak_pct": None if gbs is None or peak is None else 100 * gbs * 1e9 / peak,
                            "vs_a": None if us is None or base is None else us / base})
    return out


def render(result: dict) -> str:
    """The result's Markdown: the per-shape table, the summary lines, the failures."""
    rows = [{**r, "label": VARIANTS.get(r["variant"], r["variant"]), "nk": f"{r['n']}x{r['k']}",
             "check": "-" if r.get("ok") is None else ("ok" if r["ok"] else "WRONG"),
             "note": r.get("error") or r.get("detail") or ""} for r in result["rows"]]
    text = [result["how"], "", table(rows, [("shape", "shape", ""), ("nk", "N x K", ""), ("m", "M", "d"),
                                            ("label", "variant", ""), ("us", "µs", ".2f"), ("gb_s", "GB/s", ".0f"),
                                            ("peak_pct", "% peak", ".1f"), ("vs_a", "time / (a)", ".3f"),
                                            ("max_err", "max err", ".2e"), ("check", "check", ""),
                                            ("note", "note", "")])]
    for s in result["summary"]:
        if s["variant"] == BASE:
            text.append(f"\nM={s['m']}, {s['group']} ({s['mb']:.1f} MB):")
        us = "-" if s["us"] is None else f"{s['us']:.1f} µs"
        extra = "" if s["gb_s"] is None else f", {s['gb_s']:.0f} GB/s"
        extra += "" if s["peak_pct"] is None else f" ({s['peak_pct']:.1f}% of peak)"
        extra += "" if s["vs_a"] is None else f", {s['vs_a']:.3f} x (a)"
        text.append(f"- {VARIANTS.get(s['variant'], s['variant'])}: {us}{extra}")
    failed: dict = {}
    for r in result["rows"]:
        if r.get("error"):
            failed.setdefault((r["variant"], r["error"]), []).append(f"{r['shape']} M={r['m']}")
    if failed:
        text.append("\nNot measured:")
        text.extend(f"- {VARIANTS.get(v, v)} at {', '.join(cells)}: {error}" for (v, error), cells in failed.items())
    return "\n".join(text)


def _linear_lt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear with cuBLASLt preferred for this call alone (restored after, even on error)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def make(variant: str, m: int, n: int, k: int, device: torch.device):
    """(fn(x, w) -> y, detail) for one variant; raises where it cannot be built here."""
    if variant == "linear":
        return F.linear, ""
    if variant == "linear-lt":
        if device.type != "cuda":
            raise RuntimeError("cuBLASLt needs CUDA")
        return _linear_lt, ""
    if variant == "inductor":
        torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no earlier shape's guards
        return torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False), ""
    if variant == "triton":
        from graphify.models import _triton_gemv as tg

        if not tg.available():
            raise RuntimeError("Triton is not installed")
        config = tg.choose(m, n, k, tg.sms(device))
        return functools.partial(tg.gemv, config=config), str(config)
    raise ValueError(f"make: unknown variant {variant!r}; one of {sorted(VARIANTS)}")


def back_to_back(fn, x: torch.Tensor, weights: list, calls: int) -> BackToBack:
    """`calls` back-to-back `fn(x, weights[i % copies])`: one graph captured by hand on CUDA,
    eager calls on the CPU."""
    return BackToBack(lambda x: [fn(x, weights[i % len(weights)]) for i in range(calls)], x, calls)


def check(run: BackToBack, inputs: list, refs: list) -> tuple[float, float]:
    """(largest |y - fp32 product| over every call and input, largest |fp32 product|)."""
    err = top = 0.0
    for x, want in zip(inputs, refs):
        run.x.copy_(x)
        run.replay()
        for i, out in enumerate(run.outs):
            ref = want[i % len(want)]
            err = max(err, (out.float() - ref).abs().max().item())
            top = max(top, ref.abs().max().item())
    return err, top


def time_us(run: BackToBack, reps: int, warmup: int) -> float:
    """Median µs per call over `reps` replays: CUDA events between replays queued back to back,
    or the host clock on the CPU."""
    return statistics.median(run.per_call_us(reps, warmup))


def _fp32_products(inputs: list, weights: list) -> list:
    """x @ w.T in fp32 (no TF32) for each input and weight copy."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = []
        for x in inputs:
            out.append([x.float() @ w.float().T for w in weights])
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def measure(fn, shape: Shape, m: int, weights: list, inputs: list, refs: list, calls: int, args, peak) -> dict:
    """One variant at one shape, `calls` calls a graph: checked, then timed."""
    run = back_to_back(fn, torch.randn_like(inputs[0]), weights, calls)  # captured on other values than the checks
    err, top = check(run, inputs, refs)
    us = time_us(run, args.reps, args.warmup)
    gbs = moved_bytes(m, shape.n, shape.k) / us / 1e3
    del run
    return {"us": us, "gb_s": gbs, "peak_pct": None if peak is None else 100 * gbs * 1e9 / peak, "max_err": err,
            "ok": err <= 2 ** -6 * max(top, 1.0)}  # bf16 y: a rounding is 2^-8 of it; a bug is of order 1


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]


def sweep(shape: Shape, m: int, weights, inputs, refs, calls: int, args, peak, device) -> dict:
    """(e): every config of `candidates` measured; the fastest correct one, the others in `tried`."""
    from graphify.models import _triton_gemv as tg

    if not tg.available():
        raise RuntimeError("Triton is not installed")
    tried = []
    for config in tg.candidates(m, shape.n, shape.k, tg.sms(device)):
        try:
            cell = measure(functools.partial(tg.gemv, config=config), shape, m, weights, inputs, refs, calls, args,
                           peak)
            tried.append({"config": str(config), **cell})
        except Exception as exc:  # noqa: BLE001 - a config that fails is reported, the sweep goes on
            tried.append({"config": str(config), "error": _error(exc)})
    good = [t for t in tried if t.get("ok")]
    if not good:
        raise RuntimeError(f"no candidate config ran correctly: {tried[:2]}")
    best = min(good, key=lambda t: t["us"])
    return {**{k: v for k, v in best.items() if k != "config"}, "detail": best["config"], "tried": tried}


def cell_rows(shape: Shape, m: int, variants: list, args, device: torch.device, peak) -> list[dict]:
    """Every variant at one shape and M, each in its own try."""
    copies = 1 if device.type != "cuda" else max(1, math.ceil(args.min_bytes / (shape.n * shape.k * 2)))
    calls = max(args.calls, copies)
    gen = torch.Generator(device=device).manual_seed(shape.n * 31 + shape.k * 7 + m)
    weights = [(torch.randn(shape.n, shape.k, generator=gen, device=device) / shape.k ** 0.5).to(torch.bfloat16)
               for _ in range(copies)]
    inputs = [torch.randn(m, shape.k, generator=gen, device=device).to(torch.bfloat16) for _ in range(args.checks)]
    refs = _fp32_products(inputs, weights)
    out = []
    for variant in variants:
        row = {"shape": shape.name, "n": shape.n, "k": shape.k, "m": m, "variant": variant, "copies": copies,
               "calls": calls, "us": None, "ok": None, "error": None}
        try:
            if variant == "triton-best":
                row.update(sweep(shape, m, weights, inputs, refs, calls, args, peak, device))
            else:
                fn, detail = make(variant, m, shape.n, shape.k, device)
                row.update(measure(fn, shape, m, weights, inputs, refs, calls, args, peak), detail=detail)
        except Exception as exc:  # noqa: BLE001 - one variant's failure is its row's, not the run's
            row["error"] = _error(exc)
        out.append(row)
        print(f"one_row_gemm: {shape.name} M={m} {variant}: "
              f"{row['error'] or '%.2f µs, max err %.2e' % (row['us'], row['max_err'])}", file=sys.stderr, flush=True)
    base = next((r["us"] for r in out if r["variant"] == BASE and r["us"] is not None), None)
    for r in out:
        r["vs_a"] = None if r["us"] is None or base is None else r["us"] / base
    del weights, refs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run(args) -> dict:
    device = torch.device("cpu" if args.cpu else "cuda")
    peak = peak_bandwidth(device)
    shapes = [s for s in (SMOKE_SHAPES if args.smoke else SHAPES) if not args.shapes or s.name in args.shapes]
    variants = list(args.variants)
    if args.sweep and "triton-best" not in variants:
        variants.append("triton-best")
    rows = []
    for shape in shapes:
        for m in args.rows:
            rows.extend(cell_rows(shape, m, variants, args, device, peak))
    gpu = device.type == "cuda"
    how = (f"bf16, each variant in one CUDA graph of {args.calls}+ back-to-back calls over weight copies of "
           f">= {args.min_bytes / 1e6:.0f} MB in all, median of {args.reps} replays; peak "
           f"{'-' if peak is None else f'{peak / 1e12:.2f} TB/s'}" if gpu else
           "bf16 on the CPU, eager calls on the host clock (Triton interpreted): a smoke run, no times to keep")
    return {"env": environment(), "gpu": gpu, "peak_bytes_s": peak, "rows_m": list(args.rows),
            "variants": variants, "shapes": [s._asdict() for s in shapes], "calls": args.calls,
            "reps": args.reps, "warmup": args.warmup, "checks": args.checks, "min_bytes": args.min_bytes,
            "how": how, "rows": rows, "summary": summarise(rows, shapes, args.rows, variants, peak)}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="M: x's rows (decode's batch)")
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], help="a subset (default: all)")
    parser.add_argument("--variants", nargs="+", choices=[v for v in VARIANTS if v != "triton-best"],
                        default=["linear", "linear-lt", "inductor", "triton"])
    parser.add_argument("--sweep", action="store_true", help="add (e): the fastest of the Triton candidates")
    parser.add_argument("--calls", type=int, default=20, help="calls per graph (more if more copies)")
    parser.add_argument("--reps", type=int, default=50, help="timed replays (the median is kept)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed replays first")
    parser.add_argument("--checks", type=int, default=2, help="fresh random inputs checked per variant")
    parser.add_argument("--min-bytes", type=float, default=200e6, help="weight copies' bytes in all (L2: 50 MB)")
    parser.add_argument("--name", default="one-row-gemm", help="result files' name")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few replays, no result files")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU ((a) and the interpreted Triton kernel)")
    parser.add_argument("--out", help="also write the result as JSON here (any run)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("one_row_gemm: no CUDA GPU here; running on the CPU (as --cpu)", file=sys.stderr, flush=True)
        args.cpu = True
    if args.cpu:
        args.variants = [v for v in args.variants if v in ("linear", "triton")]
    if args.smoke:
        args.calls, args.reps, args.warmup, args.checks, args.min_bytes = 1, 1, 0, 1, 0.0
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    result = run(args)
    markdown = render(result)
    if args.smoke or not result["gpu"]:
        print(markdown, flush=True)
    else:
        publish(args.name, dict(result), markdown)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


if __name__ == "__main__":
    if "--cpu" in sys.argv or not torch.cuda.is_available():
        # the CPU runs Triton's interpreter, which Triton reads at its import (graphify imports it)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
