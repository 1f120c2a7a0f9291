"""Where a decode token's time goes inside transformers' `generate()`, by clocks, ours beside
transformers' own compile.

A token of `generate()` is the host's work before the graph's launch plus the GPU's step:
transformers' stop check syncs every step, so nothing the host does before the launch
overlaps the GPU. `hf_generate` times whole calls, and these hosts move tens of percent within
a minute; this splits each decode step of a 64-token call by clocks (no profiler, which
stretches graph launches) into:

    period        launch to next launch, µs: what a token costs
    pre-launch    the forward call's entry to the graph's launch: graphify's own (or the
                  peer's dynamo guards and CUDA graph trees' checks)
    post          the launch's return to the forward call's exit
    between       the forward's exit to the next call's entry: transformers' own step
                  (prepare_inputs_for_generation, its mask, logits processing, the stop check)
    prepare       prepare_inputs_for_generation alone
    GPU graph     CUDA events around the launch: the GPU's step (CUDA only)
    GPU gap       one graph's end to the next one's start on the GPU (CUDA only)

Medians over a call's decode steps, then the median call of `--reps`. Each configuration runs
in a process of its own, its compiled graphs in place before the clocked calls (the
background line waits for its worker). On a machine without a GPU: a tiny config on the
simulation backend, the launch being the simulated replay, host columns only.

    python -m benchmarks.hf_step_split [--models qwen0.5b] [--batches 1 8] [--configs graphify_background hf_compile]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time

import torch

from ._report import environment, publish, run_process, table, worker_arguments
from .hf_generate import CONFIGS, PEER, SHAPES, background_failure_raises, build, generate, one_line

COLUMNS = [
    ("model", "model", ""), ("batch", "B", "d"), ("config", "configuration", ""),
    ("ms_per_token", "ms/token (call)", ".3f"), ("period_us", "period µs", ".0f"), ("vs_peer", "÷ peer", ".2f"),
    ("pre_launch_us", "pre-launch µs", ".0f"), ("post_us", "post µs", ".0f"), ("between_us", "between µs", ".0f"),
    ("prepare_us", "prepare µs", ".0f"), ("gpu_graph_us", "GPU graph µs", ".0f"), ("gpu_gap_us", "GPU gap µs", ".0f"),
    ("full_checks_per_call", "watch's full compares / forward call", ".2f"),
]


def full_checks(forward) -> int | None:
    """How many full comparisons graphify's watches have made so far over every structure of
    `forward` (None for a forward that is not graphify's). The per-call check compares every
    edge only when something it watches moved; if a decode step moves something each call,
    every call pays the full comparison, which this counts."""
    first_use = getattr(forward, "_first_use", None)
    if first_use is None:
        return None
    total = 0
    for structure in first_use.structures:
        table = getattr(getattr(structure, "runtime", None), "table", None)
        watch = getattr(getattr(table, "reads", None), "watch", None)
        total += getattr(watch, "verified", 0)
    return total


class Clocks:
    """Marks, in call order: a forward call's entry and exit, a graph's launch and its return
    (with CUDA events on a GPU), and prepare_inputs_for_generation's host time."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks, self.prepare = cuda, [], []

    def launch(self, replay):
        """`replay` (a graph's replay method) with its launch clocked."""
        @functools.wraps(replay)
        def clocked(graph, *args, **kwargs):
            start = end = None
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.marks.append(("launch", time.perf_counter(), start))
            if start is not None:
                start.record()
            out = replay(graph, *args, **kwargs)
            if end is not None:
                end.record()
            self.marks.append(("launched", time.perf_counter(), end))
            return out
        return clocked

    def call(self, fn):
        """`fn` (a forward's call) with its entry and exit clocked."""
        @functools.wraps(fn)
        def clocked(*args, **kwargs):
            self.marks.append(("enter", time.perf_counter(), None))
            try:
                return fn(*args, **kwargs)
            finally:
                self.marks.append(("exit", time.perf_counter(), None))
        return clocked

    def timed(self, fn):
        """`fn` (prepare_inputs_for_generation) with its host time kept."""
        @functools.wraps(fn)
        def clocked(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.prepare.append(time.perf_counter() - t0)
        return clocked

    def split(self) -> dict:
        """Per-step medians (µs) of the decode steps since the last `clear()`: forward calls
        that launched a graph, the first of them left out (a call's first decode step)."""
        steps, cur = [], None
        for kind, t, event in self.marks:
            if kind == "enter":
                cur = {"enter": t}
                steps.append(cur)
            elif cur is not None and kind not in cur:
                cur[kind] = (t, event) if kind.startswith("launch") else t
        steps = [s for s in steps if "launch" in s and "launched" in s and "exit" in s][1:]
        if len(steps) < 3:
            raise RuntimeError(f"{len(steps)} clocked decode steps with a graph launch: too few to split")
        pairs = list(zip(steps, steps[1:]))
        med = statistics.median
        out = {
            "period_us": med((b["launch"][0] - a["launch"][0]) * 1e6 for a, b in pairs),
            "pre_launch_us": med((s["launch"][0] - s["enter"]) * 1e6 for s in steps),
            "post_us": med((s["exit"] - s["launched"][0]) * 1e6 for s in steps),
            "between_us": med((b["enter"] - a["exit"]) * 1e6 for a, b in pairs),
            "prepare_us": med(self.prepare[1:]) * 1e6 if len(self.prepare) > 1 else None,
        }
        if self.cuda:
            torch.cuda.synchronize()
            out["gpu_graph_us"] = med(s["launch"][1].elapsed_time(s["launched"][1]) * 1e3 for s in steps)
            out["gpu_gap_us"] = med(a["launched"][1].elapsed_time(b["launch"][1]) * 1e3 for a, b in pairs)
        return out

    def clear(self) -> None:
        self.marks.clear()
        self.prepare.clear()


def run_config(name: str, shape: str, batches, new: int, reps: int) -> list[dict]:
    """One configuration at every batch size, in this process."""
    cuda = torch.cuda.is_available()
    background_failure_raises()
    clocks = Clocks(cuda)
    if cuda:  # before any capture: graphs keep the replay method they were captured with
        torch.cuda.CUDAGraph.replay = clocks.launch(torch.cuda.CUDAGraph.replay)
    else:
        from graphify.backends import sim

        sim.Tape.replay = clocks.launch(sim.Tape.replay)
    model = build(shape, "cuda" if cuda else "cpu")
    one_line(name, model)
    if name.startswith("graphify"):  # at class level: a new model.forward would be a new function to graphify
        cls = type(model.forward)
        cls.__call__ = clocks.call(cls.__call__)
    else:
        compiled_call = model.get_compiled_call
        model.get_compiled_call = lambda *a, **k: clocks.call(compiled_call(*a, **k))
    # at class level too: the background line sends the model to its compile worker, which
    # could not rebuild a clock set on the instance
    model_cls = type(model)
    model_cls.prepare_inputs_for_generation = clocks.timed(model_cls.prepare_inputs_for_generation)
    rows = []
    for batch in batches:
        ids = torch.randint(0, model.config.vocab_size, (batch, 128 if cuda else 8),
                            generator=torch.Generator().manual_seed(batch)).to(model.device)
        generate(model, name, ids, new)
        if name == "graphify_background":
            model.forward.wait_compiles()
        for _ in range(2):
            generate(model, name, ids, new)
        calls = []
        for _ in range(reps):
            clocks.clear()
            checks = full_checks(model.forward)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            generate(model, name, ids, new)
            if cuda:
                torch.cuda.synchronize()
            took = (time.perf_counter() - t0) * 1e3 / new
            forwards = sum(kind == "enter" for kind, _, _ in clocks.marks)
            if checks is not None and forwards:
                checks = (full_checks(model.forward) - checks) / forwards
            calls.append({"ms_per_token": took, **clocks.split(), "full_checks_per_call": checks})
        median = sorted(calls, key=lambda c: c["period_us"])[len(calls) // 2]
        rows.append({"model": shape, "batch": batch, "key": name, "config": CONFIGS[name], **median,
                     "calls": calls})
    return rows


def main(argv=None) -> None:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen0.5b"] if gpu else ["tiny-qwen"], choices=sorted(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8] if gpu else [2])
    parser.add_argument("--configs", nargs="+", default=["graphify_background", PEER] if gpu else ["graphify"],
                        choices=sorted(CONFIGS))
    parser.add_argument("--new-tokens", type=int, default=64 if gpu else 12)
    parser.add_argument("--reps", type=int, default=5 if gpu else 2)
    worker_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        rows = run_config(args.worker, args.models[0], args.batches, args.new_tokens, args.reps)
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return
    if not gpu and PEER in args.configs:
        parser.error("transformers' own compile makes no CUDA graphs without a GPU: leave hf_compile out on the CPU")
    rows, failures = [], []
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
        for shape in args.models:
            for name in args.configs:
                print(f"{shape}: {name} ...", flush=True)
                cmd = [sys.executable, "-m", "benchmarks.hf_step_split", "--worker", name, "--models", shape,
                       "--batches", *map(str, args.batches), "--new-tokens", str(args.new_tokens),
                       "--reps", str(args.reps), "--out", out.name]
                failed = run_process(cmd, f"{name} on {shape}", args.timeout)
                if failed:
                    failures.append(failed)
        rows = [json.loads(line) for line in out.read().splitlines()]
    peers = {(r["model"], r["batch"]): r for r in rows if r["key"] == PEER}
    for r in rows:
        ref = peers.get((r["model"], r["batch"]))
        if ref is not None:
            r["vs_peer"] = r["period_us"] / ref["period_us"]
    import transformers

    env = {**environment(), "transformers": transformers.__version__}
    lines = [f"transformers {transformers.__version__}; a {args.new_tokens}-token greedy generate(), static cache; "
             f"µs per decode step, medians (the median call of {args.reps})."
             + ("" if gpu else " CPU simulation: host columns only, not GPU timings."), "", table(rows, COLUMNS)]
    lines += [f"\nFailed: {f}" for f in failures]
    publish("hf-step-split" + (f"-{args.tag}" if args.tag else ""),
            {"env": env, "rows": rows, "failures": failures, "new_tokens": args.new_tokens}, "\n".join(lines))
    for f in failures:
        print(f, file=sys.stderr)


if __name__ == "__main__":
    main()
