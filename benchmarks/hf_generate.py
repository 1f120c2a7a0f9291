"""Hugging Face transformers greedy generation, side by side: eager, transformers' own recipe
(StaticCache + torch.compile reduce-overhead), graphify FULL over the eager forward, a
hand-written `torch.cuda.CUDAGraph` of the same decode step (its floor), and graphify FULL
over a torch.compile'd forward.

Random-weight models from configs (no downloads): the Qwen2.5-0.5B shape and the
Llama-3-8B shape, bf16, StaticCache; 128 new tokens after a 128-token prompt at B = 1, 8,
32. Per configuration: ms per decoded token with a host sync every step (a generation
loop's stopping check) and issued back to back; start-up (compile + capture); graph MiB;
and how many of the generated tokens equal eager's before the first divergence.

Each compiled configuration runs in a process of its own (inductor's compiled code and
CUDA graphs of another compile in one process do not mix); the parent merges, prints the
table and writes JSON, Markdown and a plot. On a machine without a GPU it runs tiny
configs on the CPU simulation backend, labelled as not GPU timings.

    python -m benchmarks.hf_generate [--models qwen0.5b llama8b] [--batches 1 8 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ._report import environment, publish, sync

SHAPES = {
    "qwen0.5b": ("Qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)),
    "llama8b": ("Llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)),
    "tiny-qwen": ("Qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=256)),
}
CONFIGS = {  # name -> label; "plain" configs share one process
    "eager": "eager",
    "ro": "transformers: StaticCache + torch.compile reduce-overhead",
    "graphify": "graphify FULL (eager forward)",
    "hand": "hand-written CUDAGraph (floor)",
    "graphify_compiled": "graphify FULL (torch.compile'd forward)",
}
PLAIN = ("eager", "graphify", "hand")


def build(shape: str, device: str):
    import transformers

    arch, dims = SHAPES[shape]
    cfg = getattr(transformers, f"{arch}Config")(max_position_embeddings=4096, **dims)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, f"{arch}ForCausalLM")(cfg).to(dtype).eval()
    return model


def prompt_for(model, batch: int, length: int, device: str) -> torch.Tensor:
    vocab = model.config.vocab_size
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(batch)).to(device)


def generate(model, step, prompt, cache, new_tokens: int, sync_each: bool, before=None):
    """Prompt eagerly, then `new_tokens - 1` decode steps; returns (tokens, decode seconds)."""
    cache.reset()
    with torch.no_grad():
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        tokens = [nxt]
        sync()
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            if before is not None:
                before()
            nxt = step(nxt).logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            if sync_each:
                nxt.cpu()
        sync()
        return torch.cat(tokens, 1), time.perf_counter() - t0


class HandGraph:
    """The floor: one `torch.cuda.CUDAGraph` of the decode step, replayed with no checks.
    The cache it wrote while warming up is put back by hand."""

    def __init__(self, model, cache, batch: int):
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        saved = [(t, t.clone()) for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(2):
                model(input_ids=self.ids, past_key_values=cache, use_cache=True)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.out = model(input_ids=self.ids, past_key_values=cache, use_cache=True)
        for t, s in saved:
            t.copy_(s)

    def __call__(self, ids):
        self.ids.copy_(ids)
        self.graph.replay()
        return self.out


def kernels_per_step(step, ids) -> tuple[int, int]:
    """(GPU kernels, of them inductor's Triton kernels) in one decode step, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(ids)
        sync()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if not n.startswith(("Memcpy", "Memset"))]
    return len(kernels), sum(n.startswith("triton") for n in kernels)


def setup_config(name: str, model, cache, batch: int, backend: str):
    """(decode step callable, per-step hook, seconds of capture/compile set-up, extra facts)."""
    from graphify import Options
    from transforms.hf import decode_graphs

    opts = Options(progress=False)
    t0 = time.perf_counter()
    if name == "eager":
        step = lambda ids: model(input_ids=ids, past_key_values=cache, use_cache=True)  # noqa: E731
        return step, None, 0.0, {}
    if name == "graphify":
        g = decode_graphs(model, cache, backend=backend, options=opts)
        step = lambda ids: g(input_ids=ids, past_key_values=cache, use_cache=True)  # noqa: E731
        return step, None, time.perf_counter() - t0, {"graph_mib": g.table.nbytes / 2**20}
    if name == "graphify_compiled":
        compiled = torch.compile(model)
        g = decode_graphs(model, cache, fn=compiled, backend=backend, options=opts)
        step = lambda ids: g(input_ids=ids, past_key_values=cache, use_cache=True)  # noqa: E731
        return step, None, time.perf_counter() - t0, {"graph_mib": g.table.nbytes / 2**20}
    if name == "hand":
        hand = HandGraph(model, cache, batch)
        return hand, None, time.perf_counter() - t0, {}
    if name == "ro":
        from torch._dynamo.utils import counters

        counters.clear()
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        step = lambda ids: compiled(input_ids=ids, past_key_values=cache, use_cache=True)  # noqa: E731
        return step, torch.compiler.cudagraph_mark_step_begin, 0.0, {"counters": counters}
    raise ValueError(name)


