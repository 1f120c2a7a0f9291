"""transformers `model.generate()` as users call it, side by side with what transformers does
by itself.

    eager        generate(..., cache_implementation="static", disable_compile=True)
    hf_compile   generate(..., cache_implementation="static"): transformers' own compile of the
                 decode step (inductor, CUDA graphs), what a user gets with no line at all
    graphify     model.forward = graphify(model.forward); then generate() unchanged
    graphify_inductor   model.forward = graphify(model.forward, options=Options(compile=True)):
                 graphify compiles the calls it captures (the decode step) with inductor
    graphify_compiled   model.forward = graphify(torch.compile(model.forward, fullgraph=True))
    graphify_background model.forward = graphify(model.forward, options=Options(compile="background")):
                 plain graphs at once, inductor's kernels once a worker process compiled them;
                 the row says when they came (compiled kernels ready s, from the first call's
                 start) and what the generate() that took them in cost; the timings after it
    graphify_background_pdl, graphify_background_autotune, graphify_background_gemv   the same
                 with inductor's programmatic dependent launch, with its autotuned matmuls
                 (max-autotune-no-cudagraphs), or with one-row linears through graphify's Triton
                 GEMV (`"gemv": True`): run only when named in --configs

Random-weight models from configs (no downloads): the Qwen2.5-0.5B and Llama-3-8B shapes, a
Gemma 3 1B shape whose window (64) a generation crosses, an MoE shape (8 experts, 2 active),
bf16, greedy. Per configuration and batch, in a process of its own: the first generate()
(compile and capture included), ms per new token in a 64-token generate() (median after
the first call; prefill excluded), the time to the first token (a generate() of one new
token: the prompt's prefill, median), steady ms per token (a 192-token call minus a 64-token
call, the median over back-to-back pairs; the first 192-token call is timed apart, since
transformers recompiles for a longer cache), on a GPU the kernels and GPU time per token
(torch.profiler) and their split by kernel class (GEMM, attention, Triton, copy,
elementwise: `_kernel_classes`), and the largest
logit difference over the first decode steps to eager and to the exact logits (the same
weights in fp32 arithmetic over eager's tokens: bf16 lines differ from eager by their rounding
alone, from these by their own error; the root mean square too, since a largest difference
is one logit's). Every configuration's process has
compile caches of its own, empty at its start; `--restart-configs` run a second process
on the caches the first left (a service restart). Then the chat-like workload, in a fresh
process with empty caches: 20 seeded generate() calls (batch 1-8, prompts 16-256 tokens,
16-256 new tokens; --chat-calls more), total wall time with every compile and capture; for
the background line, the call that took compiled graphs in, and with --chat-again each call's
time over its own in a second pass once compiles are done (the swap call's beside its
neighbours').

On a machine without a GPU: a tiny config on the CPU simulation backend, labelled as not
GPU timings.

    python -m benchmarks.hf_generate [--models qwen0.5b llama8b] [--batches 1 8 32] [--configs ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from ._report import environment, peak_bandwidth, publish, run_process, sync, worker_arguments

SHAPES = {
    "qwen0.5b": ("Qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)),
    "llama8b": ("Llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)),
    "tiny-qwen": ("Qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=256)),
    # Gemma 3 1B's shape (5 sliding-window layers to 1 full), its window cut to 64 tokens so that a
    # 64-token generate() fills it, crosses it and rolls: the hybrid cache's every branch
    "gemma3-1b": ("Gemma3Text", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                     num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                                     sliding_window=64)),
    # a mixture of experts: 8 experts, 2 active per token (Mixtral's layout at about 1.5B parameters)
    "moe": ("Mixtral", dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=16,
                            num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2)),
    "tiny-gemma3": ("Gemma3Text", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, vocab_size=256, sliding_window=8,
                                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "tiny-moe": ("Mixtral", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2)),
}
# the model class of an architecture whose config's name is not `<arch>Config`'s own
MODEL_CLASS = {"Gemma3Text": "Gemma3ForCausalLM"}
# the background line's `Options(compile=...)`, and trials of it: inductor settings weighed for
# decode at the hardware's pace (programmatic dependent launch between its kernels; autotuned
# one-row matmuls; graphify's GEMV for them), run when named, not by default
BACKGROUND_COMPILE = {
    "graphify_background": "background",
    "graphify_background_pdl": {"background": True, "options": {"triton.enable_pdl": True}},
    "graphify_background_autotune": {"background": True, "mode": "max-autotune-no-cudagraphs"},
    "graphify_background_gemv": {"background": True, "gemv": True},
}
TRIALS = ("graphify_background_pdl", "graphify_background_autotune", "graphify_background_gemv")
CONFIGS = {
    "eager": "eager generate() (transformers' compile off)",
    "hf_compile": "transformers' own compile (no line)",
    "graphify": "graphify(model.forward)",
    "graphify_inductor": "graphify(model.forward, options=Options(compile=True))",
    "graphify_compiled": "graphify(torch.compile(model.forward))",
    # as written in Python (double quotes: the labels result files hold)
    **{name: f"graphify(model.forward, options=Options(compile={repr(how).replace(chr(39), chr(34))}))"
       for name, how in BACKGROUND_COMPILE.items()},
}
PEER = "hf_compile"
LOGIT_STEPS = 4  # decode steps whose logits are compared with eager's
CHAT_CALLS = 20
TTFT_PAIRS = 15  # 1-token calls of the line and of eager, in turn (`ttft_beside_eager`): 15 pairs cost ~2 s at 8B


def build(shape: str, device: str):
    import transformers

    arch, dims = SHAPES[shape]
    cfg = getattr(transformers, f"{arch}Config")(max_position_embeddings=4096, **dims)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        return getattr(transformers, MODEL_CLASS.get(arch, f"{arch}ForCausalLM"))(cfg).to(dtype).eval()


def one_line(name: str, model) -> None:
    """What a user writes for configuration `name` (eager and hf_compile: nothing)."""
    if name == "graphify":
        from graphify import graphify

        model.forward = graphify(model.forward)
    elif name == "graphify_inductor":
        from graphify import Options, graphify

        model.forward = graphify(model.forward, options=Options(compile=True))
    elif name in BACKGROUND_COMPILE:
        from graphify import Options, graphify

        model.forward = graphify(model.forward, options=Options(compile=BACKGROUND_COMPILE[name]))
    elif name == "graphify_compiled":
        from graphify import graphify

        model.forward = graphify(torch.compile(model.forward, fullgraph=True))


def background_failure_raises() -> None:
    """A compile in the background that fails leaves plain graphs serving, with a warning: a
    row timed so would report eager kernels as compiled ones. In a benchmark's process the
    warning raises instead, so the configuration fails and says why."""
    warnings.filterwarnings("error", message=r".*the compile in the background failed")


def generate(model, name: str, ids: torch.Tensor, new: int, **kw):
    # generate() as users call it; the graphify lines turn transformers' own compile off themselves
    extra = {"disable_compile": True} if name == "eager" else {}
    return model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
        cache_implementation="static", pad_token_id=0, **extra, **kw,
    )


def timed(fn) -> float:
    """Seconds of one call of `fn`, the device synchronised at both ends: a whole
    `generate()` is timed once (a `Timer` repeats its statement)."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


