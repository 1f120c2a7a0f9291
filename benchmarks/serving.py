"""The main job: the varlen reference model through one seeded synthetic serving trace
(`benchmarks/trace.py`: arrivals over time, chunked prefills mixed with decodes, batch
sizes from 1 up, some speculative-decode steps) under every graphify mode, graphify over
inductor-compiled pieces (FULL_AND_PIECEWISE and FULL), and torch.compile(mode="reduce-overhead"); then a batch-8
decode step of the peers side by side. The graphify modes run in this process; the
peer-compared configurations (graphify + inductor, reduce-overhead) each in a process of
their own, twice (the 1st with torch's compile caches on disk as the processes before it
left them, the 2nd loading its own compiles from them).

Per configuration: tokens per second, step latency p50/p99, start-up seconds (split +
capture), graph pool MiB, padding waste, share of steps per runtime mode, and the largest
difference to eager over the trace (checked step by step against an eager copy of the
cache). On a GPU: the Qwen2.5-0.5B-shaped model; on a CPU-only machine the tiny one through
the simulation backend, and the timings say so.

Output: a table in the terminal; Markdown, JSON and a PNG plot (throughput and p99 by
configuration) under benchmarks/results/, stamped with device, date and versions.

    python -m benchmarks.serving [--requests 48] [--seed 0] [--specialise-from 256] [--fresh-caches]

One configuration alone, e.g. to weigh specialised compiles against cold start on one machine:
`python -m benchmarks.serving --own-process graphify --out a.json --fresh-caches --specialise-from 1024`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from graphify import Mode

from ._plot import plot_serving
from ._report import (RESULTS, device_slug, environment, fresh_compile_caches, host_pipelined_us, kernels, publish, table,
                      time_per_call)
from ._serving_trace import (ATTENTION, MODES, SPECIALISE_FROM, STEP_KINDS, Setup, _percentile, decode_rows, ms_by_kind,
                             run_trace, slowest_steps, step_kinds, step_timer)

def graphify_row(setup: Setup, mode: str, timed, inductor: bool = False) -> tuple[dict, object]:
    name = f"graphify {mode}" + (" + inductor" if inductor else "")  # compiled pieces, specialised sizes
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
        "ms_by_kind": ms_by_kind(setup, latencies),
    }, g


def graphify_start(setup: Setup, mode: str, inductor: bool, timed, name: str = "graphify"):
    """(g, start-up s, largest error, steady latencies): split and capture, then two passes
    over the trace. Start-up counts what the first pass paid once (kernels loaded or
    specialised on first launch, handles, first replays) as reduce-overhead's does."""
    g, startup = setup.graphify(mode, inductor)
    t0 = time.perf_counter()  # whole passes over the trace, each once: start-up, not a repeated call
    worst, _ = run_trace(setup, g, name, timed)
    first_pass = time.perf_counter() - t0
    g.stats.reset()
    t0 = time.perf_counter()
    worst2, latencies = run_trace(setup, g, name, timed)
    startup += max(first_pass - (time.perf_counter() - t0), 0.0)
    return g, startup, max(worst, worst2), latencies


OWN_PROCESS = {  # the peer-compared configurations, each run in a process of its own
    "graphify": "graphify FULL_AND_PIECEWISE + inductor",
    "graphify-full": "graphify FULL + inductor",
    "ro": "torch.compile reduce-overhead",
}