def run_config(name: str, shape: str, batches, new_tokens: int, prompt_len: int, ref: dict, reps: int) -> list[dict]:
    """One configuration at every batch size, in this process."""
    from transforms.hf import static_cache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "cuda" if device == "cuda" else "sim"
    model = build(shape, device)
    rows = []
    for batch in batches:
        if device == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_reserved()
        cache = static_cache(model, batch, prompt_len + new_tokens)
        prompt = prompt_for(model, batch, prompt_len, device)
        t0 = time.perf_counter()
        step, before, setup_s, facts = setup_config(name, model, cache, batch, backend)
        tokens, first = generate(model, step, prompt, cache, new_tokens, True, before)
        first_total = time.perf_counter() - t0
        synced = [generate(model, step, prompt, cache, new_tokens, True, before)[1] for _ in range(reps)]
        b2b = [generate(model, step, prompt, cache, new_tokens, False, before)[1] for _ in range(reps)]
        steady = statistics.median(synced)
        row = {
            "model": shape, "config": CONFIGS[name], "key": name, "batch": batch,
            "ms_per_token_sync": steady * 1e3 / (new_tokens - 1),
            "ms_per_token_b2b": statistics.median(b2b) * 1e3 / (new_tokens - 1),
            "startup_s": max(setup_s, first_total - steady) if name != "eager" else 0.0,
            "tokens": tokens.tolist(),
        }
        if device == "cuda":
            row["graph_mib"] = facts.get("graph_mib", (torch.cuda.memory_reserved() - base) / 2**20)
            try:
                row["kernels"], row["triton_kernels"] = kernels_per_step(step, tokens[:, -1:])
            except Exception as exc:  # the profiler is a report, not a requirement
                row["kernels_error"] = repr(exc)[:200]
        if name == "ro":
            counters = facts["counters"]
            skips = int(counters["inductor"].get("cudagraph_skips", 0))
            row["uses_graphs"] = "yes" if skips == 0 else f"no ({skips} skips)"
        elif name != "eager":
            row["uses_graphs"] = "yes"
        want = ref.get(str(batch))
        if want is not None:
            got = torch.tensor(row["tokens"])
            want = torch.tensor(want)
            same = (got == want).all(0)
            row["equal_share"] = 1.0 if bool(same.all()) else int(same.int().argmin()) / same.numel()
        rows.append(row)
        del step, cache
    return rows


def worker(args) -> None:
    ref = json.loads(Path(args.ref).read_text()) if args.ref and Path(args.ref).exists() else {}
    rows = []
    for name in args.worker.split(","):
        rows += run_config(name, args.models[0], args.batches, args.new_tokens, args.prompt_len, ref, args.reps)
        if name == "eager" and args.ref:
            ref = {str(r["batch"]): r["tokens"] for r in rows if r["key"] == "eager"}
            Path(args.ref).write_text(json.dumps(ref))
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def spawn(configs: str, shape: str, args, ref: str, out: str) -> str | None:
    cmd = [sys.executable, "-m", "benchmarks.hf_generate", "--worker", configs, "--models", shape,
           "--batches", *map(str, args.batches), "--new-tokens", str(args.new_tokens),
           "--prompt-len", str(args.prompt_len), "--reps", str(args.reps), "--ref", ref, "--out", out]
    try:
        done = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return f"{configs} on {shape}: timed out after {args.timeout} s"
    if done.returncode != 0:
        return f"{configs} on {shape}: exit {done.returncode}: {done.stderr.strip()[-600:]}"
    return None


