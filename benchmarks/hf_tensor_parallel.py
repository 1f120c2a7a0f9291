"""A transformers model run tensor-parallel as its users load it,
`AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.bfloat16)` under
torchrun, through three lines on every rank with the same prompt:

- eager TP: transformers' own TP path, `generate(..., cache_implementation="static",
  disable_compile=True)`;
- transformers compile TP: the same generate() with transformers' own compile allowed (it
  compiles the decode step's `__call__`, torch.compile mode "reduce-overhead", where its
  criteria hold: a static cache on a cuda/xpu/neuron/tpu device, or
  `compile_config._compile_all_devices`; `--hf-compile-cpu` sets that on the CPU). Whether
  it compiled is recorded (the model's `_compiled_call`, dynamo's graphs and breaks); an
  error is caught and its text recorded: it says so when it does not run under TP;
- graphify one line: `model.forward = graphify(model.forward)`, the same generate()
  (compile off), tokens compared with eager TP's; graphify's calls by mode (FULL: replayed).

Greedy, `min_new_tokens = max_new_tokens`, random weights saved from a config (no
downloads): `--shape tiny` (float32 on the CPU, bf16 on GPUs), `1b` (Llama-3.2-1B's shape),
`8b` (Llama-3-8B's). Rank 0 builds the model on its device, saves it once with
`save_pretrained` into `--model-dir` (default: a folder under the temp dir named by shape
and dtype, reused when present), then every rank loads it with `tp_plan="auto"`.

Per line and batch size (`--batches`): the first generate() in seconds (compile and capture
included); ms per new token, decode only: the median over `--reps` back-to-back pairs of a
1-token and a `--new-tokens` generate() of their difference ÷ (new tokens - 1) (the 1-token
call is the prefill and its token alone, so the difference is the decode steps; pairs, since
a drift between two medians taken apart lands whole on their difference), the device
synchronised around every timed call, rank 0's clock; the tokens equal to eager TP's on
every rank, over every full-length call.

    torchrun --nproc-per-node 2 -m benchmarks.hf_tensor_parallel [--shape tiny|1b|8b] [--batches 1 8] \
        [--prompt-len 32] [--new-tokens 64] [--reps 5] [--model-dir DIR] [--name NAME] [--out FILE]
    torchrun --nproc-per-node 2 -m benchmarks.hf_tensor_parallel --cpu --smoke --shape tiny   # gloo, simulation
    ... --cpu --smoke --hf-compile-cpu   # transformers' compile on the CPU too (its criteria skip the CPU)

graphify must be installed (`pip install -e .`): the one line imports `graphify.transforms`.
Every rank ends by itself (`ExitTogether`): a failure on one rank ends every rank, and each
step (checkpoint, load, each line at each batch) has its limit (`--step-timeout`), past
which the rank prints its stacks and fails. NVLink multicast stays off (NCCL_NVLS_ENABLE=0
and friends). Rank 0 writes benchmarks/results/<name>-<device>.{json,md} (`--name`, default
hf-tensor-parallel-tp<world>, with -<shape> after it for shapes other than 8b; `--smoke`:
prints only) and, with `--out`, the result as JSON.
"""

from __future__ import annotations

import argparse
import os

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _key, _value in NO_MULTICAST.items():
    os.environ.setdefault(_key, _value)
# `--cpu` (gloo and the simulation) hides the GPUs before torch is imported; `parse` reads it again
_early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
_early.add_argument("--cpu", action="store_true")
if _early.parse_known_args()[0].cpu:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import contextlib  # noqa: E402
import faulthandler  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ._ranks import ExitTogether, init, maybe_fail, rank_options  # noqa: E402
from ._report import environment, publish, sync, table  # noqa: E402

