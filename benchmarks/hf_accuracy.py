"""How far each line's logits are from the exact ones, over many decode steps and prompts.

`hf_generate` compares four decode steps of one prompt with eager's bf16 logits, and its
largest difference is one logit's. Two bf16 lines that compute the same sums in another
order (another kernel, grouped-query attention folded) differ from eager by their rounding
alone, in either direction; what says whether a line loses accuracy is its distance from
the exact logits. Here every configuration runs `--prompts` seeded prompts through a
greedy `generate()` of `--steps` decode steps, in a process of its own, its compiled
graphs in place; eager's process also runs the same bf16 weights in fp32 arithmetic over
eager's tokens (the exact logits). Per configuration and batch: the largest and the root
mean square difference to eager and to the exact logits, over the steps where every
configuration's tokens so far equal eager's (a near tie that flips a token changes every
later context, so later steps are not compared; every line over the same steps).

    eager, hf_compile, graphify_background: as in `benchmarks.hf_generate`
    graphify_unfolded   graphify_background with `"fold_gqa": False` (the model's attention
                        as written: the fold's own effect)

    python -m benchmarks.hf_accuracy [--models qwen0.5b llama8b] [--batches 1 8] [--prompts 4] [--steps 32]
                                     [--files DIR]  (a folder kept between runs: a cut run goes on)

On a machine without a GPU: a tiny config, fp32, the simulation backend (eager and the one
line), labelled as such.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from ._report import environment, publish, run_process, table, worker_arguments
from .hf_generate import (CONFIGS, PEER, SHAPES, background_failure_raises, build, exact_logits, fp32_weights, generate,
                          one_line)

LABELS = {**CONFIGS, "graphify_unfolded": 'graphify(model.forward, options=Options(compile={"background": True, '
                                          '"fold_gqa": False}))'}
COLUMNS = [
    ("model", "model", ""), ("batch", "B", "d"), ("config", "configuration", ""),
    ("compared", "steps compared", ".2f"), ("max_vs_eager", "max Δ eager", ".3g"), ("rms_vs_eager", "rms Δ eager", ".3g"),
    ("max_vs_fp32", "max Δ fp32", ".3g"), ("rms_vs_fp32", "rms Δ fp32", ".3g"), ("rms_vs_peer", "rms Δ fp32 ÷ peer's", ".3f"),
]


def install(name: str, model) -> None:
    """The line `name` on `model` (the extra configuration here: the fold off)."""
    if name == "graphify_unfolded":
        from graphify import Options, graphify

        model.forward = graphify(model.forward, options=Options(compile={"background": True, "fold_gqa": False}))
    else:
        one_line(name, model)


def prompts(model, batch: int, count: int, length: int) -> list[torch.Tensor]:
    """`count` seeded prompts of one length (no new cache length: the peer does not recompile)."""
    vocab, device = model.config.vocab_size, model.device
    return [torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1000 * batch + i)).to(device)
            for i in range(count)]


def logits_file(files: Path, shape: str, batch: int, prompt: int, name: str) -> Path:
    """Where configuration `name` keeps one prompt's tokens and logits."""
    return files / f"{shape}-{batch}-{prompt}-{name}.pt"


def run_config(name: str, shape: str, batches, count: int, steps: int, length: int, out: Path) -> None:
    """One configuration's tokens and decode logits (and, for eager, the exact logits) to `out`."""
    background_failure_raises()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(shape, device)
    install(name, model)
    for batch in batches:
        ids = prompts(model, batch, count, length)
        generate(model, name, ids[0], steps + 1)  # captures (and compiles) the calls below make
        if name.startswith("graphify") and device == "cuda" and hasattr(model.forward, "wait_compiles"):
            model.forward.wait_compiles()
            generate(model, name, ids[0], steps + 1)  # takes the compiled graphs in
        results = [generate(model, name, prompt, steps + 1, output_logits=True, return_dict_in_generate=True)
                   for prompt in ids]
        kept = [{"seq": r.sequences.cpu(), "logits": torch.stack(r.logits[1:], 1).cpu()} for r in results]  # decode steps
        if name == "eager":  # every prompt's under one conversion of the weights
            with fp32_weights(model):
                for k, r in zip(kept, results):
                    k["exact"] = exact_logits(model, r.sequences, length, steps)
        for i, k in enumerate(kept):
            torch.save(k, logits_file(out, shape, batch, i, name))


def agreeing_steps(seq: torch.Tensor, ref: torch.Tensor, length: int, steps: int) -> torch.Tensor:
    """(B, steps) bool: decode step j's context equals the reference's (every token up to the
    step's input, the first generated one included)."""
    same = seq[:, length:length + steps] == ref[:, length:length + steps]
    return same.int().cumprod(1).bool()


def differences(logits: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor) -> tuple[float, float]:
    """Largest |logits - ref| and the sum of squares, over the kept (row, step) pairs."""
    d = (logits.float() - ref.float())[keep]
    return (d.abs().max().item(), d.pow(2).sum().item()) if d.numel() else (0.0, 0.0)


