"""transformers `model.generate()` as users call it, side by side: eager, transformers'
torch.compile recipe, and graphify's one line over the eager forward and over a compiled one.

    eager       model.generate(..., cache_implementation="static", disable_compile=True)
    recipe      model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    graphify    model.forward = graphify(model.forward)
    graphify+c  model.forward = graphify(torch.compile(model.forward, fullgraph=True))

then `model.generate(input_ids, attention_mask, max_new_tokens=N, min_new_tokens=N,
cache_implementation="static")` unchanged (greedy). Random-weight models from configs (no
downloads): the Qwen2.5-0.5B and Llama-3-8B shapes, bf16. Per configuration and batch: the
first generate() in the process (compile and capture included), time to the first token
and ms per new token (medians after that first call), and the largest logit difference to
eager over the first decode steps (random weights make near-ties, so token agreement says
little; logits say how close the arithmetic is).

Each configuration runs in a process of its own (compiled code and CUDA graphs of several
compiles in one process do not mix). On a machine without a GPU: a tiny config on the CPU
simulation backend, labelled as not GPU timings.

    python -m benchmarks.hf_generate [--models qwen0.5b llama8b] [--batches 1 8 32] [--configs ...]
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
CONFIGS = {
    "eager": "eager generate() (transformers' compile off)",
    "recipe": "transformers' recipe: torch.compile(forward, reduce-overhead)",
    "graphify": "graphify(model.forward)",
    "graphify_compiled": "graphify(torch.compile(model.forward))",
}
LOGIT_STEPS = 4  # decode steps whose logits are compared with eager's


def build(shape: str, device: str):
    import transformers

    arch, dims = SHAPES[shape]
    cfg = getattr(transformers, f"{arch}Config")(max_position_embeddings=4096, **dims)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        return getattr(transformers, f"{arch}ForCausalLM")(cfg).to(dtype).eval()


def one_line(name: str, model) -> None:
    """What a user writes for configuration `name` (eager: nothing)."""
    if name == "recipe":
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    elif name == "graphify":
        from graphify import graphify

        model.forward = graphify(model.forward)
    elif name == "graphify_compiled":
        from graphify import graphify

        model.forward = graphify(torch.compile(model.forward, fullgraph=True))


def generate(model, name: str, ids: torch.Tensor, new: int, **kw):
    extra = {"disable_compile": True} if name == "eager" else {}
    return model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
        cache_implementation="static", pad_token_id=0, **extra, **kw,
    )


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def run_config(name: str, shape: str, batches, new: int, prompt_len: int, reps: int, ref_dir: str) -> list[dict]:
    """One configuration at every batch size, in this process."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(shape, device)
    one_line(name, model)
    rows = []
    for batch in batches:
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(device)
        first = timed(lambda: generate(model, name, ids, new))  # noqa: B023 - called at once
        ttft = statistics.median(timed(lambda: generate(model, name, ids, 1)) for _ in range(reps))  # noqa: B023
        total = statistics.median(timed(lambda: generate(model, name, ids, new)) for _ in range(reps))  # noqa: B023
        out = generate(model, name, ids, LOGIT_STEPS + 1, output_logits=True, return_dict_in_generate=True)
        logits = torch.stack(out.logits[1:], 1).float().cpu()  # the decode steps' logits
        ref_path = Path(ref_dir) / f"{shape}-{batch}.pt"
        row = {"model": shape, "config": CONFIGS[name], "key": name, "batch": batch, "first_generate_s": first,
               "ttft_ms": ttft * 1e3, "ms_per_token": (total - ttft) * 1e3 / (new - 1)}
        if name == "eager":
            torch.save(logits, ref_path)
        elif ref_path.exists():
            row["max_logit_diff"] = (logits - torch.load(ref_path)).abs().max().item()
        forward = getattr(model, "forward", None)
        if hasattr(forward, "stats"):
            modes = {r.mode.value: r.calls for r in forward.stats.by_mode()}
            row["replayed_share"] = modes.get("FULL", 0) / max(sum(modes.values()), 1)
        rows.append(row)
    return rows


def worker(args) -> None:
    rows = run_config(args.worker, args.models[0], args.batches, args.new_tokens, args.prompt_len, args.reps, args.ref)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def spawn(config: str, shape: str, args, ref: str, out: str) -> str | None:
    cmd = [sys.executable, "-m", "benchmarks.hf_generate", "--worker", config, "--models", shape,
           "--batches", *map(str, args.batches), "--new-tokens", str(args.new_tokens),
           "--prompt-len", str(args.prompt_len), "--reps", str(args.reps), "--ref", ref, "--out", out]
    try:
        done = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return f"{config} on {shape}: timed out after {args.timeout} s"
    if done.returncode != 0:
        return f"{config} on {shape}: exit {done.returncode}: {done.stderr.strip()[-600:]}"
    return None


COLUMNS = [
    ("model", "model", ""), ("batch", "B", "d"), ("config", "configuration", ""),
    ("ms_per_token", "ms / new token", ".3f"), ("vs_recipe", "÷ recipe", ".3f"), ("ttft_ms", "time to 1st token ms", ".1f"),
    ("first_generate_s", "first generate() s", ".1f"), ("first_vs_recipe", "÷ recipe", ".2f"),
    ("replayed_share", "calls replayed", ".2f"), ("max_logit_diff", f"max |logit - eager|, {LOGIT_STEPS} steps", ".3g"),
]


def add_ratios(rows: list[dict]) -> None:
    index = {(r["model"], r["batch"], r["key"]): r for r in rows}
    for r in rows:
        ref = index.get((r["model"], r["batch"], "recipe"))
        if ref:
            r["vs_recipe"] = r["ms_per_token"] / ref["ms_per_token"]
            r["first_vs_recipe"] = r["first_generate_s"] / ref["first_generate_s"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = torch.cuda.is_available()
    parser.add_argument("--models", nargs="+", default=["qwen0.5b", "llama8b"] if gpu else ["tiny-qwen"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32] if gpu else [1, 3])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS) if gpu else ["eager", "graphify"])
    parser.add_argument("--new-tokens", type=int, default=64 if gpu else 8)
    parser.add_argument("--prompt-len", type=int, default=128 if gpu else 8)
    parser.add_argument("--reps", type=int, default=3 if gpu else 1)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ref", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    env = environment()
    failures: list[str] = []
    configs = ["eager"] + [c for c in args.configs if c != "eager"]  # eager first: the logit reference
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        for shape in args.models:
            for config in configs:
                print(f"{shape}: {config} ...", flush=True)
                err = spawn(config, shape, args, tmp, out)
                if err:
                    failures.append(err)
                    print("  " + err, flush=True)
                rows = [json.loads(line) for line in Path(out).read_text().splitlines()] if os.path.exists(out) else []
                report(env, rows, failures, args)  # after every configuration: a cut run still leaves its results


def report(env: dict, rows: list[dict], failures: list[str], args) -> None:
    from ._report import table

    rows = [dict(r) for r in rows]
    add_ratios(rows)
    note = "" if env["gpu"] else "\n\nCPU simulation backend, tiny config: not GPU timings.\n"
    md = table(rows, COLUMNS) + note + "".join(f"\n- failed: {f}" for f in failures)
    publish("hf-generate", {"env": dict(env), "rows": rows, "failures": failures, "args": vars(args)}, md)


if __name__ == "__main__":
    main()