def in_own_process(which: str, num_requests: int, seed: int, specialise_from: int = SPECIALISE_FROM) -> dict | None:
    """`own_process_run(which)` in a new process on this machine: {"row", "decode"}, or None
    if it failed. Each peer-compared configuration runs alone, as a user runs one: a process
    that ran other configurations first steps slower (batch-8 decode 1.26-1.27 ms for
    graphify + inductor and 1.29-1.30 for reduce-overhead in one process, against 1.16 and
    1.21 each alone, one H100), and graphs of inductor kernels captured by graphify crash
    (illegal address) once reduce-overhead has compiled the same code in the same process."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/{which}.json"
        try:
            done = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--own-process", which, "--out", out,
                                   "--requests", str(num_requests), "--seed", str(seed),
                                   "--specialise-from", str(specialise_from)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
            if done.returncode != 0:
                print(f"{which} in its own process failed: {done.stderr[-800:]}", file=sys.stderr)
                return None
            with open(out) as f:
                return json.load(f)
        except (subprocess.TimeoutExpired, OSError, json.JSONDecodeError) as e:  # the run goes on without this row
            print(f"{which} in its own process gave no result: {e!r}", file=sys.stderr)
            return None


def own_process_run(which: str, num_requests: int, seed: int, specialise_from: int = SPECIALISE_FROM) -> dict:
    """The body of `in_own_process`: one configuration's row (start-up, tokens/s, p99) and
    its batch-8 decode rows."""
    setup = Setup(True, num_requests, seed, specialise_from)
    timed = step_timer(True)
    name = OWN_PROCESS[which]
    if which == "ro":
        from .peers import reduce_overhead_row

        row, call = reduce_overhead_row(setup, timed)
    else:
        row, call = graphify_row(setup, "FULL_AND_PIECEWISE" if which == "graphify" else "FULL", timed, inductor=True)
    rows = decode_rows(setup, {name: call}, 8)
    if which == "graphify":  # the same, with the batch already in graphify's static buffers
        rows.append(static_inputs_row(setup, call, 8, name))
    return {"row": row, "decode": rows}


def static_inputs_row(setup: Setup, g, b: int, name: str) -> dict:
    """Batch-`b` decode of graphify `g` (row `name`) with the batch already in its static
    buffers: the step without the input copies."""
    static = g.static_inputs(b, b)
    batch = setup.decode_batch(b)
    for dst, src in zip(static, batch):
        dst.copy_(src)
    with torch.inference_mode():
        ref = setup.step(*batch, setup.cache).float()
        err = (g(*static).float() - ref).abs().max().item()
        row = {"config": f"{name}, static inputs", "step_ms": time_per_call(lambda i: g(*static)),
               "host_us": host_pipelined_us(lambda i: g(*static)), "max_err_vs_eager": err}
        row["kernels_per_step"], _, row["gpu_idle_us"], _ = kernels(lambda: g(*static))  # last: the profiler slows what follows
        return row


def merge_own_processes(rows: list, decode: list, runs: list) -> None:
    """Add each (which, "1st" | "2nd", result or None) run's row and decode rows, marked by
    process, with ratios against reduce-overhead's run in the same process kind (eager's and
    this process's decode rows: against its 1st); decode rows ordered eager, peer, ours."""
    peer = {}
    for which, process, result in runs:
        if result is None:
            continue
        for r in [result["row"], *result["decode"]]:
            r["process"] = process
        rows.append(result["row"])
        decode.extend(result["decode"])
        if which == "ro":
            peer[process] = (result["row"], result["decode"][0])
    for r in rows:
        if r.get("process") in peer:
            r["tokens_vs_reduce_overhead"] = r["tokens_per_s"] / peer[r["process"]][0]["tokens_per_s"]
    for r in decode:
        ro = peer.get(r.get("process", "1st"))
        if ro is not None:
            r["step_vs_reduce_overhead"] = r["step_ms"] / ro[1]["step_ms"]
            r["host_vs_reduce_overhead"] = r["host_us"] / ro[1]["host_us"]
    decode.sort(key=lambda r: (r["config"] != "eager", r["config"] != OWN_PROCESS["ro"]))


def run(num_requests: int = 48, seed: int = 0, specialise_from: int = SPECIALISE_FROM) -> dict:
    env = environment()
    gpu = env["gpu"]
    setup = Setup(gpu, num_requests, seed, specialise_from)
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
        decode = decode_rows(setup, {"eager": setup.step, "graphify FULL_AND_PIECEWISE": plain}, 8)
        del plain
        # The peer-compared configurations, each alone in a new process, twice: the 1st
        # process compiles with torch's on-disk caches as the processes before it left them,
        # the 2nd loads its own compiles from them: the first start, every start after. On
        # a fresh machine F&P + inductor's 1st compiles cold; FULL + inductor's 1st finds
        # F&P's compiles of the same pieces; reduce-overhead's 1st compiles its whole step
        # cold, though Triton kernels the pieces share with it may be on disk already. The reference model's
        # attention op captures into FULL graphs at every batch, so FULL graphs of the
        # compiled pieces serve mixed steps too.
        runs = [(which, process, in_own_process(which, num_requests, seed, specialise_from))
                for which in OWN_PROCESS for process in ("1st", "2nd")]
        merge_own_processes(rows, decode, runs)
    kinds = step_kinds(setup)
    by = {r["config"]: r for r in rows}
    fp, pw, none = (by[f"graphify {m}"]["tokens_per_s"] for m in ("FULL_AND_PIECEWISE", "PIECEWISE", "NONE"))
    return {"env": env, "rows": rows, "decode": decode,
            "ratios": {"fp_vs_piecewise": fp / pw, "fp_vs_none": fp / none},
            "trace": {"requests": num_requests, "seed": seed, "steps": len(setup.steps), "tokens": setup.tokens,
                      "step_kinds": kinds, "max_batch_tokens": setup.max_tokens},
            "config": {"model": "qwen2.5-0.5b-shape" if gpu else "tiny", "dtype": str(setup.cfg.dtype),
                       "attention": ATTENTION, "specialise_from": specialise_from}}


