"""Decode-step benchmark: eager vs graphify FULL vs a hand-written CUDA graph (the floor).

On a GPU: the Qwen2.5-0.5B-shaped decoder in bf16, KV length 256, at B = 1, 8, 64. The
floor is one `torch.cuda.CUDAGraph` per batch size that copies the new inputs into its
static buffers and replays. Also graphify's host cost per call (issuing it, no sync) and
each path's max error against eager.

On a CPU-only machine it runs the tiny decoder through graphify's simulation backend:
those timings say nothing about GPUs and are labelled so.

    python -m benchmarks.decode [--batch-sizes 1 8 64] [--model 0.5b|8b]
"""

from __future__ import annotations

import argparse
import sys

import attrs

import torch

from graphify import Options, graphify, persistent, tokens, vllm_sizes
from graphify.call.runtime import STATIC_PLAN
from graphify.models import DecoderConfig, decode_step, init_params, new_kv_cache

from . import dispatch as dispatch_bench
from ._floor import HandWrittenGraph
from ._report import environment, host_costs_us, host_pipelined_us, publish, sync, table, time_per_call

INPUT_SETS = 8


def make_inputs(cfg: DecoderConfig, b: int, device, seed: int) -> list[tuple]:
    """Fresh random token ids per set; every request at KV length `max_seq_len`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(INPUT_SETS):
        ids = torch.randint(0, cfg.vocab_size, (b,), generator=gen).to(device)
        pos = torch.full((b,), cfg.max_seq_len - 1, dtype=torch.long, device=device)
        rows = torch.arange(1, b + 1, device=device)
        out.append((ids, pos, rows))
    return out


def own_cost_us(g, static_args: tuple) -> float:
    """graphify's own host µs per call with `static_inputs()` (checks, dispatch, padding,
    tally, checked views): the same call with the graph launch replaced by nothing. The
    launch's own cost varies with the graph and the machine; this part is graphify's."""
    runtime = g._runtime
    learnt = runtime.plans.get(STATIC_PLAN)
    if learnt is None:  # only calls with no per-call predicates keep one plan
        return float("nan")
    plan, mode, n = learnt
    runtime.plans[STATIC_PLAN] = (attrs.evolve(plan, replay=lambda: None), mode, n)
    try:
        return host_costs_us({"own": lambda i: g(*static_args)})["own"]
    finally:
        runtime.plans[STATIC_PLAN] = learnt


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


MODELS = {"0.5b": (DecoderConfig.qwen2_5_0_5b, "qwen2.5-0.5b-shape"), "8b": (DecoderConfig.llama3_8b, "llama-3-8b-shape")}


def run(batch_sizes=(1, 8, 64), model: str = "0.5b") -> dict:
    env = environment()
    gpu = env["gpu"]
    device = "cuda" if gpu else "cpu"
    cfg = MODELS[model][0]() if gpu else DecoderConfig.tiny(max_seq_len=64)
    params = init_params(cfg, seed=0, device=device)
    cache = new_kv_cache(cfg, max(batch_sizes), device=device, seed=1)
    step = decode_step(cfg, params)
    axes = (tokens(), tokens(), tokens(), persistent())

    g = graphify(step, mode="FULL", sizes=vllm_sizes(max(batch_sizes)), axes=axes, options=Options(backend="auto", outputs="view"))
    g = g.capture(*make_inputs(cfg, 1, device, 0)[0], cache)
    print(g.summary(), file=sys.stderr)
    # The default path: copies inputs in and outputs out (a second table, same sizes).
    g_copy = graphify(step, mode="FULL", sizes=vllm_sizes(max(batch_sizes)), axes=axes, options=Options(backend="auto"))
    g_copy = g_copy.capture(*make_inputs(cfg, 1, device, 0)[0], cache)

    rows = []
    with torch.inference_mode():
        for b in batch_sizes:
            rows.append(_batch_row(b, cfg, step, cache, (g, g_copy), gpu))
            sync()
    disp = dispatch_bench.run()
    return {
        "env": env,
        "config": {"model": MODELS[model][1] if gpu else "tiny", "dtype": str(cfg.dtype), "kv_len": cfg.max_seq_len,
                   "backend": g.table.backend.name, "sizes": list(g.sizes)},
        "capture": {"graphs": len(g.table), "seconds": g.table.seconds, "pool_mib": g.table.nbytes / 2**20,
                    "per_graph": [{"key": str(e.key), "seconds": e.seconds, "mib": e.nbytes / 2**20} for e in g.table]},
        "rows": rows,
        "dispatch": disp,
    }


def _batch_row(b: int, cfg: DecoderConfig, step, cache, graphs: tuple, gpu: bool) -> dict:
    """One batch size's row: step times, host costs and max errors of eager, graphify (views,
    and the default copies: `graphs`) and, on a GPU, the hand-written graph."""
    g, g_copy = graphs
    inputs = make_inputs(cfg, b, cache.device, seed=b)
    eager = lambda i: step(*inputs[i % INPUT_SETS], cache)  # noqa: E731
    graphed = lambda i: g(*inputs[i % INPUT_SETS], cache)  # noqa: E731
    row = {"batch": b}
    check = inputs[0]
    ref = step(*check, cache).clone()
    row["graphify_max_err"] = max_err(g(*check, cache), ref)
    row["eager_ms"] = time_per_call(eager)
    row["graphify_ms"] = time_per_call(graphed)
    row["default_max_err"] = max_err(g_copy(*check, cache), ref)
    static_args = g.static_inputs(b)
    for dst, src in zip(static_args, check):
        if dst is not cache:
            dst.copy_(src)
    g(*static_args)
    entry = next(e for e in g.table if e.key.num_tokens == b)
    calls = {
        "default_host_us": lambda i: g_copy(*inputs[i % INPUT_SETS], cache),
        "graphify_host_us": graphed,
        "graphify_static_host_us": lambda i: g(*static_args),
        "replay_host_us": lambda i: entry.replay(),
    }
    if gpu:
        floor = HandWrittenGraph(step, check, cache)
        calls["floor_host_us"] = lambda i: floor(*inputs[i % INPUT_SETS])
    row.update(host_costs_us(calls))
    row["own_host_us"] = own_cost_us(g, static_args)
    row["graphify_pipelined_us"] = host_pipelined_us(graphed)
    row["static_vs_replay"] = row["graphify_static_host_us"] / row["replay_host_us"]
    row["default_vs_replay"] = row["default_host_us"] / row["replay_host_us"]
    if gpu:
        floor_call = lambda i: floor(*inputs[i % INPUT_SETS])  # noqa: E731
        row["floor_max_err"] = max_err(floor(*check), ref)
        row["floor_ms"] = time_per_call(floor_call)
        row["graphify_vs_floor"] = row["graphify_ms"] / row["floor_ms"]
        del floor
    row["speedup_vs_eager"] = row["eager_ms"] / row["graphify_ms"]
    return row


COLUMNS = [
    ("batch", "B", "d"),
    ("eager_ms", "eager ms", ".3f"),
    ("floor_ms", "hand graph ms", ".3f"),
    ("graphify_ms", "graphify ms", ".3f"),
    ("graphify_vs_floor", "graphify / hand", ".3f"),
    ("speedup_vs_eager", "speedup vs eager", ".1f"),
    ("graphify_max_err", "graphify max err", ".3g"),
    ("default_max_err", "default max err", ".3g"),
    ("floor_max_err", "hand max err", ".3g"),
]
HOST_COLUMNS = [
    ("batch", "B", "d"),
    ("default_host_us", "graphify default (copies in and out)", ".1f"),
    ("graphify_host_us", "graphify view (copies inputs)", ".1f"),
    ("graphify_static_host_us", "graphify view + static inputs", ".1f"),
    ("floor_host_us", "hand graph (copies inputs)", ".1f"),
    ("replay_host_us", "CUDAGraph.replay() alone", ".1f"),
    ("own_host_us", "graphify's own (launch stubbed)", ".1f"),
    ("static_vs_replay", "static ÷ replay", ".2f"),
    ("default_vs_replay", "default ÷ replay", ".2f"),
    ("graphify_pipelined_us", "graphify view, back to back", ".1f"),
]


def render(result: dict) -> str:
    env, cap = result["env"], result["capture"]
    lines = []
    if not env["gpu"]:
        lines.append(
            "**CPU-only machine: tiny decoder on the simulation backend. These timings are not GPU "
            "timings; run on a CUDA machine for real numbers.**\n"
        )
    lines.append(f"Model {result['config']['model']} ({result['config']['dtype']}), KV length {result['config']['kv_len']}, "
                 f"backend {result['config']['backend']}.\n")
    lines.append(table(result["rows"], COLUMNS))
    lines.append(
        "\nHost µs to issue one call (median of 400, each after a synchronize, so no call waits on the "
        "device; the variants interleaved, since a launch's host cost drifts within a run): the CPU cost of "
        "the call itself, the ratios' basis. 'graphify's own' is the static-inputs call with the graph launch "
        "replaced by nothing. The last column issues calls back to back while the device is busy. 'Static inputs' means the caller wrote the batch into "
        "`g.static_inputs(B)`, so graphify copies nothing; 'default' is outputs='copy' with copied inputs.\n"
    )
    lines.append(table(result["rows"], HOST_COLUMNS))
    lines.append(
        f"\nCapture: {cap['graphs']} FULL graphs (sizes {result['config']['sizes'][0]}..{result['config']['sizes'][-1]}) "
        f"in {cap['seconds']:.2f} s, {cap['pool_mib']:.1f} MiB pool.\n"
    )
    lines.append(table(result["dispatch"], [("what", "dispatch (CPU)", "s"), ("us_per_call", "µs per call", ".3f"),
                                            ("target_us", "target µs", ".1f")]))
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--model", choices=sorted(MODELS), default="0.5b", help="model shape on a GPU")
    args = parser.parse_args(argv)
    result = run(tuple(args.batch_sizes), args.model)
    markdown = render(result)
    publish("decode" if args.model == "0.5b" else f"decode-{args.model}", result, markdown)
    return result


if __name__ == "__main__":
    main()
