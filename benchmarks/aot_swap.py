"""Can the compiled line's swap skip dynamo's trace? torch's `aot_compile` in a worker, its
`load_compiled_function` in the caller, beside what the swap does today.

The `generate()` that takes `Options(compile="background")`'s compiled graphs in re-runs
dynamo's bytecode trace of the whole forward in the caller, then loads inductor's output from
the caches the worker filled: seconds of stall. Here, for one decode step of a transformers
model over a StaticCache (random weights from a config, the shapes of `benchmarks.hf_generate`):

- worker (a process of its own, empty compile caches): `graphify.compile.aot.save`, as graphify's
  compile worker saves a job whole (aot_compile, the guards torch cannot save dropped,
  `save_compiled_function`); its seconds, and the guards kept and dropped by type;
- caller (this process): `graphify.compile.aot.load` twice (the first pays the imports), one decode
  step through it, its logits against eager's;
- the swap with the compile traced here (a fresh process on the worker's warm caches):
  `torch.compile(_aot.TRAMPOLINE, fullgraph=True)` and its first call: dynamo's trace, then
  inductor's output loaded.

    python -m benchmarks.aot_swap [--model qwen0.5b] [--batch 1]     # on a GPU
    python -m benchmarks.aot_swap                                    # CPU: tiny-qwen, not GPU timings

Writes benchmarks/results/aot-swap-<device>.{json,md} (not with --smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from graphify.compile import aot as _aot
from graphify.compile.compiled import DYNAMO_CONFIG, compile_settings

__all__ = ["main"]

def decode_inputs(model, batch: int, device: str) -> dict:
    """One decode step's keywords after a 16-token prefill into a fresh StaticCache."""
    import transformers

    from graphify.transforms.hf import cache_keyword

    cache, kw = transformers.StaticCache(config=model.config, max_cache_len=64), cache_keyword(model)
    ids = torch.randint(0, model.config.vocab_size, (batch, 16), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        model(input_ids=ids, **{kw: cache}, use_cache=True)
    nxt = torch.randint(0, model.config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(2)).to(device)
    return {"input_ids": nxt, kw: cache, "cache_position": torch.tensor([16], device=device), "use_cache": True}


def setup(shape: str, batch: int):
    from .hf_generate import build

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(shape, device)
    return model, decode_inputs(model, batch, device)


def worker(shape: str, batch: int, path: str, what: str) -> dict:
    """In a process of its own: "aot" compiles and saves; "trace" is today's swap on warm caches."""
    model, kwargs = setup(shape, batch)
    counts: dict = {}
    t0 = time.perf_counter()
    with torch.no_grad():
        if what == "aot":  # as graphify's compile worker saves a job whole
            counts = _aot.save(model.forward, (), kwargs, compile_settings(True), path, DYNAMO_CONFIG)
            counts.pop("identities")
        else:
            torch.compile(_aot.TRAMPOLINE, fullgraph=True)(model.forward, (), kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - t0, "guards": counts}


def spawn(shape: str, batch: int, path: str, what: str, caches: str, timeout: float) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor", "TRITON_CACHE_DIR": f"{caches}/triton"}
    cmd = [sys.executable, "-m", "benchmarks.aot_swap", "--worker", what, "--model", shape, "--batch", str(batch),
           "--path", path]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=Path(__file__).resolve().parent.parent)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    return json.loads(line[len("RESULT "):])


def measure(shape: str, batch: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="aot-swap-") as tmp:
        path = f"{tmp}/decode.aot"
        compiled = spawn(shape, batch, path, "aot", tmp, timeout)
        today = spawn(shape, batch, path, "trace", tmp, timeout) if "error" not in compiled else {}
        row = {"model": shape, "batch": batch, "aot_compile_s": compiled.get("seconds"),
               "guards": compiled.get("guards"), "today_swap_s": today.get("seconds"),
               "error": compiled.get("error") or today.get("error")}
        if row["error"]:
            return row
        model, kwargs = setup(shape, batch)
        loads = []
        for _ in range(2):  # the first pays the imports
            t0 = time.perf_counter()
            loaded = _aot.load(path)
            loads.append(time.perf_counter() - t0)
        with torch.no_grad():
            t0 = time.perf_counter()
            got = loaded(model.forward, (), kwargs).logits
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            first_call = time.perf_counter() - t0
            ref_model, ref_kwargs = setup(shape, batch)  # eager from the same state: a cache of its own
            want = ref_model(**ref_kwargs).logits
        row.update(load_first_s=loads[0], load_again_s=loads[1], first_call_s=first_call,
                   max_logit_diff=(got.float() - want.float()).abs().max().item(),
                   load_vs_today=(loads[0] + first_call) / today["seconds"])
        return row


def render(result: dict) -> str:
    from ._report import table

    cols = [("model", "model", "s"), ("batch", "B", "d"), ("aot_compile_s", "worker: aot_compile + save s", ".2f"),
            ("load_first_s", "caller: load s (1st in process)", ".3f"), ("load_again_s", "load s again", ".3f"),
            ("first_call_s", "first call s", ".3f"), ("today_swap_s", "today's swap: trace + cache load s", ".2f"),
            ("load_vs_today", "(load + call) ÷ today's", ".3f"), ("max_logit_diff", "max logit diff vs eager", ".3g")]
    lines = [] if result["env"]["gpu"] else ["**CPU: a tiny model, not GPU timings.**\n"]
    lines.append(table(result["rows"], cols))
    for r in result["rows"]:
        if r.get("guards"):
            lines.append(f"\n{r['model']} B={r['batch']}: guards kept {r['guards'].get('kept')}, dropped (graphify's "
                         f"watch must cover them) {r['guards'].get('dropped')}.")
        if r.get("error"):
            lines.append(f"\n{r['model']} B={r['batch']}: {r['error']}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available()
    parser.add_argument("--model", default="qwen0.5b" if gpu else "tiny-qwen")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--smoke", action="store_true", help="print only, no result files")
    parser.add_argument("--worker", choices=("aot", "trace"), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.model, args.batch[0], args.path, args.worker)), flush=True)
        return {}
    from ._report import environment, publish

    result = {"env": environment(), "rows": [measure(args.model, b, args.timeout) for b in args.batch]}
    markdown = render(result)
    if args.smoke:
        print(markdown)
    else:
        publish("aot-swap", result, markdown)
    return result


if __name__ == "__main__":
    main()