LLAMA3 = dict(vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
              rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
SHAPES = {  # LlamaConfig arguments
    "tiny": dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256),  # tests/test_hf_tensor_parallel.py's TINY
    "1b": dict(LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, tie_word_embeddings=True),
    "8b": dict(LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32),
}
LINES = {"eager": "eager TP", "hf_compile": "transformers compile TP", "graphify": "graphify one line"}
TARGET_VS_TRANSFORMERS = 0.9  # graphify ms/token ÷ the best transformers TP line that ran
SHARD_SIZE = "2GB"  # checkpoint shards: no single write holds rank 0 long (ExitTogether's heartbeats)


# -- ranks and limits -----------------------------------------------------------------------

class StepLimit:
    """Each step's time limit: a step still running past it prints this rank's stacks and
    fails through `ExitTogether` (every rank ends), whatever it waits on."""

    def __init__(self, together: ExitTogether, limit_s: float):
        self.together, self.limit_s = together, limit_s

    @contextlib.contextmanager
    def __call__(self, what: str):
        timer = threading.Timer(self.limit_s, self._expired, args=(what,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _expired(self, what: str) -> None:
        faulthandler.dump_traceback(all_threads=True)
        self.together.fail(TimeoutError(f"{what} ran past {self.limit_s:g} s (--step-timeout)"))


def check_installed() -> None:
    """graphify's transformers adapter lives in `graphify.transforms` (the checkout's
    transforms/, mapped by the install): without the install the one line fails late."""
    if importlib.util.find_spec("graphify.transforms") is None:
        raise RuntimeError("graphify.transforms is not importable: install graphify from the checkout "
                           "(pip install -e .) before running this benchmark")


# -- the checkpoint ---------------------------------------------------------------------------

def model_dtype(shape: str, device: torch.device) -> torch.dtype:
    """float32 for the tiny shape on the CPU (the simulation), else bf16."""
    return torch.float32 if shape == "tiny" and device.type == "cpu" else torch.bfloat16


def default_model_dir(shape: str, dtype: torch.dtype) -> Path:
    """Where rank 0 saves the random checkpoint of `shape`, shared by the ranks of one host."""
    return Path(tempfile.gettempdir()) / f"graphify-hf-tp-{shape}-{str(dtype).removeprefix('torch.')}"


def write_checkpoint(shape: str, path: Path, dtype: torch.dtype, device: torch.device) -> bool:
    """Rank 0: build `shape` with random weights (transformers' init: normal, std 0.02) on
    `device` in `dtype` and save it to `path` (a folder renamed into place once complete).
    False where `path` already holds a checkpoint (reused)."""
    import transformers

    if (path / "config.json").exists():
        return False
    config = transformers.LlamaConfig(**SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    model.save_pretrained(partial, max_shard_size=SHARD_SIZE)  # safetensors: transformers 5's only format
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        partial.rename(path)
    except OSError:  # another run saved it first
        shutil.rmtree(partial, ignore_errors=True)
    return True


def load(path: Path, dtype: torch.dtype):
    """The model as a user loads it for tensor parallelism (transformers shards it: DTensor
    weights, all-reduces in the row-parallel layers)."""
    import transformers

    with warnings.catch_warnings():  # 5.24: "Passing `tp_plan` directly ... is deprecated"
        warnings.filterwarnings("ignore", message=".*tp_plan.*", category=FutureWarning)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
    return model.eval()


def checkpoint(args, rank: int, device: torch.device, limit: StepLimit):
    """Rank 0 writes the checkpoint (or reuses it), every rank waits, then loads it.
    Returns (model, what happened: path, written, seconds)."""
    dtype = model_dtype(args.shape, device)
    path = Path(args.model_dir) if args.model_dir else default_model_dir(args.shape, dtype)
    info = {"path": str(path), "dtype": str(dtype)}
    t0 = time.perf_counter()
    if rank == 0:
        with limit("writing the checkpoint"):
            info["written"] = write_checkpoint(args.shape, path, dtype, device)
    dist.barrier()
    info["write_s"] = time.perf_counter() - t0
    maybe_fail(args, rank, "load")
    with limit("loading the model with tp_plan='auto'"):
        t0 = time.perf_counter()
        model = load(path, dtype)
        sync()
        info["load_s"] = time.perf_counter() - t0
    weight = model.model.layers[0].self_attn.q_proj.weight
    info["weight_type"] = type(weight).__name__  # DTensor: transformers sharded it
    info["local_shape"] = list(getattr(weight, "_local_tensor", weight).shape)
    return model, info


# -- timing -------------------------------------------------------------------------------------

def generate(model, ids: torch.Tensor, new: int, **kw) -> torch.Tensor:
    """generate() as the three lines call it: greedy, static cache, exactly `new` tokens."""
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, cache_implementation="static", pad_token_id=0, **kw)


def timed(fn):
    """(seconds, result) of one call of `fn`, the device synchronised at both ends."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def time_batch(call, want: torch.Tensor | None, new: int, reps: int) -> dict:
    """One line at one batch: the first `new`-token call (capture or compile included), one
    untimed warm call, then `reps` pairs of a 1-token and a `new`-token call: ms/token is the
    median of their difference ÷ (new - 1). Tokens compared with `want` on every full call."""
    first_s, out = timed(lambda: call(new))
    outs = [out, call(new)]
    diffs, calls = [], []
    for _ in range(reps):
        one, _ = timed(lambda: call(1))
        full, out = timed(lambda: call(new))
        outs.append(out)
        diffs.append((full - one) * 1e3 / (new - 1))
        calls.append(full * 1e3)
    want = outs[0] if want is None else want
    return {"first_generate_s": first_s, "ms_per_token": statistics.median(diffs),
            "ms_per_call": statistics.median(calls), "tokens_equal": all(torch.equal(o, want) for o in outs),
            "tokens": outs[0]}


def _dynamo_counts() -> tuple[int, int]:
    """(graphs dynamo compiled, graph breaks) so far in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 600 else text[:600] + " ..."


# -- the three lines ----------------------------------------------------------------------------

def compile_note(model, device: torch.device, compiled: bool) -> str | None:
    """Why transformers' compile did not run, where it did not."""
    if compiled:
        return None
    if hasattr(model, "_compiled_call"):
        return "not compiled: transformers called torch.compile, but dynamo compiled no graph"
    if device.type not in ("cuda", "xpu") and not getattr(model.generation_config.compile_config,
                                                           "_compile_all_devices", None):
        return "not compiled: transformers compiles generate() only on cuda/xpu/neuron/tpu devices"
    return "not compiled: transformers' compile criteria did not hold"


def setup_line(name: str, model, args):
    """What line `name` changes on the model before its calls; returns the graphified
    forward (graphify's line) or None."""
    if name == "hf_compile" and args.hf_compile_cpu:
        from transformers import CompileConfig

        config = CompileConfig()
        config._compile_all_devices = True  # transformers' own switch for compiling off cuda/xpu
        model.generation_config.compile_config = config
    if name != "graphify":
        return None
    from graphify import graphify

    model.forward = graphify(model.forward)  # the one line
    return model.forward


def teardown_line(name: str, model, device: torch.device) -> None:
    """Undo line `name`: the model's own forward again; transformers' compiled call and
    dynamo's caches (and CUDA graph trees) dropped."""
    if name == "graphify":
        del model.forward
    if name == "hf_compile":
        for attr in ("_compiled_call", "_last_compile_config"):
            if attr in vars(model):
                delattr(model, attr)
        torch._dynamo.reset()
        if device.type == "cuda":  # its CUDA graphs' memory pool too, before graphify captures
            from torch._inductor import cudagraph_trees

            cudagraph_trees.reset_cudagraph_trees()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def line_row(name: str, model, ids: torch.Tensor, want, args, graphed) -> dict:
    """Line `name` at one batch: timings, tokens against eager, and what ran (graphify's
    calls by mode; whether transformers compiled, dynamo's graphs and breaks)."""
    kw = {"disable_compile": name != "hf_compile"}
    row = {"line": name, "label": LINES[name], "batch": ids.shape[0], "error": None}
    if graphed is not None:
        graphed.stats.reset()
    graphs, breaks = _dynamo_counts()
    try:
        row.update(time_batch(lambda n: generate(model, ids, n, **kw), want, args.new_tokens, args.reps))
    except Exception as exc:  # noqa: BLE001 - recorded: "it does not run under TP" is a result
        row["error"] = _error(exc)
    if want is None and name != "eager":  # eager failed at this batch: nothing to compare with
        row["tokens_equal"] = None
    if graphed is not None:
        row["modes"] = {r.mode.value: r.calls for r in graphed.stats.by_mode()}
    if name == "hf_compile":
        now_graphs, now_breaks = _dynamo_counts()
        # transformers chose to compile (its compiled call exists) and dynamo compiled a graph
        # (nothing else in this process compiles before this line)
        row["compiled"] = hasattr(model, "_compiled_call") and now_graphs > 0
        row["dynamo_graphs"], row["graph_breaks"] = now_graphs - graphs, now_breaks - breaks
        row["compile_note"] = compile_note(model, ids.device, row["compiled"])
    return row


def run_lines(model, args, rank: int, device: torch.device, limit: StepLimit) -> list[dict]:
    """Every line at every batch on this rank, eager first (the tokens' reference);
    graphify last, since its line turns transformers' compile off for the model."""
    vocab = model.config.vocab_size
    prompts = {b: torch.randint(1, vocab, (b, args.prompt_len), generator=torch.Generator().manual_seed(b)).to(device)
               for b in args.batches}  # the same prompt on every rank
    want, rows = {}, []
    for name in LINES:
        graphed = setup_line(name, model, args)
        try:
            for b, ids in prompts.items():
                maybe_fail(args, rank, name)
                with limit(f"{LINES[name]} at B={b}"):
                    row = line_row(name, model, ids, want.get(b), args, graphed)
                if name == "eager" and row["error"] is None:
                    want[b] = row["tokens"]
                row.pop("tokens", None)
                rows.append(row)
                if rank == 0:  # as it comes: a run cut at its limit still shows the lines it finished
                    print("row:", json.dumps({k: v for k, v in row.items() if not isinstance(v, (list, dict))},
                                             default=str), flush=True)
        finally:
            teardown_line(name, model, device)
        dist.barrier()
    return rows


# -- the report ---------------------------------------------------------------------------------

def merge(by_rank: list[list[dict]]) -> list[dict]:
    """One row per line and batch: rank 0's timings, tokens equal on every rank, each
    rank's verdict, modes and error kept."""
    rows = []
    for i, row in enumerate(by_rank[0]):
        peers = [ranks[i] for ranks in by_rank]
        row = dict(row)
        equal = row["tokens_equal_by_rank"] = [p.get("tokens_equal") for p in peers]
        row["tokens_equal"] = None if None in equal else all(equal)  # None: not compared (an error)
        row["ms_per_token_by_rank"] = [p.get("ms_per_token") for p in peers]
        row["error"] = next((f"rank {r}: {p['error']}" for r, p in enumerate(peers) if p["error"]), None)
        if "modes" in row:
            row["modes_by_rank"] = [p.get("modes") for p in peers]
        rows.append(row)
    return rows


def _ratio(a, b):
    return a / b if a is not None and b else None


def add_ratios(rows: list[dict]) -> None:
    """graphify's rows: its ms/token ÷ transformers compile's and ÷ eager's at the same batch."""
    index = {(r["line"], r["batch"]): r for r in rows}
    for r in rows:
        if r["line"] == "graphify":
            ms = r.get("ms_per_token")
            r["vs_compile"] = _ratio(ms, index.get(("hf_compile", r["batch"]), {}).get("ms_per_token"))
            r["vs_eager"] = _ratio(ms, index.get(("eager", r["batch"]), {}).get("ms_per_token"))


def targets(rows: list[dict]) -> dict:
    """graphify's tokens equal eager TP's at every batch on every rank; its ms/token ÷ the
    best transformers TP line that ran (eager or compile), <= TARGET_VS_TRANSFORMERS."""
    ours = [r for r in rows if r["line"] == "graphify"]
    equal = bool(ours) and all(r["error"] is None and r["tokens_equal"] for r in ours)
    by_batch = {}
    for r in ours:
        peers = [p for p in rows if p["line"] != "graphify" and p["batch"] == r["batch"] and p.get("ms_per_token")
                 and p["error"] is None]
        best = min(peers, key=lambda p: p["ms_per_token"], default=None)
        if best is not None and r.get("ms_per_token") is not None:
            by_batch[r["batch"]] = {"ratio": r["ms_per_token"] / best["ms_per_token"], "vs": best["label"]}
    ratios = [v["ratio"] for v in by_batch.values()]
    met = all(x <= TARGET_VS_TRANSFORMERS for x in ratios) if ours and len(ratios) == len(ours) else None
    every_line = all(r["error"] is None and r["tokens_equal"] for r in rows)
    return {"tokens_equal": {"graphify": equal, "all_lines": every_line, "met": equal},
            "ms_per_token_vs_transformers": {"target": TARGET_VS_TRANSFORMERS, "by_batch": by_batch,
                                             "worst": max(ratios, default=None), "met": met}}


def _ran(r: dict) -> str:
    """The "compiled? / error" cell."""
    if r["error"]:  # one line of it, fit for a table cell
        return "error: " + " ".join(r["error"][:160].split()).replace("|", "/")
    if r["line"] == "hf_compile":
        if r.get("compiled"):
            return f"compiled: {r['dynamo_graphs']} dynamo graphs, {r['graph_breaks']} breaks"
        return r.get("compile_note") or "not compiled"
    return "-"


COLUMNS = [("shape", "shape", "s"), ("world", "world", "d"), ("batch", "B", "d"), ("label", "line", "s"),
           ("first_generate_s", "first generate s", ".2f"), ("ms_per_token", "ms/token", ".3f"),
           ("tokens_equal", "tokens equal to eager TP", ""), ("modes_text", "graphs replayed (modes)", "s"),
           ("ran", "compiled? / error", "s"), ("vs_compile", "graphify ÷ transformers compile", ".3f"),
           ("vs_eager", "graphify ÷ eager", ".3f")]


def render(result: dict) -> str:
    """The Markdown: what ran, the table, the targets."""
    rows = [{**r, "shape": result["shape"], "world": result["world"], "ran": _ran(r),
             "modes_text": ", ".join(f"{k} {v}" for k, v in r["modes"].items()) if r.get("modes") else None}
            for r in result["rows"]]
    lines = []
    if not result["env"]["gpu"]:
        lines.append("**CPU smoke run: gloo, simulation backend. These timings are not GPU timings.**\n")
    lines.append(
        f"transformers {result['env'].get('transformers')}: `from_pretrained(path, tp_plan=\"auto\", "
        f"dtype={result['checkpoint']['dtype']})` at world {result['world']}, random weights "
        f"({result['shape']} shape). "
        f"Prompt {result['prompt_len']} tokens, {result['new_tokens']} new tokens, greedy, static cache. "
        f"ms/token: {result['measure']}\n")
    lines.append(table(rows, COLUMNS))
    t = result["targets"]
    got = t["ms_per_token_vs_transformers"]
    verdict = {None: "not measured", True: "met", False: "NOT met"}
    lines.append(f"\nTargets: graphify's tokens equal eager TP's at every batch on every rank: "
                 f"{verdict[t['tokens_equal']['met']]}. graphify ms/token ÷ the best transformers TP line <= "
                 f"{got['target']}: {verdict[got['met']]}"
                 + "".join(f"; B={b} {v['ratio']:.3f} (vs {v['vs']})" for b, v in got["by_batch"].items()) + ".")
    return "\n".join(lines)


MEASURE = ("median over --reps back-to-back pairs of (a --new-tokens generate() - a 1-token generate()) ÷ "
           "(new tokens - 1), the device synchronised around each call, rank 0's clock")


def run(args, rank: int, world: int, device: torch.device, limit: StepLimit) -> dict | None:
    """Load, run the lines, gather every rank's rows; rank 0 returns the result."""
    import transformers

    if rank != 0 or args.smoke:  # one progress bar at most: rank 0's
        transformers.utils.logging.disable_progress_bar()
    model, info = checkpoint(args, rank, device, limit)
    rows = run_lines(model, args, rank, device, limit)
    by_rank = [None] * world
    dist.all_gather_object(by_rank, rows)
    if rank != 0:
        return None
    rows = merge(by_rank)
    add_ratios(rows)
    return {"env": {**environment(), "world": world, "transformers": transformers.__version__},
            "world": world, "shape": args.shape, "dims": SHAPES[args.shape], "batches": list(args.batches),
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "reps": args.reps,
            "hf_compile_cpu": args.hf_compile_cpu, "checkpoint": info, "measure": MEASURE, "rows": rows,
            "targets": targets(rows)}


# -- main -------------------------------------------------------------------------------------

def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default 8b (--smoke, --cpu: tiny)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens each full generate() adds (>= 2)")
    parser.add_argument("--reps", type=int, default=None, help="timed pairs per line and batch (default 5, --smoke 2)")
    parser.add_argument("--model-dir", help="the random checkpoint's folder (default: under the temp dir, by shape)")
    parser.add_argument("--hf-compile-cpu", action="store_true",
                        help="let transformers compile on the CPU too (compile_config._compile_all_devices)")
    parser.add_argument("--name", default=None,
                        help="result files' name (default hf-tensor-parallel-tp<world>, -<shape> after it but for 8b)")
    rank_options(parser, smoke="light timing, no result files", cpu="gloo and the simulation backend on the CPU", timeout=600)
    parser.add_argument("--step-timeout", type=float, default=900, help="seconds any one step may take")
    parser.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fail-at", choices=("start", "stuck", "load", *LINES), default="eager",
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (ms/token is the difference to a 1-token call)")
    args.reps = args.reps or (2 if args.smoke else 5)
    args.shape = args.shape or ("tiny" if args.smoke or args.cpu else "8b")
    return args


def default_name(world: int, shape: str) -> str:
    """The result files' name: hf-tensor-parallel-tp<world>, the shape after it but for 8b."""
    return f"hf-tensor-parallel-tp{world}" + ("" if shape == "8b" else f"-{shape}")


def main(argv=None) -> dict | None:
    args = parse(argv)
    rank, world, device = init(args.cpu, args.timeout)
    if rank != 0 or args.smoke:  # one progress bar at most: rank 0's
        os.environ["TQDM_DISABLE"] = "1"
    together = ExitTogether(rank)
    limit = StepLimit(together, args.step_timeout)
    result = None
    try:
        maybe_fail(args, rank, "start")
        maybe_fail(args, rank, "stuck")
        check_installed()
        result = run(args, rank, world, device, limit)
        if rank == 0:
            markdown = render(result)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
            if args.smoke:
                print(markdown, flush=True)
            else:
                publish(args.name or default_name(world, args.shape), dict(result), markdown)
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - any failure must end every rank
        together.fail(exc)
    together.stop()
    dist.destroy_process_group()  # graphify releases graphs holding the group's collectives first
    return result


if __name__ == "__main__":
    main()
