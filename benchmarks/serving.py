"""The main job: the varlen reference model through one seeded synthetic serving trace
(`benchmarks/trace.py`: arrivals over time, chunked prefills mixed with decodes, batch
sizes from 1 up, some speculative-decode steps) under every graphify mode, graphify over
inductor-compiled pieces (FULL_AND_PIECEWISE and FULL), and torch.compile(mode="reduce-overhead"); then a batch-8
decode step of the peers side by side.

Per configuration: tokens per second, step latency p50/p99, start-up seconds (split +
capture), graph pool MiB, padding waste, share of steps per runtime mode, and the largest
difference to eager over the trace (checked step by step against an eager copy of the
cache). On a GPU: the Qwen2.5-0.5B-shaped model; on a CPU-only machine the tiny one through
the simulation backend, and the timings say so.

Output: a table in the terminal; Markdown, JSON and a PNG plot (throughput and p99 by
configuration) under benchmarks/results/, stamped with device, date and versions.

    python -m benchmarks.serving [--requests 48] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from graphify import Mode

from ._plot import plot_serving
from ._report import RESULTS, device_slug, environment, host_pipelined_us, kernels, publish, table, time_per_call
from ._serving_trace import ATTENTION, MODES, Setup, _percentile, decode_rows, run_trace, slowest_steps, step_timer

def graphify_row(setup: Setup, mode: str, timed, inductor: bool = False) -> tuple[dict, object]:
    name = f"graphify {mode}" + (" + inductor (specialised)" if inductor else "")
    g, startup, worst, latencies = graphify_start(setup, mode, inductor, timed, name)
    calls = len(setup.batches)
    by_mode = {r.mode: r.calls / 2 for r in g.stats.by_mode()}  # checked once, timed once
    pool = None if g.table is None else g.table.pool.report()
    return {
        "config": name,
        "tokens_per_s": setup.tokens / (sum(latencies) / 1e3),
        "p50_ms": statistics.median(latencies),
        "p99_ms": _percentile(latencies, 0.99),
        "startup_s": startup,
        "graph_mib": 0.0 if pool is None else pool.reserved_bytes / 2**20,
        "padding_waste_pct": 100 * g.stats.padding_waste(),
        "steps_full_pct": 100 * by_mode.get(Mode.FULL, 0) / calls,
        "steps_piecewise_pct": 100 * by_mode.get(Mode.PIECEWISE, 0) / calls,
        "steps_none_pct": 100 * by_mode.get(Mode.NONE, 0) / calls,
        "uses_graphs": "yes" if mode != "NONE" else "no",
        "max_err_vs_eager": worst,
        "slowest": slowest_steps(setup, latencies, g),
    }, g


def graphify_start(setup: Setup, mode: str, inductor: bool, timed, name: str = "graphify"):
    """(g, start-up s, largest error, steady latencies): split and capture, then two passes
    over the trace. Start-up counts what the first pass paid once (kernels loaded or
    specialised on first launch, handles, first replays) as reduce-overhead's does."""
    g, startup = setup.graphify(mode, inductor)
    t0 = time.perf_counter()
    worst, _ = run_trace(setup, g, name, timed)
    first_pass = time.perf_counter() - t0
    g.stats.reset()
    t0 = time.perf_counter()
    worst2, latencies = run_trace(setup, g, name, timed)
    startup += max(first_pass - (time.perf_counter() - t0), 0.0)
    return g, startup, max(worst, worst2), latencies


def second_process_startup(which: str, num_requests: int, seed: int) -> float | None:
    """Start-up seconds of graphify + inductor ("graphify": FULL_AND_PIECEWISE, "graphify-full":
    FULL) or reduce-overhead ("ro") in
    a new process on this machine: torch's compile caches on disk are warm now."""
    import json
    import subprocess

    done = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--startup-only", which, "--requests",
                           str(num_requests), "--seed", str(seed)], capture_output=True, text=True, timeout=900)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"second-process start-up of {which} failed: {done.stderr[-800:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])["startup_s"]


def startup_only(which: str, num_requests: int, seed: int) -> dict:
    """This process's start-up for `which` (see `second_process_startup`)."""
    setup = Setup(True, num_requests, seed)
    if which in ("graphify", "graphify-full"):
        mode = "FULL_AND_PIECEWISE" if which == "graphify" else "FULL"
        return {"startup_s": graphify_start(setup, mode, True, step_timer(True))[1]}
    from .peers import reduce_overhead_row

    row, _ = reduce_overhead_row(setup, step_timer(True))
    return {"startup_s": row["startup_s"]}