@contextlib.contextmanager
def eager_forward(model):
    """The model's own forward inside the block, the line's after: eager in this very process."""
    graphed = model.forward
    model.forward = graphed.fn
    try:
        yield model
    finally:
        model.forward = graphed


def ttft_beside_eager(model, name: str, ids: torch.Tensor, pairs: int) -> dict:
    """Time to first token (a 1-token generate()) of the line and of eager in this process, the
    two called in turn `pairs` times: medians and their ratio. These hosts drift tens of percent
    between processes and within a minute, more than the line adds to a prefill; taken in turn,
    the drift falls on both alike. Which of the two goes first alternates (line, eager, eager,
    line, ...): a cost that falls on the first call of a pair falls on both alike too."""
    line, eager = [], []

    def line_call():
        line.append(timed(lambda: generate(model, name, ids, 1)))

    def eager_call():
        with eager_forward(model):
            eager.append(timed(lambda: generate(model, "eager", ids, 1)))

    for i in range(pairs):
        for call in (line_call, eager_call) if i % 2 == 0 else (eager_call, line_call):
            call()
    ms, eager_ms = statistics.median(line) * 1e3, statistics.median(eager) * 1e3
    return {"ttft_in_turn_ms": ms, "ttft_eager_in_turn_ms": eager_ms, "ttft_vs_eager_in_turn": ms / eager_ms}


