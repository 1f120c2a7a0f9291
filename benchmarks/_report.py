"""Shared benchmark plumbing: environment stamp, timing, tables and result files."""

from __future__ import annotations

import argparse
import atexit
import collections
import datetime as _dt
import itertools
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils.benchmark import Timer

# where results are written: benchmarks/results/, or BENCH_RESULTS (a device run writing while
# the tests, which read benchmarks/results/, run beside it)
RESULTS = Path(os.environ.get("BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def environment() -> dict:
    """Device, date and versions, stamped on every result file."""
    import graphify

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "gpu": cuda,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "graphify": graphify.__version__,
    }


def device_slug(env: dict) -> str:
    if not env["gpu"]:
        return "cpu-sim"
    return re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_per_call(fn: Callable[[int], object], *, calls: int = 10, reps: int = 30, warmup: int = 5) -> float:
    """Median over `reps` of the time per call (ms) of `calls` back-to-back calls `fn(i)`
    (i counts the calls), after `warmup` calls: `torch.utils.benchmark.Timer`, whose clock
    synchronises the device before each reading. Fixed counts (`Timer.timeit`), not
    `blocked_autorange`: the ranks of a tensor-parallel job must make the same calls, and
    callers bound a slow configuration's time by them."""
    count = itertools.count()
    for _ in range(warmup):
        fn(next(count))
    timer = Timer("fn(next(count))", globals={"fn": fn, "count": count}, num_threads=torch.get_num_threads())
    return statistics.median(timer.timeit(calls).mean for _ in range(reps)) * 1e3


def replay_us(replay: Callable[[], object], graphed: bool, reps: int, warmup: int) -> list[float]:
    """µs of each of `reps` calls of `replay` after `warmup` untimed ones: CUDA events between
    calls queued back to back, one sync at the end (`graphed`), else the host clock."""
    for _ in range(warmup):
        replay()
    if not graphed:
        per = []
        for _ in range(reps):
            t0 = time.perf_counter()
            replay()
            per.append((time.perf_counter() - t0) * 1e6)
        return per
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    events[0].record()
    for i in range(reps):
        replay()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(reps)]


def host_costs_us(fns: "dict[str, Callable[[int], object]]", *, reps: int = 400) -> dict[str, float]:
    """Median host µs per call of each of `fns`, each call issued with the device idle,
    measured interleaved (one call of each per round, the order rotating): a graph
    launch's host cost drifts with the machine's state within a run, so only calls timed
    side by side give ratios that mean something. A host clock by hand: `Timer`'s clock
    would wait for the device, and this is the host's part alone."""
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            sync()
            t0 = time.perf_counter()
            fns[name](r)
            samples[name].append((time.perf_counter() - t0) * 1e6)
    sync()
    return {name: statistics.median(v) for name, v in samples.items()}


def host_pipelined_us(fn: Callable[[int], object], *, calls: int = 4, reps: int = 50) -> float:
    """Median host time (µs) per call to issue `calls` calls back to back while the device
    is still busy with earlier ones: what a serving loop pays on the CPU per step. A host
    clock by hand: `Timer`'s clock would wait for the device at the end."""
    samples = []
    for r in range(reps):
        sync()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(r * calls + i)
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
    sync()
    return statistics.median(samples)


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A Markdown table; `columns` are (key, header, format spec)."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = [
        "| " + " | ".join(("-" if r.get(k) is None else format(r[k], f)) for k, _, f in columns) + " |" for r in rows
    ]
    return "\n".join([head, rule, *body])


def publish(name: str, result: dict, markdown: str) -> tuple[Path, Path]:
    """Write `result` (its "env" stamped on top) and `markdown`, then print the table."""
    paths = write(name, result.pop("env"), result, markdown)
    print(markdown)
    print(f"\nwrote {paths[0]} and {paths[1]}")
    return paths