COLUMNS = [
    ("model", "model", ""), ("batch", "B", "d"), ("config", "configuration", ""),
    ("ms_per_token_sync", "ms/token, sync each step", ".3f"), ("ratio_sync", "÷ reference", ".3f"),
    ("ms_per_token_b2b", "ms/token, back to back", ".3f"), ("ratio_b2b", "÷ reference", ".3f"),
    ("startup_s", "start-up s", ".1f"), ("graph_mib", "graph MiB", ".0f"), ("kernels", "kernels/step", "d"),
    ("triton_kernels", "of them Triton", "d"), ("uses_graphs", "replays graphs", ""),
    ("equal_share", "tokens = eager", ".2f"),
]


def add_ratios(rows: list[dict]) -> None:
    """Each row against its reference: compiled configs against reduce-overhead,
    graphify over eager against the hand-written graph, the rest against eager."""
    index = {(r["model"], r["batch"], r["key"]): r for r in rows}
    reference = {"graphify_compiled": "ro", "graphify": "hand", "hand": "eager", "ro": "eager", "eager": "eager"}
    for r in rows:
        ref = index.get((r["model"], r["batch"], reference[r["key"]]))
        if ref:
            r["ratio_sync"] = r["ms_per_token_sync"] / ref["ms_per_token_sync"]
            r["ratio_b2b"] = r["ms_per_token_b2b"] / ref["ms_per_token_b2b"]


def plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        sub = [r for r in rows if r["model"] == m]
        batches = sorted({r["batch"] for r in sub})
        keys = [k for k in CONFIGS if any(r["key"] == k for r in sub)]
        width = 0.8 / max(len(keys), 1)
        for i, k in enumerate(keys):
            vals = [next((r["ms_per_token_sync"] for r in sub if r["key"] == k and r["batch"] == b), 0) for b in batches]
            ax.bar([j + i * width for j in range(len(batches))], vals, width, label=CONFIGS[k])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"B={b}" for b in batches])
        ax.set_ylabel("ms per token, sync each step (lower is better)")
        ax.set_title(m)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = torch.cuda.is_available()
    parser.add_argument("--models", nargs="+", default=["qwen0.5b", "llama8b"] if gpu else ["tiny-qwen"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32] if gpu else [1, 4])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS) if gpu else ["eager", "graphify"])
    parser.add_argument("--new-tokens", type=int, default=128 if gpu else 16)
    parser.add_argument("--prompt-len", type=int, default=128 if gpu else 16)
    parser.add_argument("--reps", type=int, default=3 if gpu else 1)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--append", action="store_true", help="keep earlier rows of other models from this device's results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ref", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    env = environment()
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        for shape in args.models:
            ref = os.path.join(tmp, f"ref-{shape}.json")
            plain = ",".join(c for c in PLAIN if c in args.configs)
            groups = ([plain] if plain else []) + [c for c in args.configs if c not in PLAIN]
            for group in groups:
                print(f"{shape}: {group} ...", flush=True)
                err = spawn(group, shape, args, ref, out)
                if err:
                    failures.append(err)
                    print("  " + err, flush=True)
                rows = [json.loads(line) for line in Path(out).read_text().splitlines()] if os.path.exists(out) else []
                report(env, rows, failures, args)  # after every group: a cut run still leaves its results


def report(env: dict, rows: list[dict], failures: list[str], args) -> None:
    from ._report import RESULTS, device_slug, table

    rows = [dict(r) for r in rows]
    previous = RESULTS / f"hf-generate-{device_slug(env)}.json"
    if args.append and previous.exists():
        old = json.loads(previous.read_text())
        rerun = {(m, c) for m in args.models for c in args.configs}
        rows = [r for r in old["rows"] if (r["model"], r["key"]) not in rerun] + rows
        failures = [
            f for f in old.get("failures", []) if not any(f.startswith(c) and f" on {m}:" in f for m, c in rerun)
        ] + failures
    add_ratios(rows)
    note = "" if env["gpu"] else "\n\nCPU simulation backend, tiny config: not GPU timings.\n"
    md = table(rows, COLUMNS) + note + "".join(f"\n- failed: {f}" for f in failures)
    for r in rows:
        r.pop("tokens", None)
    paths = publish("hf-generate", {"env": dict(env), "rows": rows, "failures": failures, "args": vars(args)}, md)
    png = plot(rows, paths[0].with_suffix(".png"))
    if png:
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