def steady_ms_per_token(call, new: int, longer: int, pairs: int) -> float:
    """ms per token past the first `new`: the median over `pairs` back-to-back pairs of a
    `longer`- and a `new`-token call of their difference per extra token. Pairs, not two
    medians taken apart: these hosts drift tens of percent within a minute, and a drift
    between two separately taken medians lands whole on their difference."""
    diffs = [(timed(lambda: call(longer)) - timed(lambda: call(new))) * 1e3 / (longer - new) for _ in range(pairs)]  # noqa: B023
    return statistics.median(diffs)


def chat_calls(vocab: int, gpu: bool, count: int | None = None) -> list[tuple[int, int, int]]:
    """(batch, prompt length, new tokens) of the chat-like workload, seeded (`count` calls:
    the first ones are the same whatever the count)."""
    rng = random.Random(26)
    if not gpu:
        return [(rng.randint(1, 3), rng.randint(4, 12), rng.randint(3, 8)) for _ in range(count or 6)]
    return [(rng.randint(1, 8), rng.randint(16, 256), rng.randint(16, 256)) for _ in range(count or CHAT_CALLS)]


@contextlib.contextmanager
def fp32_weights(model):
    """The model's own weights in fp32 inside the block, back in their dtype after (exact:
    they came from it): `exact_logits` runs there."""
    dtype = next(model.parameters()).dtype
    model.float()
    try:
        yield model
    finally:
        model.to(dtype)


def same_prefix(sequences: torch.Tensor, ref: torch.Tensor, prompt_len: int, steps: int = LOGIT_STEPS) -> torch.Tensor:
    """[B, steps] booleans: whether decode step s's logits (`out.logits[1 + s]`) follow the same
    tokens in `sequences` as in `ref` (the prompt and the first s + 1 new tokens). Where a line's
    greedy token parts from eager's (a near-tie, at random weights), later steps read other
    tokens, and their logits are not the same question. Either may sit on any device (eager's
    tokens come back from a file, on the CPU)."""
    new = sequences[:, prompt_len:prompt_len + steps].cpu() == ref[:, prompt_len:prompt_len + steps].cpu()
    return new.cumprod(dim=1).bool()


def max_where(diff: torch.Tensor, keep: torch.Tensor) -> float:
    """The largest |diff| over the [B, steps] entries `keep` marks (diff: [B, steps, vocab]);
    NaN where none is kept."""
    picked = diff.abs().amax(dim=-1)[keep]
    return picked.max().item() if picked.numel() else float("nan")


def exact_logits(model, sequences: torch.Tensor, prompt_len: int, steps: int = LOGIT_STEPS) -> torch.Tensor:
    """The decode steps' logits from one forward over `sequences` (no cache); under
    `fp32_weights`, the exact ones. Two bf16 lines can differ from eager by their rounding
    alone; against these logits the difference is each line's own error."""
    with torch.no_grad():
        return model(sequences).logits[:, prompt_len:prompt_len + steps].float().cpu()