def write(name: str, env: dict, payload: dict, markdown: str) -> tuple[Path, Path]:
    """Write `<name>-<device>.json` and `.md` under benchmarks/results/."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"{name}-{device_slug(env)}"
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps({"environment": env, **payload}, indent=2) + "\n")
    stamp = ", ".join(f"{k} {v}" for k, v in env.items() if k != "gpu" and v is not None)
    md_path.write_text(f"# {name}\n\n{stamp}\n\n{markdown}\n")
    return json_path, md_path


def run_process(cmd: list, what: str, timeout: float, env: dict | None = None) -> str | None:
    """Run a benchmark's worker process; None where it succeeded, else what failed (its
    stderr's tail), for the result's failures."""
    try:
        done = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True, env=env)
    except subprocess.TimeoutExpired:
        return f"{what}: timed out after {timeout} s"
    return None if done.returncode == 0 else f"{what}: exit {done.returncode}: {done.stderr.strip()[-600:]}"


def worker_arguments(parser, timeout: int = 900) -> None:
    """The options every benchmark with a process per configuration takes: the worker's limit,
    the result's tag, and the hidden ones a worker is started with."""
    parser.add_argument("--timeout", type=int, default=timeout)
    parser.add_argument("--tag", default="", help="a suffix for the result files (a second run: 'run2')")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


def fresh_compile_caches() -> None:
    """Point inductor's and Triton's on-disk caches at new empty folders (removed when the
    process exits) and clear inductor's in-memory caches: what compiles next compiles cold."""
    for var, prefix in (("TORCHINDUCTOR_CACHE_DIR", "inductor-"), ("TRITON_CACHE_DIR", "triton-")):
        folder = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        os.environ[var] = folder
    from torch._inductor import utils

    if hasattr(utils, "clear_caches"):  # what inductor's own fresh_cache() does
        utils.clear_caches()


def cuda_spans(call, steps: int = 5) -> list[tuple[float, float, str]]:
    """(start µs, end µs, kernel name) of every GPU activity over `steps` back-to-back calls
    (torch.profiler, which sees the kernels inside graph replays), after one unprofiled call."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            call()
        torch.cuda.synchronize()
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


# the data sheets' peak HBM bandwidth, by a part of the GPU's name; first match wins (the SXM parts last)
PEAK_HBM_BYTES_S = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12))


def peak_bandwidth(device: torch.device) -> float | None:
    """Peak HBM bytes/s of `device`'s GPU, from its name (None: a GPU not in the table, or the CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in PEAK_HBM_BYTES_S if key in name), None)


def kernels(call, steps: int = 5) -> tuple[float, float, float, list[tuple[str, int, float]]]:
    """(kernels per step, GPU ms per step, GPU idle µs per step, top kernels (name,
    count/step, µs/step)). Idle is the time between one kernel's end and the next one's
    start over back-to-back steps: what a graph's launch gaps cost, not its kernels."""
    return summarise(cuda_spans(call, steps), steps)


def summarise(spans: Sequence[tuple[float, float, str]], steps: int, top: int | None = 12,
              width: int | None = 70) -> tuple[float, float, float, list[tuple[str, float, float]]]:
    """`kernels`' figures from `cuda_spans`' spans over `steps` calls: the `top` kernels of
    most time (every kernel: None), their names cut to `width` characters (whole: None)."""
    by = collections.defaultdict(lambda: [0, 0.0])
    for start, end, name in spans:
        by[name][0] += 1
        by[name][1] += end - start
    count = sum(c for c, _ in by.values()) / steps
    gpu_us = sum(t for _, t in by.values()) / steps
    most = sorted(((n[:width], c / steps, t / steps) for n, (c, t) in by.items()), key=lambda r: -r[2])[:top]
    return count, gpu_us / 1e3, idle_between([(a, b) for a, b, _ in spans]) / steps, most


def idle_between(spans: Sequence[tuple[float, float]]) -> float:
    """Total time inside the union of (start, end) spans' extent that no span covers."""
    idle, end = 0.0, None
    for start, stop in sorted(spans):
        if end is not None:
            idle += max(start - end, 0.0)
        end = stop if end is None else max(end, stop)
    return idle