def compare(files: Path, shape: str, batch: int, names: list, count: int, steps: int, length: int) -> list[dict]:
    """Each configuration's row (`names` holds eager): its differences to eager and to the
    exact logits over all prompts, over the same steps for every configuration (those where
    every line's tokens so far equal eager's: a line that diverged early is not measured on
    fewer, easier steps). Each file is read once."""
    largest = {(n, a): 0.0 for n in names for a in ("eager", "fp32")}
    squares, kept, total = dict(largest), 0, 0
    for i in range(count):
        lines = {name: torch.load(logits_file(files, shape, batch, i, name)) for name in names}
        eager = lines["eager"]
        keep = torch.stack([agreeing_steps(mine["seq"], eager["seq"], length, steps) for mine in lines.values()]).all(0)
        kept, total = kept + int(keep.sum()), total + keep.numel()
        for name, mine in lines.items():
            for ref, against in ((eager["logits"], "eager"), (eager["exact"], "fp32")):
                mx, sq = differences(mine["logits"], ref, keep)
                largest[name, against], squares[name, against] = max(largest[name, against], mx), squares[name, against] + sq
    vocab = eager["logits"].shape[-1]
    rows = []
    for name in names:
        row = {"model": shape, "batch": batch, "key": name, "config": LABELS[name], "compared": kept / total}
        for against in ("fp32", "eager") if name != "eager" else ("fp32",):
            row[f"max_vs_{against}"] = largest[name, against] if kept else float("nan")
            row[f"rms_vs_{against}"] = (squares[name, against] / (kept * vocab)) ** 0.5 if kept else float("nan")
        rows.append(row)
    return rows


def written(files: Path, shape: str, batches, name: str, count: int) -> bool:
    """Whether `name`'s outputs for every batch and prompt are already in `files`."""
    return all(logits_file(files, shape, b, i, name).exists() for b in batches for i in range(count))


def report(files: Path, args, done: dict, failures: list) -> None:
    """The table over the configurations done so far (published after each one, so a run cut
    by its limit still reports what it measured)."""
    import transformers

    rows = []
    for shape in args.models:
        names = done.get(shape, [])
        if "eager" not in names:
            continue
        for batch in args.batches:
            shape_rows = compare(files, shape, batch, names, args.prompts, args.steps, args.prompt_len)
            peer = next((r for r in shape_rows if r["key"] == PEER), None)
            for r in shape_rows:
                if peer is not None and peer["rms_vs_fp32"] > 0:
                    r["rms_vs_peer"] = r["rms_vs_fp32"] / peer["rms_vs_fp32"]
            rows += shape_rows
    dtype = "bf16" if torch.cuda.is_available() else "fp32, CPU simulation"
    lines = [f"transformers {transformers.__version__}; {args.prompts} prompts of {args.prompt_len} tokens, "
             f"{args.steps} greedy decode steps each, static cache, {dtype}; Δ over the steps where every line's "
             "tokens so far equal eager's; fp32: the same weights in fp32 arithmetic over eager's tokens.", "", table(rows, COLUMNS)]
    lines += [f"\nFailed: {f}" for f in failures]
    publish("hf-accuracy" + (f"-{args.tag}" if args.tag else ""),
            {"env": {**environment(), "transformers": transformers.__version__}, "rows": rows, "failures": failures,
             "prompts": args.prompts, "steps": args.steps},
            "\n".join(lines))


def main(argv=None) -> None:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen0.5b", "llama8b"] if gpu else ["tiny-qwen"],
                        choices=sorted(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8] if gpu else [2])
    parser.add_argument("--configs", nargs="+", choices=sorted(LABELS),
                        default=["eager", PEER, "graphify_background", "graphify_unfolded"] if gpu else ["eager", "graphify"])
    parser.add_argument("--prompts", type=int, default=4 if gpu else 2)
    parser.add_argument("--steps", type=int, default=32 if gpu else 6)
    parser.add_argument("--prompt-len", type=int, default=128 if gpu else 8)
    parser.add_argument("--files", help="keep each configuration's logits in this folder (default: a temporary one); "
                                        "what is already there is not run again, so a cut run goes on where it stopped")
    worker_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        run_config(args.worker, args.models[0], args.batches, args.prompts, args.steps, args.prompt_len, Path(args.out))
        return
    if not gpu and PEER in args.configs:
        parser.error("transformers' own compile makes no CUDA graphs without a GPU: leave hf_compile out on the CPU")
    configs = ["eager"] + [c for c in args.configs if c != "eager"]  # eager first: the references
    done, failures = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        files = Path(args.files or tmp)
        files.mkdir(parents=True, exist_ok=True)
        for shape in args.models:
            for name in configs:
                failed = None
                if not written(files, shape, args.batches, name, args.prompts):
                    print(f"{shape}: {name} ...", flush=True)
                    cmd = [sys.executable, "-m", "benchmarks.hf_accuracy", "--worker", name, "--models", shape,
                           "--batches", *map(str, args.batches), "--prompts", str(args.prompts),
                           "--steps", str(args.steps), "--prompt-len", str(args.prompt_len), "--out", str(files)]
                    failed = run_process(cmd, f"{name} on {shape}", args.timeout)
                    if failed:
                        failures.append(failed)
                if not failed:
                    done.setdefault(shape, []).append(name)
                report(files, args, done, failures)
    for f in failures:
        print(f, file=sys.stderr)


if __name__ == "__main__":
    main()
