"""Start-up benchmark: split + capture seconds and pool memory against model and schedule size.

On a GPU: the varlen decoder (unified attention as the split op) at the Qwen2.5-0.5B and
Llama-3-8B shapes (bf16, random weights), FULL_AND_PIECEWISE over vLLM's schedule with 11,
51 and 67 sizes, captured largest first into one pool. Beside each capture, the floor: a
hand-written loop of the same graphs (every graph piece and one FULL graph per size,
`torch.cuda.graph` into one shared pool, one warm-up each, no checks, no state restored).
Every graphify table is checked against eager on a decode and a mixed batch.

The tracing modules (torch.fx, sympy, dynamo, ...) are imported and a tiny model traced
before the clock starts, and that set-up is reported on its own: a process pays it once,
whatever it traces.

On a CPU-only machine: the tiny model on the simulation backend (not GPU timings).

    python -m benchmarks.startup [--models 0.5b 8b] [--sizes 11 51 67] [--no-floor]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from graphify import graphify, vllm_sizes
from graphify.models import BatchLayout, DecoderConfig, init_params, model_support, new_paged_cache, split_ops, varlen_axes, varlen_step
from graphify.transforms import split

from ._report import environment, publish, sync, table

ATTENTION = "unified"
MAX_SIZE = {7: 32, 11: 64, 19: 128, 35: 256, 51: 512, 67: 768, 83: 1024}  # schedule length -> largest size
MiB = 1 << 20


def tracing_setup() -> float:
    """Seconds to import what split's tracing needs and trace a tiny model once: a process
    pays this once, whatever it traces (the first trace loads hundreds of modules), so it is
    reported on its own instead of landing on whichever model is traced first. Timed once, by
    hand: it happens once per process."""
    t0 = time.perf_counter()
    tiny = Model("tiny", gpu=False)
    split(tiny.step, split_ops(ATTENTION), *tiny.example, axes=varlen_axes())
    return time.perf_counter() - t0


class Model:
    """Weights, paged cache and the example call of one model shape."""

    def __init__(self, name: str, gpu: bool):
        self.name, self.device = name, ("cuda" if gpu else "cpu")
        if not gpu or name == "tiny":
            self.cfg = DecoderConfig.tiny(max_seq_len=128)
        elif name == "8b":
            self.cfg = DecoderConfig.llama3_8b(max_seq_len=2048)
        else:
            self.cfg = DecoderConfig.qwen2_5_0_5b(max_seq_len=2048)
        self.block = 16 if gpu else 4
        self.max_blocks = self.cfg.max_seq_len // self.block
        self.step = varlen_step(self.cfg, init_params(self.cfg, seed=0, device=self.device), ATTENTION)
        self.cache = new_paged_cache(self.cfg, 1100 if gpu else 200, self.block, device=self.device, seed=1)
        self.example = (*self.layout((3, 1, 5), (4, 7, 0)).build(self.cfg, device=self.device), self.cache)

    def layout(self, q, ctx) -> BatchLayout:
        return BatchLayout(tuple(q), tuple(ctx), block_size=self.block, max_blocks=self.max_blocks)

    def batch(self, q, ctx, seed: int) -> tuple:
        return (*self.layout(q, ctx).build(self.cfg, device=self.device, seed=seed), self.cache)


def timed(fn):
    """(fn(), seconds), the device synchronised at both ends: start-up is timed once, by hand."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def graphify_startup(model: Model, pw, sizes) -> dict:
    g = graphify(pw, mode="FULL_AND_PIECEWISE", sizes=sizes, axes=varlen_axes(), support=model_support(ATTENTION))
    g, seconds = timed(lambda: g.capture(*model.example))
    report = g.table.pool.report()
    errors = []
    with torch.inference_mode():
        for q, ctx in (((1,) * 8, (30,) * 8), ((6, 1, 1, 2), (0, 9, 20, 3))):
            batch = model.batch(q, ctx, seed=len(q))
            ref = model.step(*batch).float()
            errors.append((g(*batch).float() - ref).abs().max().item())
    row = {"graphs": len(g.table), "graphify_s": seconds, "graphify_mib": report.reserved_bytes / MiB,
           "max_err": max(errors), "per_graph_ms": 1e3 * seconds / len(g.table)}
    print(f"  {g.summary()}", file=sys.stderr)
    g.release()
    del g
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


class _CapturePieces(torch.fx.Interpreter):
    """Runs the stitching program once, capturing each graph piece on first sight."""

    def __init__(self, pw, pool, stream, graphs: list):
        super().__init__(pw.program)
        self.graph_pieces = {p.name for p in pw.pieces if p.kind == "graph"}
        self.pool, self.stream, self.graphs = pool, stream, graphs

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        if target not in self.graph_pieces:
            return module(*args, **kwargs)
        return hand_capture(lambda: module(*args, **kwargs), self.pool, self.stream, self.graphs)