def run_peer(num_requests: int, seed: int) -> tuple[dict, dict]:
    """torch.compile reduce-overhead on the same trace and decode batch, in its own
    process: graphs of inductor kernels captured by graphify crash (illegal address) once
    reduce-overhead has compiled the same code in the same process, so peers never share
    one (see benchmarks/peers.py)."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/peer.json"
        subprocess.run([sys.executable, "-m", "benchmarks.peers", "--requests", str(num_requests), "--seed", str(seed),
                        "--out", out], check=True)
        with open(out) as f:
            result = json.load(f)
    return result["row"], result["decode"]


def run(num_requests: int = 48, seed: int = 0) -> dict:
    env = environment()
    gpu = env["gpu"]
    setup = Setup(gpu, num_requests, seed)
    timed = step_timer(gpu)
    rows, decode = [], []
    for mode in MODES:
        row, g = graphify_row(setup, mode, timed)
        rows.append(row)
        if mode == "FULL_AND_PIECEWISE":
            plain = g
        del g
        print(f"{row['config']}: {row['tokens_per_s']:.0f} tok/s", file=sys.stderr)
    if gpu:  # inductor needs a GPU toolchain here; the peer is CUDA-only
        row, inductor = graphify_row(setup, "FULL_AND_PIECEWISE", timed, inductor=True)
        rows.append(row)
        b = 8
        static = inductor.static_inputs(b, b)
        batch = setup.decode_batch(b)
        for dst, src in zip(static, batch):
            dst.copy_(src)
        decode = decode_rows(setup, {
            "eager": setup.step,
            "graphify FULL_AND_PIECEWISE": plain,
            "graphify FULL_AND_PIECEWISE + inductor": inductor,
        }, b)
        with torch.inference_mode():  # the same, with the batch already in graphify's static buffers
            ref = setup.step(*batch, setup.cache).float()
            err = (inductor(*static).float() - ref).abs().max().item()
            decode.append({"config": "graphify F&P + inductor, static inputs",
                           "step_ms": time_per_call(lambda i: inductor(*static)),
                           "host_us": host_pipelined_us(lambda i: inductor(*static)), "max_err_vs_eager": err,
                           "kernels_per_step": kernels(lambda: inductor(*static))[0]})  # last: the profiler slows what follows
        del plain, inductor, static
        # The reference model's attention op captures into FULL graphs at every batch, so FULL
        # graphs of the same compiled pieces serve the mixed steps too: one launch a step, no
        # eager attention between pieces. Its pieces are the row above's compiles (caches warm).
        row, full = graphify_row(setup, "FULL", timed, inductor=True)
        rows.append(row)
        del full
        peer_row, peer_decode = run_peer(num_requests, seed)
        rows.append(peer_row)
        for which, mode in (("graphify", "FULL_AND_PIECEWISE"), ("graphify-full", "FULL")):
            by_name = next(r for r in rows if r["config"] == f"graphify {mode} + inductor (specialised)")
            by_name["startup_s_again"] = second_process_startup(which, num_requests, seed)
        peer_row["startup_s_again"] = second_process_startup("ro", num_requests, seed)
        decode.insert(1, peer_decode)
        for r in decode:
            r["step_vs_reduce_overhead"] = r["step_ms"] / peer_decode["step_ms"]
            r["host_vs_reduce_overhead"] = r["host_us"] / peer_decode["host_us"]
    kinds = {k: sum(s.kind == k for s in setup.steps) for k in ("prefill", "mixed", "decode", "spec")}
    by = {r["config"]: r for r in rows}
    fp, pw, none = (by[f"graphify {m}"]["tokens_per_s"] for m in ("FULL_AND_PIECEWISE", "PIECEWISE", "NONE"))
    return {"env": env, "rows": rows, "decode": decode,
            "ratios": {"fp_vs_piecewise": fp / pw, "fp_vs_none": fp / none},
            "trace": {"requests": num_requests, "seed": seed, "steps": len(setup.steps), "tokens": setup.tokens,
                      "step_kinds": kinds, "max_batch_tokens": setup.max_tokens},
            "config": {"model": "qwen2.5-0.5b-shape" if gpu else "tiny", "dtype": str(setup.cfg.dtype),
                       "attention": ATTENTION}}


COLUMNS = [("config", "configuration", "s"), ("tokens_per_s", "tokens/s", ".0f"), ("p50_ms", "p50 ms", ".3f"),
           ("p99_ms", "p99 ms", ".3f"), ("startup_s", "start-up s", ".2f"),
           ("startup_s_again", "start-up s, next process", ".2f"), ("graph_mib", "graph MiB", ".1f"),
           ("padding_waste_pct", "padding %", ".1f"), ("steps_full_pct", "FULL %", ".0f"),
           ("steps_piecewise_pct", "PIECEWISE %", ".0f"), ("steps_none_pct", "NONE %", ".0f"),
           ("uses_graphs", "uses graphs", "s"), ("max_err_vs_eager", "max err vs eager", ".3g")]
DECODE_COLUMNS = [("config", "batch-8 decode", "s"), ("kernels_per_step", "kernels/step", ".0f"), ("step_ms", "step ms", ".3f"),
                  ("step_vs_reduce_overhead", "step ÷ reduce-overhead", ".3f"), ("host_us", "host µs/step", ".1f"),
                  ("host_vs_reduce_overhead", "host ÷ reduce-overhead", ".3f"),
                  ("max_err_vs_eager", "max err vs eager", ".3g")]


def render(result: dict) -> str:
    lines = []
    if not result["env"]["gpu"]:
        lines.append("**CPU-only machine: tiny model on the simulation backend. These timings are not GPU timings.**\n")
    t = result["trace"]
    lines.append(f"Trace: {t['requests']} requests (seed {t['seed']}), {t['steps']} steps, {t['tokens']} tokens, "
                 f"at most {t['max_batch_tokens']} tokens a step; step kinds {t['step_kinds']}.\n")
    lines.append(table(result["rows"], COLUMNS))
    r = result["ratios"]
    lines.append(f"\nFULL_AND_PIECEWISE tokens/s: {r['fp_vs_piecewise']:.2f}x PIECEWISE, {r['fp_vs_none']:.2f}x NONE (eager).")
    if result["decode"]:
        lines.append("\nBatch-8 decode step (KV length 256): kernels a step (torch.profiler, inside graph replays too), "
                     "step time with CUDA events over back-to-back steps; host µs to issue one step while the device "
                     "is busy (medians).\n")
        lines.append(table(result["decode"], DECODE_COLUMNS))
    slow = [(r["config"], r["slowest"]) for r in result["rows"] if r.get("slowest")]
    if slow:
        lines.append("\nSlowest steps (step index, kind, tokens, requests, ms, where it ran):\n")
        for config, steps in slow:
            lines.append(f"- {config}: " + "; ".join(
                f"#{s['step']} {s['kind']} {s['tokens']} tok / {s['reqs']} req {s['ms']:.2f} ms"
                + (f" ({s['ran_as']})" if s.get("ran_as") else "") for s in steps))
    lines.append("\nStart-up: for graphify split + capture, then its first pass over the trace less a steady pass "
                 "(what the first calls pay once); for torch.compile its first pass over the trace "
                 "(compile, recompiles, graph recordings) less a steady pass; 'next process': the same in a new "
                 "process on this machine, torch's compile caches on disk warm (the FULL + inductor row's own start-up "
                 "is warm too: its pieces are the row above's compiles). Graph MiB: graphify's pool as its "
                 "allocator counts it; torch.compile's growth of torch.cuda.memory_reserved(). Max err: largest "
                 "|logit - eager| over every step (bf16 on the GPU; inductor rounds differently).")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-only", choices=("graphify", "graphify-full", "ro"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.startup_only:
        import json

        print(json.dumps(startup_only(args.startup_only, args.requests, args.seed)), flush=True)
        return {}
    result = run(args.requests, args.seed)
    markdown = render(result)
    env = result["env"]
    title = (f"serving trace, {result['config']['model']} on {env['device']}, torch {env['torch']}"
             + ("" if env["gpu"] else " (CPU simulation: not GPU timings)"))
    png = plot_serving(result["rows"], RESULTS / f"serving-{device_slug(env)}.png", title)
    if png is not None:
        markdown += f"\n\n![throughput and p99 by configuration]({png.name})"
    publish("serving", result, markdown)
    if png is None:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