def gpu_per_token(call, prefill, new: int, read_bytes: float | None = None, peak: float | None = None,
                  weight_bytes: float | None = None, kv_bytes: float | None = None) -> dict:
    """Kernels, GPU milliseconds and GPU idle microseconds (between kernels) per new token of
    `call` (a `new`-token generate()), less those of `prefill` (a 1-token one), from one
    torch.profiler run of each, which sees kernels inside graph replays; and the same spans by
    kernel class (`classes_per_token`). Against ms/token it tells GPU work from host time the
    GPU waits out. With `read_bytes` (what a decode step must read at least,
    `decode_read_bytes`) and `peak` (HBM bytes/s): the achieved GB/s, the floor (those bytes at
    peak bandwidth) and the GPU time over it."""
    from . import _report

    long, one = _report.cuda_spans(call, steps=1), _report.cuda_spans(prefill, steps=1)
    count, gpu_ms, idle_us, _ = _report.summarise(long, 1)
    count_1, gpu_ms_1, idle_us_1, _ = _report.summarise(one, 1)
    out = {"kernels_per_token": (count - count_1) / (new - 1), "gpu_ms_per_token": (gpu_ms - gpu_ms_1) / (new - 1),
           "gpu_idle_us_per_token": (idle_us - idle_us_1) / (new - 1),
           # the 1-token call itself (the prompt's prefill): its GPU work beside its wall time, ttft_ms
           "ttft_kernels": count_1, "ttft_gpu_ms": gpu_ms_1, "ttft_gpu_idle_ms": idle_us_1 / 1e3}
    if read_bytes and out["gpu_ms_per_token"] > 0:
        out["read_gb_per_token"] = read_bytes / 1e9
        out["achieved_gb_s"] = read_bytes / (out["gpu_ms_per_token"] / 1e3) / 1e9
        if peak:
            out["floor_ms_per_token"] = read_bytes / peak * 1e3
            out["gpu_vs_floor"] = out["gpu_ms_per_token"] / out["floor_ms_per_token"]
    return {**out, **classes_per_token(long, one, new, weight_bytes, kv_bytes)}


def classes_per_token(long: list, one: list, new: int, weight_bytes: float | None = None,
                      kv_bytes: float | None = None) -> dict:
    """A token's GPU time by kernel class (`_kernel_classes`): kernels and µs per new token of
    the `long` call's profiler spans less the 1-token call's (`one`), as `gpu_per_token` takes
    totals from the same spans (the classes' µs add up to the token's GPU time), each class's
    share of it, and the GB/s of the GEMMs over `weight_bytes` and of attention over `kv_bytes`
    (where the class ran): where a decode token's GPU time goes."""
    from ._kernel_classes import CLASSES, fold

    long, one = fold(long, 1), fold(one, 1)
    kernels = {c: (long[c]["kernels"] - one[c]["kernels"]) / (new - 1) for c in CLASSES}
    us = {c: (long[c]["us"] - one[c]["us"]) / (new - 1) for c in CLASSES}
    total = sum(us.values())
    out = {"class_kernels_per_token": kernels, "class_us_per_token": us,
           "class_share": {c: us[c] / total if total > 0 else None for c in CLASSES},
           "gemm_us_per_token": us["gemm"], "attention_us_per_token": us["attention"]}
    for cls, read in (("gemm", weight_bytes), ("attention", kv_bytes)):
        if read and us[cls] > 0:
            out[f"{cls}_gb_s"] = read / us[cls] / 1e3  # bytes per µs ÷ 1e3: GB/s
    return out


def decode_read_bytes(model, batch: int, prompt_len: int, new: int) -> int:
    """Bytes one decode step must read at least, averaged over a `new`-token call: the
    weights' and the keys' and values' of `decode_read_parts`. The weight-read floor of the
    tables is these bytes at the GPU's peak bandwidth."""
    weights, kv = decode_read_parts(model, batch, prompt_len, new)
    return int(weights + kv)