def hand_capture(fn, pool, stream, graphs: list):
    """What a careful hand-written loop does per graph: warm up once, capture into the pool."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()
    graphs.append(graph)
    return out


def floor_startup(model: Model, pw, sizes) -> dict:
    """The same graphs by hand: per size (largest first) every piece, then one FULL graph."""
    from graphify.backends.torch_cuda import TorchCudaBackend

    pool, stream, graphs = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), []
    batches = {n: model.batch((1,) * n, (7,) * n, seed=n) for n in sizes}  # inputs made before the clock

    def run():
        with torch.no_grad():
            for n in sorted(sizes, reverse=True):
                _CapturePieces(pw, pool, stream, graphs).run(*batches[n])
            for n in sorted(sizes, reverse=True):
                hand_capture(lambda: pw(*batches[n]), pool, stream, graphs)

    _, seconds = timed(run)
    mib = TorchCudaBackend().usage(pool)[0] / MiB
    count = len(graphs)
    graphs.clear()
    batches.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return {"floor_s": seconds, "floor_mib": mib, "floor_graphs": count}


def run(models=("0.5b", "8b"), schedules=(11, 51, 67), floor: bool = True) -> dict:
    env = environment()
    gpu = env["gpu"]
    imports = tracing_setup()
    rows, cold = [], []
    for name in models if gpu else ("tiny",):
        model = Model(name, gpu)
        pw, split_s = timed(lambda: split(model.step, split_ops(ATTENTION), *model.example, axes=varlen_axes()))
        counts = schedules if gpu else (7, 11)
        # Kernels compiled on first use (the Triton attention, per shape specialisation) are
        # cached on disk across processes: compile them once here, so the timed captures show
        # what every start-up after a machine's first sees; this first capture is reported too.
        first = graphify_startup(model, pw, vllm_sizes(MAX_SIZE[max(counts)]))
        cold.append({"model": name, "sizes": len(vllm_sizes(MAX_SIZE[max(counts)])), "seconds": first["graphify_s"]})
        for count in counts:
            sizes = vllm_sizes(MAX_SIZE[count])
            row = {"model": name, "sizes": len(sizes), "largest": sizes[-1], "split_s": split_s,
                   "graph_pieces": pw.num_graph_pieces}
            row.update(graphify_startup(model, pw, sizes))
            row["startup_s"] = split_s + row["graphify_s"]
            if floor and gpu:
                row.update(floor_startup(model, pw, sizes))
                row["capture_vs_floor"] = row["graphify_s"] / row["floor_s"]
                row["mib_vs_floor"] = row["graphify_mib"] / row["floor_mib"]
            rows.append(row)
            print(f"  {row}", file=sys.stderr)
        del model, pw
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    return {"env": env, "import_s": imports, "rows": rows, "cold_first_capture": cold}


COLUMNS = [
    ("model", "model", "s"), ("sizes", "sizes", "d"), ("graphs", "graphs", "d"),
    ("split_s", "split s", ".2f"), ("graphify_s", "capture s", ".2f"), ("startup_s", "start-up s", ".2f"),
    ("per_graph_ms", "ms per graph", ".1f"), ("floor_s", "hand loop s", ".2f"), ("capture_vs_floor", "capture / hand", ".2f"),
    ("graphify_mib", "pool MiB", ".0f"), ("floor_mib", "hand pool MiB", ".0f"), ("max_err", "max err vs eager", ".3g"),
]


def render(result: dict) -> str:
    lines = []
    if not result["env"]["gpu"]:
        lines.append("**CPU-only machine: tiny model on the simulation backend. Not GPU timings.**\n")
    lines.append(
        f"FULL_AND_PIECEWISE over vLLM's schedule, largest first, one pool. Start-up = split + capture; "
        f"the process's one-time tracing set-up (imports and a first tiny trace: {result['import_s']:.2f} s here) is not in it. 'Hand loop' captures "
        f"the same graphs with `torch.cuda.graph` (one warm-up each, no checks, no state restored).\n"
    )
    lines.append(table(result["rows"], COLUMNS))
    lines.append(
        "\nThe machine's first capture of each model (Triton compiling the attention kernel's shape "
        "specialisations, then cached on disk; not in the table): "
        + ", ".join(f"{c['model']} {c['sizes']} sizes {c['seconds']:.2f} s" for c in result["cold_first_capture"])
    )
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for color, name in zip(("#4c72b0", "#dd8452", "#55a868"), dict.fromkeys(r["model"] for r in result["rows"])):
        rows = [r for r in result["rows"] if r["model"] == name]
        xs = [r["sizes"] for r in rows]
        ax.plot(xs, [r["startup_s"] for r in rows], "o-", color=color, label=f"graphify {name} (split + capture)")
        if all("floor_s" in r for r in rows):
            ax.plot(xs, [r["split_s"] + r["floor_s"] for r in rows], "s--", color=color,
                    label=f"hand loop {name} (same split + torch.cuda.graph loop)")
    ax.set_xlabel("captured sizes (FULL_AND_PIECEWISE: 2 graphs per size)")
    ax.set_ylabel("start-up seconds")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["0.5b", "8b"], choices=["0.5b", "8b"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[11, 51, 67], choices=sorted(MAX_SIZE))
    parser.add_argument("--no-floor", action="store_true", help="skip the hand-written capture loop")
    args = parser.parse_args(argv)
    from ._report import RESULTS, device_slug

    result = run(tuple(args.models), tuple(args.sizes), floor=not args.no_floor)
    plot(result, RESULTS / f"startup-{device_slug(result['env'])}.png")
    publish("startup", result, render(result))  # render before publish: publish takes the env out
    return result


if __name__ == "__main__":
    main()