COLUMNS = [("config", "configuration", "s"), ("process", "process", "s"), ("tokens_per_s", "tokens/s", ".0f"),
           ("tokens_vs_reduce_overhead", "÷ reduce-overhead", ".3f"), ("p50_ms", "p50 ms", ".3f"),
           ("p99_ms", "p99 ms", ".3f"), ("startup_s", "start-up s", ".2f"), ("graph_mib", "graph MiB", ".1f"),
           ("padding_waste_pct", "padding %", ".1f"), ("steps_full_pct", "FULL %", ".0f"),
           ("steps_piecewise_pct", "PIECEWISE %", ".0f"), ("steps_none_pct", "NONE %", ".0f"),
           ("uses_graphs", "uses graphs", "s"), ("max_err_vs_eager", "max err vs eager", ".3g")]
DECODE_COLUMNS = [("config", "batch-8 decode", "s"), ("process", "process", "s"), ("kernels_per_step", "kernels/step", ".0f"),
                  ("gpu_idle_us", "GPU idle µs/step", ".0f"), ("step_ms", "step ms", ".3f"),
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
    kinds = [k for k in STEP_KINDS if t["step_kinds"].get(k)]
    by_kind = [{"config": r["config"], "process": r.get("process", ""),
                **{k: r["ms_by_kind"].get(k, 0.0) for k in kinds}} for r in result["rows"] if r.get("ms_by_kind")]
    if by_kind:
        lines.append("\nMilliseconds per step kind, summed over the timed pass (where each configuration gains or loses):\n")
        lines.append(table(by_kind, [("config", "configuration", "s"), ("process", "process", "s"),
                                     *((k, f"{k} ms", ".2f") for k in kinds)]))
    r = result["ratios"]
    lines.append(f"\nFULL_AND_PIECEWISE tokens/s: {r['fp_vs_piecewise']:.2f}x PIECEWISE, {r['fp_vs_none']:.2f}x NONE (eager).")
    if result["decode"]:
        lines.append("\nBatch-8 decode step (KV length 256): kernels a step (torch.profiler, inside graph replays too), "
                     "GPU idle: time between kernels (same profile); step time with CUDA events over back-to-back steps; host µs to issue one step while the device "
                     "is busy (medians).\n")
        lines.append(table(result["decode"], DECODE_COLUMNS))
    slow = [(r["config"] + (f" ({r['process']} process)" if r.get("process") else ""), r["slowest"])
            for r in result["rows"] if r.get("slowest")]
    if slow:
        lines.append("\nSlowest steps (step index, kind, tokens, requests, ms, where it ran):\n")
        for config, steps in slow:
            lines.append(f"- {config}: " + "; ".join(
                f"#{s['step']} {s['kind']} {s['tokens']} tok / {s['reqs']} req {s['ms']:.2f} ms"
                + (f" ({s['ran_as']})" if s.get("ran_as") else "") for s in steps))
    lines.append("\nStart-up: for graphify split + capture, then its first pass over the trace less a steady pass "
                 "(what the first calls pay once); for torch.compile its first pass over the trace "
                 "(compile, recompiles, graph recordings) less a steady pass. Process: the + inductor "
                 "configurations and torch.compile's each ran alone in a new process, twice, in the table's order: the "
                 "1st compiled with torch's on-disk caches as the processes before it left them (on a fresh machine "
                 "F&P + inductor's cold; FULL + inductor's found F&P's compiles of the same pieces; reduce-overhead's "
                 "whole-step compile its own, with Triton kernels it shares with the pieces possibly cached), the 2nd "
                 "loaded its own compiles from them; ÷ reduce-overhead compares with reduce-overhead's run in the same "
                 "process kind, and the rows without a process (this process) with its 1st. Graph MiB: graphify's pool as its "
                 "allocator counts it; torch.compile's growth of torch.cuda.memory_reserved(). Max err: largest "
                 "|logit - eager| over every step (bf16 on the GPU; inductor rounds differently).")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--specialise-from", type=int, default=SPECIALISE_FROM,
                        help="inductor pieces get a compile of their own at capture sizes of this many tokens and up "
                             "(each ~4 s of cold start; above 512: none)")
    parser.add_argument("--fresh-caches", action="store_true",
                        help="compile with empty inductor and Triton caches (what a fresh machine's first process pays)")
    parser.add_argument("--own-process", choices=tuple(OWN_PROCESS),
                        help="run only this peer-compared configuration (what the main job runs in a process of its own)")
    parser.add_argument("--out", help="with --own-process: the JSON file its result is written to")
    args = parser.parse_args(argv)
    if args.fresh_caches:  # before anything compiles; own processes inherit the folders
        fresh_compile_caches()
    if args.own_process and not args.out:
        parser.error("--own-process needs --out (the JSON file its result is written to)")
    if args.own_process:
        import json

        result = own_process_run(args.own_process, args.requests, args.seed, args.specialise_from)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return result
    result = run(args.requests, args.seed, args.specialise_from)
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