def decode_read_parts(model, batch: int, prompt_len: int, new: int) -> tuple[float, float]:
    """(weight bytes, KV bytes) one decode step reads at least, averaged over a `new`-token
    call: every weight once (the input embedding only where it is also the LM head: a step
    reads `batch` rows of it otherwise; a mixture of experts' expert weights in the share of
    experts that `batch` tokens reach under even routing), and each sequence's keys and values
    up to its length (the prompt plus half the new tokens, on average; a sliding-window layer's
    up to its window). Apart: GEMMs read the first, attention the second."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    cfg = model.config.get_text_config(decoder=True)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    used = getattr(cfg, "num_experts_per_tok", None)
    reached = 1 - (1 - used / experts) ** batch if experts and used else 1.0
    weights = sum(p.numel() * p.element_size() * (reached if ".experts." in f".{name}." else 1.0)
                  for name, p in model.named_parameters() if tied or p is not embed)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    length = prompt_len + new / 2
    window = getattr(cfg, "sliding_window", None)
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    lengths = sum(min(length, window) if window and kind == "sliding_attention" else length for kind in kinds)
    return weights, 2 * kv_heads * head_dim * embed.element_size() * batch * lengths


def run_config(name: str, shape: str, batches, new: int, prompt_len: int, reps: int, ref_dir: str) -> list[dict]:
    """One configuration at every batch size, in this process."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(shape, device)
    one_line(name, model)
    rows = []
    for batch in batches:
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(device)
        start = time.perf_counter()
        first = timed(lambda: generate(model, name, ids, new))  # noqa: B023 - called at once
        background = {}
        if name in BACKGROUND_COMPILE:  # when the compiled kernels came, and the call that took them in
            # the first token while the worker compiles (its CPU and GPU work beside the caller's)
            background.update({f"compiling_{k}": v for k, v in ttft_beside_eager(model, name, ids, 3).items()})
            model.forward.wait_compiles()
            background["compiled_ready_s"] = time.perf_counter() - start
            background["swap_generate_s"] = timed(lambda: generate(model, name, ids, new))  # noqa: B023
        prefill = statistics.median(timed(lambda: generate(model, name, ids, 1)) for _ in range(reps))  # noqa: B023
        if name.startswith("graphify"):  # the line's first token beside eager's, in turn in this process
            background.update(ttft_beside_eager(model, name, ids, TTFT_PAIRS))
        call = statistics.median(timed(lambda: generate(model, name, ids, new)) for _ in range(reps))  # noqa: B023
        row = {"model": shape, "config": CONFIGS[name], "key": name, "batch": batch, "first_generate_s": first,
               "ms_per_token": (call - prefill) * 1e3 / (new - 1), "ttft_ms": prefill * 1e3, **background}
        if "swap_generate_s" in background:  # the target's measure: the call that took them in ÷ a later one
            row["swap_vs_call"] = background["swap_generate_s"] / call
        if name != "eager":
            longer = 3 * new
            row["first_longer_ms_per_token"] = (timed(lambda: generate(model, name, ids, longer)) - call) * 1e3 / (longer - new)  # noqa: B023
            row["steady_ms_per_token"] = steady_ms_per_token(lambda n: generate(model, name, ids, n), new, longer, reps)  # noqa: B023
        if device == "cuda":  # the GPU's share of a token: kernels and their time, by class too, prefill taken out
            long, one = lambda: generate(model, name, ids, new), lambda: generate(model, name, ids, 1)  # noqa: B023
            weights, kv = decode_read_parts(model, batch, prompt_len, new)
            row.update(gpu_per_token(long, one, new, weights + kv, peak_bandwidth(ids.device), weights, kv))
        out = generate(model, name, ids, LOGIT_STEPS + 1, output_logits=True, return_dict_in_generate=True)
        logits = torch.stack(out.logits[1:], 1).float().cpu()  # the decode steps' logits
        ref_path = Path(ref_dir) / f"{shape}-{batch}.pt"
        tokens_path = Path(ref_dir) / f"{shape}-{batch}-tokens.pt"
        truth_path = Path(ref_dir) / f"{shape}-{batch}-fp32.pt"
        if name == "eager":
            torch.save(logits, ref_path)
            torch.save(out.sequences.cpu(), tokens_path)
            with fp32_weights(model):
                torch.save(exact_logits(model, out.sequences, ids.shape[1]), truth_path)
        # only the steps whose tokens so far are eager's: after a greedy token parts, the logits
        # answer another prompt (the reference ones, exact included, follow eager's tokens)
        keep = same_prefix(out.sequences, torch.load(tokens_path), ids.shape[1]) if tokens_path.exists() else \
            torch.ones(logits.shape[:2], dtype=torch.bool)
        row["logit_steps_as_eager"] = keep.float().mean().item()
        if name != "eager" and ref_path.exists():
            row["max_logit_diff"] = max_where(logits - torch.load(ref_path), keep)
        if truth_path.exists():  # eager's bf16 logits are themselves this far from the exact ones
            error = logits - torch.load(truth_path)
            row["max_logit_diff_fp32"] = max_where(error, keep)
            kept = error[keep]
            row["rms_logit_diff_fp32"] = kept.pow(2).mean().sqrt().item() if kept.numel() else float("nan")  # every logit's
        if name.startswith("graphify"):  # against eager in this very process (same kernels chosen)
            with eager_forward(model):
                ref = generate(model, "eager", ids, LOGIT_STEPS + 1, output_logits=True, return_dict_in_generate=True)
            here = same_prefix(out.sequences, ref.sequences, ids.shape[1])
            row["max_logit_diff_same_process"] = max_where(logits - torch.stack(ref.logits[1:], 1).float().cpu(), here)
        forward = getattr(model, "forward", None)
        if hasattr(forward, "stats"):
            modes = {r.mode.value: r.calls for r in forward.stats.by_mode()}
            row["replayed_share"] = modes.get("FULL", 0) / max(sum(modes.values()), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run_chat(name: str, shape: str, count: int | None = None, again: bool = False) -> list[dict]:
    """The chat-like workload from a fresh process: total wall time, first call included; per
    call, its time and (`again`) the same call's time in a second pass once compiles are done,
    and for a background line the call that took compiled graphs in (`chat_swap_call`)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(shape, device)
    one_line(name, model)
    calls = chat_calls(model.config.vocab_size, device == "cuda", count)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, model.config.vocab_size, (b, n), generator=gen).to(device) for b, n, _ in calls]
    jobs = getattr(getattr(model.forward, "_first_use", None), "jobs", None)  # the background line's
    swap_call = None
    sync()
    start = time.perf_counter()
    per_call = []
    for ids, (_, _, new) in zip(prompts, calls):
        per_call.append(timed(lambda: generate(model, name, ids, new)))  # noqa: B023
        if swap_call is None and jobs is not None and jobs.swaps:
            swap_call = len(per_call) - 1
    total = time.perf_counter() - start
    tokens = sum(b * n for b, _, n in calls)
    row = {"model": shape, "key": name, "config": CONFIGS[name], "chat_total_s": total, "chat_calls": len(calls),
           "chat_new_tokens": tokens, "chat_slowest_call_s": max(per_call), "chat_call_s": per_call,
           "chat_call_shapes": calls, "chat_swap_call": swap_call}
    if again:
        if jobs is not None:
            model.forward.wait_compiles()
        row["chat_call_again_s"] = [timed(lambda: generate(model, name, ids, new))  # noqa: B023
                                    for ids, (_, _, new) in zip(prompts, calls)]
        row.update(chat_slowdowns(per_call, row["chat_call_again_s"], swap_call))
    return [row]


def chat_slowdowns(first: list[float], again: list[float], swap_call: int | None) -> dict:
    """Each call's first-pass time over its second-pass time, the largest, the largest over
    the larger of its neighbours' after the first call, and the swap call's over its neighbours'
    (the target: no call past 1.5x its neighbours)."""
    slowdown = [f / a for f, a in zip(first, again)]
    out = {"chat_slowdown": slowdown, "chat_max_slowdown_after_first": max(slowdown[1:], default=None),
           "chat_max_vs_neighbours": max((over_neighbours(slowdown, i) for i in range(1, len(slowdown))), default=None)}
    if swap_call is not None:
        out["chat_swap_slowdown"] = slowdown[swap_call]
        out["chat_swap_vs_neighbours"] = over_neighbours(slowdown, swap_call)
    return out


def over_neighbours(slowdown: list[float], i: int) -> float | None:
    """Call `i`'s slowdown over the larger of its neighbours' (None: it has none)."""
    near = [slowdown[j] for j in (i - 1, i + 1) if 0 <= j < len(slowdown)]
    return slowdown[i] / max(near) if near else None


def worker(args) -> None:
    background_failure_raises()
    if args.chat:
        rows = run_chat(args.worker, args.models[0], args.chat_calls, args.chat_again)
    else:
        rows = run_config(args.worker, args.models[0], args.batches, args.new_tokens, args.prompt_len, args.reps, args.ref)
    for r in rows:
        r["process"] = args.process
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def spawn(config: str, shape: str, args, ref: str, out: str, chat: bool = False, process: int = 1) -> str | None:
    """One configuration's process. Each has compile caches of its own (inductor's, Triton's),
    empty for its first process; a second one (`process=2`, a service restart) finds them as
    the first left them. The chat-like workload starts from empty caches too."""
    cmd = [sys.executable, "-m", "benchmarks.hf_generate", "--worker", config, "--models", shape,
           "--batches", *map(str, args.batches), "--new-tokens", str(args.new_tokens),
           "--prompt-len", str(args.prompt_len), "--reps", str(args.reps), "--ref", ref, "--out", out,
           "--process", str(process)]
    if chat:
        cmd += ["--chat"] + (["--chat-calls", str(args.chat_calls)] if args.chat_calls else []) \
            + (["--chat-again"] if args.chat_again else [])
    caches = Path(ref) / f"caches-{shape}-{config}{'-chat' if chat else ''}"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
    return run_process(cmd, f"{config}{' chat' if chat else ''} (process {process}) on {shape}", args.timeout, env)


COLUMNS = [
    ("model", "model", ""), ("batch", "B", "d"), ("config", "configuration", ""), ("process", "process", "d"),
    ("ms_per_token", "ms/token, 64-token call", ".2f"), ("vs_peer", "÷ peer", ".2f"),
    ("gpu_ms_per_token", "GPU ms/token", ".2f"), ("kernels_per_token", "kernels/token", ".0f"),
    ("gpu_idle_us_per_token", "GPU idle µs/token", ".0f"), ("achieved_gb_s", "GB/s", ".0f"),
    ("gemm_us_per_token", "GEMM µs/token", ".0f"), ("gemm_gb_s", "GEMM GB/s", ".0f"),
    ("attention_us_per_token", "attention µs/token", ".0f"),
    ("floor_ms_per_token", "floor ms/token", ".2f"), ("gpu_vs_floor", "GPU ÷ floor", ".2f"),
    ("steady_ms_per_token", "steady ms/token", ".2f"), ("steady_vs_peer", "÷ peer", ".2f"),
    ("first_longer_ms_per_token", "first 192-token call, ms/extra token", ".1f"),
    ("first_generate_s", "first generate() s", ".1f"), ("first_vs_peer", "÷ peer", ".2f"),
    ("ttft_ms", "time to first token ms", ".2f"), ("ttft_vs_eager", "÷ eager", ".3f"),
    ("ttft_in_turn_ms", "same, in turn with eager in this process", ".2f"),
    ("ttft_eager_in_turn_ms", "eager's, in turn", ".2f"), ("ttft_vs_eager_in_turn", "÷ eager's, in turn", ".3f"),
    ("compiling_ttft_vs_eager_in_turn", "÷ eager's, in turn, while the worker compiles", ".3f"),
    ("ttft_gpu_ms", "its GPU ms", ".2f"), ("ttft_gpu_idle_ms", "its GPU idle ms", ".2f"), ("ttft_kernels", "its kernels", ".0f"),
    ("compiled_ready_s", "compiled kernels ready s", ".1f"), ("swap_generate_s", "generate() that takes them in s", ".1f"), ("swap_vs_call", "÷ a 64-token call", ".2f"),
    ("replayed_share", "calls replayed", ".2f"),
    ("logit_steps_as_eager", f"share of the {LOGIT_STEPS} steps on eager's tokens", ".2f"),
    ("max_logit_diff", f"max logit Δ vs eager, {LOGIT_STEPS} steps", ".3g"),
    ("max_logit_diff_same_process", "same, eager in this process", ".3g"),
    ("max_logit_diff_fp32", f"max logit Δ vs fp32, {LOGIT_STEPS} steps", ".3g"),
    ("rms_logit_diff_fp32", "rms, fp32", ".3g"),
]
CHAT_COLUMNS = [
    ("model", "model", ""), ("config", "configuration", ""), ("chat_total_s", "chat-like total s", ".1f"),
    ("chat_vs_peer", "÷ peer", ".2f"), ("chat_slowest_call_s", "slowest call s", ".1f"),
    ("chat_new_tokens", "new tokens", "d"), ("chat_swap_call", "call that took compiled graphs in", "d"),
    ("chat_max_slowdown_after_first", "largest ÷ own second pass, after the first call", ".2f"),
    ("chat_swap_vs_neighbours", "that call's ÷ its neighbours'", ".2f"),
    ("chat_max_vs_neighbours", "largest call's ÷ its neighbours', after the first", ".2f"),
]


def add_ratios(rows: list[dict]) -> None:
    """Each row's ratios to the peer (transformers' own compile) at the same model and batch."""
    index = {(r["model"], r.get("batch"), r["key"], "chat_total_s" in r, r.get("process", 1)): r for r in rows}
    for r in rows:
        ref = index.get((r["model"], r.get("batch"), PEER, "chat_total_s" in r, r.get("process", 1)))
        if ref is None:
            continue
        for key, out in (("ms_per_token", "vs_peer"), ("steady_ms_per_token", "steady_vs_peer"),
                         ("first_generate_s", "first_vs_peer"), ("chat_total_s", "chat_vs_peer")):
            if key in r and key in ref and ref[key] > 0:
                r[out] = r[key] / ref[key]
    for r in rows:  # time to first token: a generate() of one new token, beside eager's
        eager = index.get((r["model"], r.get("batch"), "eager", False, r.get("process", 1)))
        if eager is not None and r.get("ttft_ms") and eager.get("ttft_ms"):
            r["ttft_vs_eager"] = r["ttft_ms"] / eager["ttft_ms"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = torch.cuda.is_available()
    parser.add_argument("--models", nargs="+", default=["qwen0.5b", "llama8b"] if gpu else ["tiny-qwen"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32] if gpu else [1, 3])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                        default=[c for c in CONFIGS if c not in TRIALS] if gpu else ["eager", "graphify"])
    parser.add_argument("--chat-configs", nargs="*", default=[PEER, "graphify"] if gpu else ["graphify"])
    parser.add_argument("--restart-configs", nargs="*", default=[PEER, "graphify_background"] if gpu else [],
                        help="configurations run again in a second process that finds the first one's compile caches")
    parser.add_argument("--new-tokens", type=int, default=64 if gpu else 8)
    parser.add_argument("--prompt-len", type=int, default=128 if gpu else 8)
    parser.add_argument("--reps", type=int, default=5 if gpu else 1)
    worker_arguments(parser)
    parser.add_argument("--process", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--chat-calls", type=int, default=None,
                        help="calls in the chat-like workload (default: 20 on a GPU); at 8B the worker's compile "
                             "takes about 60 s, so about 40 calls see the swap inside the loop")
    parser.add_argument("--chat-again", action="store_true",
                        help="time the chat-like workload's calls again once compiles are done: each call's "
                             "slowdown, and the swap call's against its neighbours'")
    parser.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ref", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    env = environment()
    import transformers

    env["transformers"] = transformers.__version__
    failures: list[str] = []
    configs = ["eager"] + [c for c in args.configs if c != "eager"]  # eager first: the logit reference
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        for shape in args.models:
            jobs = [(c, False, 1) for c in configs] + [(c, False, 2) for c in args.restart_configs]
            jobs += [(c, True, 1) for c in args.chat_configs]
            for config, chat, process in jobs:
                print(f"{shape}: {config}{' chat' if chat else ''}{' (restart)' if process == 2 else ''} ...", flush=True)
                err = spawn(config, shape, args, tmp, out, chat, process)
                if err:
                    failures.append(err)
                    print("  " + err, flush=True)
                rows = [json.loads(line) for line in Path(out).read_text().splitlines()] if os.path.exists(out) else []
                report(env, rows, failures, args)  # after every job: a cut run still leaves its results


def report(env: dict, rows: list[dict], failures: list[str], args) -> None:
    from ._report import table

    rows = [dict(r) for r in rows]
    add_ratios(rows)
    note = "" if env["gpu"] else "\n\nCPU simulation backend, tiny config: not GPU timings.\n"
    md = (f"transformers {env.get('transformers')}; peer: {CONFIGS[PEER]}. Prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, greedy, bf16.\n\n")
    md += table([r for r in rows if "chat_total_s" not in r], COLUMNS)
    chat = [r for r in rows if "chat_total_s" in r]
    if chat:
        md += f"\n\nChat-like workload ({chat[0]['chat_calls']} seeded generate() calls, fresh process):\n\n" + table(chat, CHAT_COLUMNS)
    md += note + "".join(f"\n- failed: {f}" for f in failures)
    publish("hf-generate" + (f"-{args.tag}" if args.tag else ""), {"env": dict(env), "rows": rows, "failures": failures,
                                                                   "args": vars(args)}, md)


if __name__ == "__main__":
    main()
