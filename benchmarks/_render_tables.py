"""What the results tables and README's short table are made of, as data.

`BENCHES` describes each benchmark once: which rows of its result files make a table, which
fields name a configuration and which are its measured columns, and the code changes
(eras) that change what a configuration of it measures. `CLAIMS` are the rows of README.md's
short table, each naming the table and the rows it is rendered from.
`benchmarks.render_results` reads the files and renders both; nothing here reads a file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


# -- what a benchmark's files hold, as data ---------------------------------------------------
@dataclass(frozen=True)
class Col:
    """A column: a row field, its header and a format spec ("" prints the value as is)."""

    field: str
    header: str
    fmt: str = ""


@dataclass(frozen=True)
class Table:
    """Rows a run's JSON gives (`rows`), the fields that make one configuration (`key`) and
    the measured columns (`cols`)."""

    name: str
    title: str
    key: tuple[Col, ...]
    cols: tuple[Col, ...]
    rows: Callable[[dict], list[dict]] = lambda data: data["rows"]


@dataclass(frozen=True)
class Bench:
    """A benchmark: its files are `<kind>[-<tag>]-<device>.json`. `eras` are changes to the
    code that change what a configuration of it measures, (ISO time, what changed): runs on
    either side of one are never aggregated together."""

    kind: str
    title: str
    command: str
    about: str
    tables: tuple[Table, ...]
    eras: tuple[tuple[str, str], ...] = ()


# Names the tables and README's claims share: configurations, and code changes (eras).
CONFIG = Col("config", "configuration")
HF_KEY = (Col("model", "model"), CONFIG, Col("batch", "B"))  # a transformers run's configuration
PROCESS = Col("process", "process")
SERVING_RO = "torch.compile reduce-overhead"
SERVING_OWN = "each peer-compared configuration in a process of its own"
SERVING_TWICE = "FULL keys of compiled pieces warm up twice; a 1st and a 2nd process per configuration"
SERVING_WRITES = "later keys learn their writes without a recorded eager run"
TP_TWO_SHOT = "the symm_mem all-reduce's defaults send large messages to its two-shot reduce (models/_symm_mem.py)"
TP_LINED_UP = "the ranks line up before the timed trace (its first step waited out their skew: benchmarks/tensor_parallel.py)"
HF_OFF = "the one line turns transformers' compile off"
HF_THREAD = "`Options(compile=True)` compiles in a background thread (since removed)"
HF_DYNAMIC = "`Options(compile=True)` compiles in the caller's thread again, with dynamic shapes"
HF_FLOATS = "`Options(compile=True)` specialises Python floats (one trace a compile)"
HF_CACHE_KEYS = "the background line's worker keys its compiles as the caller does (precision settings, dynamo's marks)"
HF_VIEWS = "the background line's worker gets a call's views as views (dynamo names their bases' sizes too)"
HF_MASKS = "a graphified model builds its decode masks inside its graphs (transforms/_hf_masks.py)"
HF_HYBRID_MASKS = "sliding-window and hybrid caches' decode masks are slices of the 2D mask (transforms/_hf_hybrid_masks.py)"
HF_HOST = "a call's host time before the replay: sliding layers' state read once a call, one pass of checks (graphify/_call_structure.py)"
HF_GQA_FOLD = "the compile line's decode attention reads the unexpanded keys and values (graphify/_gqa_fold.py)"
HF_STEADY_PAIRS = "steady ms/token is the median over back-to-back pairs of calls, not a difference of two medians"
HF_MASK_MEMO = "the decode mask's padding reads the config and the cache once per pair, not every step (transforms/_hf_masks.py)"
HF_AOT_LOAD = "the compiled line's swap loads the worker's compiled function whole: no trace in the caller (graphify/_aot.py)"
HF_SWAP_KIN = ("the swap's capture is a kin of the plain structure it replaces: no eager warm-up call, no recorded eager "
               "run; a restarted process's kept function serves later sizes (graphify/capture/kin_writes.py)")
HF_SWAP_CHECKS = ("the swap's checks: code hashed once a process, ahead in the thread that loads the compiled function; "
                  "a dispatcher's rows built at first use and shared (graphify/_aot_identity.py, graphify/_dispatch.py)")


# Rows of a run's JSON, as a table reads them.
def ratio_to(field_: str, peer: str, match: str | None = None) -> Callable[[dict, list[dict]], float | None]:
    """A row's `field_` over that of the row whose config is `peer` in the same run (and the
    same `match` field): a ratio taken within one run, on one host."""

    def ratio(row: dict, rows: list[dict]) -> float | None:
        for other in rows:
            if other.get("config") == peer and (match is None or other.get(match) == row.get(match)):
                return row[field_] / other[field_] if row.get(field_) and other.get(field_) else None
        return None

    return ratio


def derive(rows: list[dict], **fields: Callable[[dict, list[dict]], object]) -> list[dict]:
    """Copies of `rows` with derived fields, each computed from the row and its run's rows."""
    return [{**row, **{name: fn(row, rows) for name, fn in fields.items()}} for row in rows]


def serving_rows(data: dict) -> list[dict]:
    """The trace's rows, with tokens/s and start-up over the peer's in the same process kind."""
    return derive(data["rows"], vs_ro=ratio_to("tokens_per_s", SERVING_RO, "process"),
                  startup_vs_ro=ratio_to("startup_s", SERVING_RO, "process"))


def by_kind_rows(data: dict) -> list[dict]:
    """Rows that hold milliseconds per step kind, those spread into fields of their own."""
    return [{**row, **row["ms_by_kind"]} for row in data["rows"] if "ms_by_kind" in row]


def with_config(name: str, rows_of: str = "rows") -> Callable[[dict], list[dict]]:
    """The `rows_of` list, each row also holding the run's config[`name`]."""
    return lambda data: [{**row, name: data["config"][name]} for row in data[rows_of]]


def piecewise_rows(rows_of: str) -> Callable[[dict], list[dict]]:
    """The `rows_of` list, each row also saying whether the run's pieces were compiled."""

    def rows(data: dict) -> list[dict]:
        pieces = "inductor" if data["config"]["inductor_pieces"] else "plain"
        return [{**row, "pieces": pieces} for row in data[rows_of]]

    return rows


def swap_vs_call(row: dict, data: dict) -> float | None:
    """The `generate()` that took the compiled graphs in over a later call of the same length
    (its time to first token and the other tokens at the call's pace), as the benchmark now
    records it; worked out here for runs before it did."""
    if "swap_vs_call" in row or not all(row.get(k) for k in ("swap_generate_s", "ttft_ms", "ms_per_token")):
        return row.get("swap_vs_call")
    new = data.get("args", {}).get("new_tokens", 64)
    return row["swap_generate_s"] * 1e3 / (row["ttft_ms"] + (new - 1) * row["ms_per_token"])


def hf_per_token_rows(data: dict) -> list[dict]:
    """The per-token rows, with `swap_vs_call` where the run took compiled graphs in."""
    return [{**row, "swap_vs_call": swap_vs_call(row, data)} for row in rows_with("ms_per_token")(data)]


def rows_with(name: str) -> Callable[[dict], list[dict]]:
    """The rows that hold field `name` (a file's rows of several kinds, one kind a table)."""
    return lambda data: [row for row in data["rows"] if name in row]


# Every benchmark whose files are rendered; a file of another name is not read.
BENCHES: tuple[Bench, ...] = (
    Bench(
        "serving", "Main job: the serving trace", "python3 -m benchmarks",
        "A seeded trace of requests (chunked prefills mixed with decodes and speculative-decode steps) "
        "through the reference decoder in each graphify mode and under torch.compile's reduce-overhead, "
        "the peer. `÷ RO` is a ratio to the peer's row of the same run and process: a 1st process finds "
        "the compile caches as they are, a 2nd compiles from them. Start-up is split, compile and "
        "capture (the peer: its first pass less a steady pass).",
        (
            Table("trace", "The trace", (CONFIG, PROCESS), (
                Col("tokens_per_s", "tokens/s", ",.0f"), Col("vs_ro", "÷ RO tokens/s", ".3f"),
                Col("p50_ms", "p50 ms", ".2f"), Col("p99_ms", "p99 ms", ".2f"),
                Col("startup_s", "start-up s", ".1f"), Col("startup_vs_ro", "÷ RO start-up", ".2f"),
                Col("startup_s_again", "start-up s, next process", ".1f"), Col("graph_mib", "graph MiB", ".0f"),
                Col("max_err_vs_eager", "max err vs eager", ".3g"),
            ), serving_rows),
            Table("decode", "Batch-8 decode step of the same model", (CONFIG, PROCESS), (
                Col("step_ms", "step ms", ".3f"), Col("step_vs_reduce_overhead", "÷ RO", ".3f"),
                Col("host_us", "host µs", ".0f"), Col("kernels_per_step", "kernels", ".0f"),
                Col("gpu_idle_us", "GPU idle µs", ".0f"), Col("max_err_vs_eager", "max err vs eager", ".3g"),
            ), lambda data: data["decode"]),
            Table("by-kind", "Milliseconds summed per step kind", (CONFIG, PROCESS), (
                Col("prefill", "prefill ms", ".1f"), Col("decode", "decode ms", ".1f"),
                Col("mixed", "mixed ms", ".1f"), Col("spec", "spec ms", ".1f"),
            ), by_kind_rows),
        ),
        eras=(("2026-11-25T03:50:00+00:00", SERVING_OWN), ("2026-11-25T07:55:00+00:00", SERVING_TWICE),
              ("2026-11-25T09:15:00+00:00", SERVING_WRITES)),
    ),
    Bench(
        "hf-generate", "transformers `generate()`", "python3 -m benchmarks.hf_generate",
        "`model.generate()` as users call it (greedy, static cache), random-weight models from configs, "
        "bf16, one configuration a process: eager, transformers' own compile of the decode step (the "
        "peer: what transformers does without the line), graphify's one line, and the line with "
        "`Options(compile=True)`. ms/token is a whole call's time per new token; steady is a later call's; "
        "the first longer call pays for a new cache length; the chat-like workload is a fixed list of "
        "calls of several batch sizes and lengths, timed whole from a fresh process.",
        (
            Table("per-token", "Per token", HF_KEY, (
                Col("ms_per_token", "ms/token", ".2f"), Col("steady_ms_per_token", "steady ms/token", ".2f"),
                Col("first_generate_s", "first generate() s", ".1f"),
                Col("ttft_ms", "time to first token ms", ".2f"), Col("ttft_vs_eager", "÷ eager", ".3f"),
                Col("ttft_vs_eager_in_turn", "÷ eager's, in turn in one process", ".3f"),
                Col("ttft_gpu_ms", "its GPU ms", ".2f"),
                Col("first_longer_ms_per_token", "first longer call, ms/token", ".1f"),
                Col("gpu_ms_per_token", "GPU ms/token", ".2f"), Col("kernels_per_token", "kernels/token", ".0f"),
                Col("gpu_idle_us_per_token", "GPU idle µs/token", ".0f"), Col("achieved_gb_s", "GB/s", ".0f"),
                Col("gpu_vs_floor", "GPU ÷ weight+KV floor", ".2f"),
                Col("gemm_us_per_token", "GEMM µs/token", ".0f"), Col("gemm_gb_s", "GEMM GB/s", ".0f"),
                Col("attention_us_per_token", "attention µs/token", ".0f"),
                Col("logit_steps_as_eager", "logit steps on eager's tokens", ".2f"),
                Col("max_logit_diff", "max logit diff vs eager", ".3g"),
                Col("max_logit_diff_fp32", "vs fp32", ".3g"), Col("rms_logit_diff_fp32", "rms vs fp32", ".3g"),
                Col("swap_generate_s", "generate() that takes compiled graphs in, s", ".2f"),
                Col("swap_vs_call", "÷ a later call", ".2f"),
            ), hf_per_token_rows),
            Table("chat", "Chat-like workload", (Col("model", "model"), CONFIG), (
                Col("chat_calls", "calls", "d"), Col("chat_total_s", "total s", ".1f"), Col("chat_slowest_call_s", "slowest call s", ".1f"),
                Col("chat_swap_call", "call that took compiled graphs in", "d"),
                Col("chat_swap_vs_neighbours", "its slowdown ÷ its neighbours'", ".2f"),
                Col("chat_max_vs_neighbours", "largest call's ÷ its neighbours', after the first", ".2f"),
            ), rows_with("chat_total_s")),
        ),
        eras=(("2026-11-23T23:00:00+00:00", HF_OFF), ("2026-11-23T23:25:00+00:00", HF_THREAD),
              ("2026-11-24T00:30:00+00:00", HF_DYNAMIC),
              ("2026-11-25T11:00:00+00:00", HF_FLOATS), ("2026-11-26T00:50:00+00:00", HF_CACHE_KEYS),
              ("2026-11-26T02:20:00+00:00", HF_VIEWS), ("2026-11-26T06:00:00+00:00", HF_MASKS),
              ("2026-11-26T07:35:00+00:00", HF_HYBRID_MASKS), ("2026-11-26T09:30:00+00:00", HF_GQA_FOLD),
              ("2026-11-26T10:30:00+00:00", HF_HOST), ("2026-11-26T12:20:00+00:00", HF_STEADY_PAIRS),
              ("2026-11-26T12:58:00+00:00", HF_MASK_MEMO), ("2026-11-27T00:00:00+00:00", HF_AOT_LOAD),
              ("2026-11-27T16:40:00+00:00", HF_SWAP_KIN), ("2026-11-27T20:48:00+00:00", HF_SWAP_CHECKS)),
    ),
    Bench(
        "hf-step-split", "transformers `generate()`: a decode step split by clocks",
        "python3 -m benchmarks.hf_step_split",
        "Each decode step of a 64-token `generate()` split by clocks, one configuration a process, its "
        "compiled graphs in: the period from one graph launch to the next (what a token costs), the "
        "forward call's host time before the launch, transformers' own step between calls (its "
        "`prepare_inputs_for_generation` apart), and with CUDA events the GPU's step and the gap between "
        "steps. Medians over a call's steps, the median call of five.",
        (
            Table("rows", "Decode step", HF_KEY, (
                Col("period_us", "period µs", ".0f"), Col("pre_launch_us", "pre-launch µs", ".0f"),
                Col("between_us", "between calls µs", ".0f"), Col("prepare_us", "prepare µs", ".0f"),
                Col("gpu_graph_us", "GPU graph µs", ".0f"), Col("gpu_gap_us", "GPU gap µs", ".0f"),
                Col("full_checks_per_call", "watch's full compares / call", ".2f"),
            )),
        ),
    ),
    Bench(
        "hf-accuracy", "transformers `generate()`: logits against the exact ones", "python3 -m benchmarks.hf_accuracy",
        "Each line's decode logits over several seeded prompts and greedy steps, one configuration a "
        "process, its compiled graphs in, against eager's bf16 logits and against the exact ones (the "
        "same weights in fp32 arithmetic over eager's tokens), over the steps where every line's tokens so "
        "far equal eager's (s49a: each line over its own such steps). Two bf16 lines differ from eager by their rounding alone; from the exact logits, by "
        "their own error. `graphify_unfolded` is the background line with the grouped-query fold off.",
        (
            Table("rows", "Logit differences", HF_KEY, (
                Col("compared", "steps compared", ".2f"), Col("max_vs_eager", "max vs eager", ".3g"),
                Col("rms_vs_eager", "rms vs eager", ".3g"), Col("max_vs_fp32", "max vs fp32", ".3g"),
                Col("rms_vs_fp32", "rms vs fp32", ".3g"), Col("rms_vs_peer", "rms vs fp32 ÷ peer's", ".3f"),
            )),
        ),
    ),
    Bench(
        "decode", "FULL decode beside a hand-written CUDA graph", "python3 -m benchmarks.decode [--model 8b]",
        "FULL graphs of the reference decoder's decode step beside a plain `torch.cuda.CUDAGraph` loop over "
        "the same step (the floor), and eager. Host columns: a call's host time with the device idle, "
        "all variants interleaved; graphify's own is the call with the launch stubbed.",
        (
            Table("rows", "Decode step", (Col("model", "model"), Col("batch", "B")), (
                Col("eager_ms", "eager ms", ".2f"), Col("floor_ms", "hand graph ms", ".3f"),
                Col("graphify_ms", "graphify ms", ".3f"), Col("graphify_vs_floor", "÷ hand", ".3f"),
                Col("speedup_vs_eager", "× eager", ".1f"), Col("default_host_us", "host µs, default", ".1f"),
                Col("graphify_static_host_us", "host µs, static inputs + view", ".1f"),
                Col("replay_host_us", "host µs, bare replay", ".1f"), Col("own_host_us", "host µs, graphify's own", ".1f"),
            ), with_config("model")),
            Table("dispatch", "Dispatch alone", (Col("model", "model"), Col("what", "call")), (
                Col("us_per_call", "µs a call", ".3f"),
            ), with_config("model", "dispatch")),
        ),
    ),
    Bench(
        "decode-profile", "Where a step's time goes", "python3 -m benchmarks.decode_profile [--peer] [--step N]",
        "One step of the reference decoder replayed alone under torch.profiler: kernels, their GPU time, "
        "the GPU's idle time inside the step and the host time to issue it.",
        (
            Table("rows", "Step profile", (Col("step", "step"), CONFIG), (
                Col("step_ms", "step ms", ".3f"), Col("kernels_per_step", "kernels", ".0f"),
                Col("gpu_ms", "GPU ms", ".3f"), Col("gpu_idle_us", "GPU idle µs", ".0f"),
                Col("host_us", "host µs", ".0f"), Col("capture_s", "capture s", ".1f"),
            ), lambda data: [{**row, "step": data.get("what", "batch-8 decode")} for row in data["rows"]]),
        ),
    ),
    Bench(
        "compile-state", "Does a cold compile slow the graphs it replays?", "python3 -m benchmarks.compile_state",
        "Inductor pieces compiled cold (B) and loaded from the caches (A) in one process, stepped after each stage.",
        (
            Table("rows", "Stages", (Col("stage", "stage"), Col("graph", "graph")), (
                Col("step_ms", "step ms", ".3f"), Col("kernels", "kernels", ".0f"), Col("gpu_ms", "GPU ms", ".3f"),
                Col("gpu_idle_us", "GPU idle µs", ".0f"),
            )),
        ),
    ),
    Bench(
        "compile-sizes", "Shape-specialised compiles", "python3 -m benchmarks.compile_sizes",
        "FULL graph of a decode batch of that many requests with dynamic inductor pieces beside pieces compiled "
        "for the size's exact shapes: the step time saved and what the compile costs, cold and warm caches.",
        (
            Table("rows", "Per size", (Col("tokens", "tokens"),), (
                Col("dynamic_ms", "dynamic ms", ".3f"), Col("specialised_ms", "specialised ms", ".3f"),
                Col("step_gain", "step time saved", ".1%"), Col("compile_s_cold", "compile s, cold", ".1f"),
                Col("compile_s_warm", "compile s, warm", ".2f"),
            )),
        ),
    ),
    Bench(
        "call-cost", "Host cost of one call", "python3 -m benchmarks.call_cost",
        "A FULL decode call's host time, each call issued with the device idle, all variants interleaved, "
        "beside a bare `CUDAGraph.replay()` of the same graph.",
        (
            Table("rows", "Per call", (Col("batch", "B"), Col("what", "call")), (
                Col("us", "host µs", ".1f"), Col("vs_replay", "÷ replay", ".2f"),
            ), lambda data: [{**row, "batch": row["batch"] or None} for row in data["rows"]]),
        ),
    ),
    Bench(
        "memory", "Graph memory", "python3 -m benchmarks.memory",
        "Every decode size captured into one pool largest first, smallest first, or a pool per size; a draft "
        "and a target model sharing a pool; a CuPy function on the cupy backend.",
        (
            Table("rows", "Pools", (CONFIG,), (
                Col("graphs", "graphs", ".0f"), Col("pools", "pools", ".0f"), Col("pool_mib", "pools reserve MiB", ".1f"),
                Col("in_use_mib", "in use MiB", ".1f"), Col("reserved_mib", "torch reserved +MiB", ".1f"),
                Col("left_after_drop_mib", "left after drop MiB", ".1f"), Col("capture_s", "capture s", ".2f"),
                Col("max_err", "max err vs eager", ".3g"),
            )),
        ),
    ),
    Bench(
        "piecewise", "Piecewise and the dual modes", "python3 -m benchmarks.piecewise [--inductor]",
        "The varlen reference model with a paged KV cache: PIECEWISE runs the attention op eagerly between "
        "captured pieces; FULL_AND_PIECEWISE sends uniform decode to FULL and mixed batches to PIECEWISE. "
        "Pieces are plain or compiled by inductor.",
        (
            Table("rows", "Per scenario", (Col("pieces", "pieces"), Col("scenario", "scenario"), Col("mode", "mode"),
                                           Col("tokens", "tokens"), Col("reqs", "reqs")), (
                Col("runtime", "ran as"), Col("ms", "ms/step", ".3f"), Col("speedup_vs_none", "× NONE", ".2f"),
                Col("vs_full", "÷ FULL", ".2f"), Col("max_err", "max err vs eager", ".3g"),
            ), piecewise_rows("rows")),
            Table("captures", "Capture", (Col("pieces", "pieces"), Col("what", "schedule"), Col("mode", "mode")), (
                Col("graphs", "graphs", ".0f"), Col("seconds", "seconds", ".2f"), Col("pool_mib", "pool MiB", ".0f"),
            ), piecewise_rows("captures")),
        ),
    ),
    Bench(
        "startup", "Start-up at two model scales", "python3 -m benchmarks.startup",
        "FULL_AND_PIECEWISE over schedules of several lengths, largest first into one pool, beside the same "
        "graphs captured by a plain `torch.cuda.graph` loop after the same split (the hand loop).",
        (
            Table("rows", "Per schedule", (Col("model", "model"), Col("sizes", "sizes")), (
                Col("graphs", "graphs", ".0f"), Col("split_s", "split s", ".2f"), Col("graphify_s", "capture s", ".2f"),
                Col("startup_s", "start-up s", ".2f"), Col("floor_s", "hand loop s", ".2f"),
                Col("capture_vs_floor", "capture ÷ hand", ".2f"), Col("graphify_mib", "pool MiB", ".0f"),
                Col("floor_mib", "hand pool MiB", ".0f"),
            )),
        ),
    ),
    Bench(
        "tensor-parallel", "Tensor parallelism", "torchrun --nproc-per-node 2 -m benchmarks.tensor_parallel",
        "Decode steps of the sharded reference model at TP=2 (and more where the GPUs are lent) beside a "
        "hand-written loop of CUDA graphs over the same step and the single-GPU step built the same way, per "
        "lever (plain: the step as written; pieces: its inductor-compiled pieces) and all-reduce (NCCL or a "
        "one-shot symmetric-memory reduce). Floor: one GPU's weight bytes ÷ its peak HBM bandwidth.",
        (
            Table("rows", "Decode step", (Col("model", "model"), Col("tp", "TP"), Col("lever", "lever"),
                                          Col("all_reduce", "all-reduce"), Col("batch", "B")), (
                Col("tp1_ms", "TP=1 ms", ".3f"), Col("graphify_ms", "TP ms", ".3f"), Col("hand_ms", "hand loop ms", ".3f"),
                Col("graphify_vs_hand", "÷ hand", ".3f"), Col("tp_vs_tp1", "TP ÷ TP=1", ".3f"),
                Col("vs_weight_floor", "÷ weight floor", ".2f"), Col("kernels", "kernels", ".0f"),
                Col("all_reduce_us", "µs / all-reduce", ".1f"), Col("graphify_host_us", "host µs", ".0f"),
            ), lambda data: [{"all_reduce": "nccl", "tp": 2, "lever": "plain", **row}
                             for row in data["rows"] if row.get("batch") is not None]),
        ),
        eras=(("2026-11-28T05:55:00+00:00", TP_TWO_SHOT),),
    ),
    Bench(
        "tensor-parallel-serving", "Tensor parallelism: the main job's trace",
        "torchrun --nproc-per-node 2 -m benchmarks.tensor_parallel --what serving",
        "The main job's trace in FULL_AND_PIECEWISE on one GPU and on two, 0.5B and (`--serving-model 8b`) 8B shapes.",
        (
            Table("rows", "The trace", (Col("model", "model"), CONFIG), (
                Col("tokens_per_s", "tokens/s", ",.0f"), Col("vs_tp1", "÷ TP=1", ".3f"), Col("p50_ms", "p50 ms", ".2f"),
                Col("p99_ms", "p99 ms", ".2f"), Col("startup_s", "start-up s", ".1f"),
            ), lambda data: [{**row, "model": data["config"]["model"]} for row in derive(data["rows"], vs_tp1=vs_tp1)]),
        ),
        eras=(("2026-11-28T05:55:00+00:00", TP_TWO_SHOT), ("2026-11-28T06:00:00+00:00", TP_LINED_UP)),
    ),
    Bench(
        "all-reduce-crossover", "Tensor parallelism: one-shot, two-shot and NCCL all-reduces by message size",
        "torchrun --nproc-per-node 2 -m benchmarks.all_reduce_crossover",
        "A [tokens, hidden] bf16 all-reduce inside a captured graph of back-to-back reduces, per kind: the "
        "one-shot symmetric-memory reduce, the two-shot one through the same buffer, NCCL's functional one; "
        "the slowest rank's median per reduce, each kind checked against NCCL's sum on fresh random inputs.",
        (
            Table("rows", "All-reduce", (Col("world", "GPUs"), Col("hidden", "hidden"), Col("tokens", "tokens")), (
                Col("kib", "KiB", ".0f"), Col("one_shot_us", "one-shot µs", ".1f"), Col("two_shot_us", "two-shot µs", ".1f"),
                Col("nccl_us", "NCCL µs", ".1f"), Col("fastest", "fastest"), Col("today", "today's choice"),
            ), lambda data: [{"world": data.get("world"), **row} for row in data["rows"]]),
        ),
    ),
    Bench(
        "one-row-gemm", "Decode's one-row matmuls against peak bandwidth",
        "python3 -m benchmarks.one_row_gemm [--sweep]",
        "`y = x @ w.T` in bf16 at the Llama-3-8B weight shapes, M rows: cuBLAS (`F.linear`), cuBLASLt, inductor's "
        "max-autotune, graphify's Triton GEMV (`choose`'s config) and the fastest of its candidates, each in one "
        "CUDA graph of back-to-back calls over weights past L2, checked against fp32; GB/s over the bytes read.",
        (
            Table("rows", "Per shape", (Col("shape", "shape"), Col("m", "M"), Col("variant", "variant")), (
                Col("us", "µs", ".2f"), Col("gb_s", "GB/s", ".0f"), Col("peak_pct", "% of peak", ".1f"),
                Col("vs_a", "÷ cuBLAS", ".3f"), Col("detail", "config"),
            )),
            Table("summary", "An 8B layer and token", (Col("m", "M"), Col("group", "sum"), Col("variant", "variant")), (
                Col("us", "µs", ".1f"), Col("gb_s", "GB/s", ".0f"), Col("peak_pct", "% of peak", ".1f"),
                Col("vs_a", "÷ cuBLAS", ".3f"),
            )),
        ),
        eras=(("2026-11-28T09:30:00+00:00", "the Triton GEMV's own config at one row is the sweep's winner "
               "(4 rows of w a program, 1024 K a step, plain loads)"),),
    ),
    Bench(
        "hf-tensor-parallel", "Tensor parallelism: a transformers model as users load it",
        "torchrun --nproc-per-node 2 -m benchmarks.hf_tensor_parallel --shape 1b",
        "`from_pretrained(path, tp_plan=\"auto\")` on NCCL, random weights: transformers' eager TP `generate()`, its "
        "own compile under TP, and graphify's one line; ms/token of the decode steps, tokens against eager TP's.",
        (
            Table("rows", "generate()", (Col("shape", "shape"), Col("world", "GPUs"), Col("label", "line"),
                                         Col("batch", "B")), (
                Col("ms_per_token", "ms/token", ".3f"), Col("first_generate_s", "first generate() s", ".2f"),
                Col("tokens_equal", "tokens = eager TP"),
            ), lambda data: [{"shape": data.get("shape"), "world": data.get("world"), **row} for row in data["rows"]]),
        ),
    ),
)


ZOO_KEY = (Col("model", "model"), Col("length", "length"), Col("batch", "B"), Col("line", "line"))
BENCHES += (
    Bench(
        "zoo", "The model zoo: timm, torchvision, transformers", "python3 -m benchmarks.zoo",
        "The models users bring, random weights, bf16, eval: each line (eager, torch.compile's reduce-overhead, "
        "graphify's plain, compile and background lines) in a process of its own from cold compile caches. "
        "`÷ RO`: ms per call over reduce-overhead's for the same model and shape; `s to steady`: from the first "
        "call until the line runs as it will from then on.",
        (
            Table("models", "Per model, shape and line", ZOO_KEY, (
                Col("ms", "ms/call", ".3f"), Col("vs_peer", "÷ RO", ".2f"), Col("vs_eager", "÷ eager", ".2f"),
                Col("max_err", "max err vs eager", ".3g"), Col("first_s", "first call s", ".2f"),
                Col("ready_s", "s to steady", ".1f"), Col("mib", "MiB beyond eager", ".0f"),
                Col("replayed", "replayed", ".0f"),
            )),
        ),
    ),
    Bench(
        "zoo-shapes", "Shapes as users send them: a stream of changing shapes", "python3 -m benchmarks.zoo_shapes",
        "A seeded stream of calls through each line in a process of its own from cold compile caches: images at "
        "two resolutions and batches of 1 and 8, encoder batches of 1-8 rows at 8-512 tokens. First pass: every "
        "compile and capture inside; second pass: the same calls again (it may still capture a shape the first "
        "pass met once); third pass: what a steady service costs (older runs had two passes).",
        (
            Table("stream", "Per model and line", (Col("model", "model"), Col("line", "line")), (
                Col("calls", "calls", ".0f"), Col("shapes", "shapes", ".0f"), Col("first_pass_s", "first pass s", ".2f"),
                Col("second_pass_s", "second pass s", ".3f"), Col("steady_pass_s", "third pass s", ".3f"),
                Col("steady_host_s", "of it host s", ".3f"), Col("steady_vs_eager", "third ÷ eager", ".2f"),
                Col("second_vs_eager", "second ÷ eager (older runs)", ".2f"),
                Col("replayed", "replayed (last pass)", ".0f"), Col("graphs", "graphs held", ".0f"),
                Col("mib", "MiB beyond eager", ".0f"), Col("max_err", "max err vs eager", ".3g"),
            )),
        ),
    ),
)


def vs_tp1(row: dict, rows: list[dict]) -> float | None:
    """A serving row's tokens/s over the TP=1 row's of the same run."""
    one = next((r for r in rows if r.get("tp") == 1 or r.get("config", "").startswith("TP=1 ")), None)
    return row["tokens_per_s"] / one["tokens_per_s"] if one and one.get("tokens_per_s") else None


# -- README.md's short table ------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """Rows of one table picked by `where` (field -> value), shown through `text`, a format
    string whose fields each become the range over the rows; with `per` (field, values),
    the text once per value, joined by " / ". Only the newest code era the rows span counts."""

    where: dict
    text: str
    per: tuple = ()


@dataclass(frozen=True)
class Claim:
    """A row of README's short table: graphify's cell and what it is compared with."""

    what: str
    kind: str
    table: str
    ours: Cell
    peer: Cell | None = None


def serving(config: str, process: str | None, text: str) -> Cell:
    """A cell of the main job's rows of one configuration and process."""
    return Cell({"config": config, "process": process}, text)


FP, FULL = "graphify FULL_AND_PIECEWISE + inductor", "graphify FULL + inductor"
HF_LINE, HF_COMPILE = "graphify(model.forward)", "graphify(model.forward, options=Options(compile=True))"
HF_PEER = "transformers' own compile (no line)"
HF_BACKGROUND = 'graphify(model.forward, options=Options(compile="background"))'
WATCH_NOW = "check alone, 8B structure: graphify's check (Watch.check)"
WATCH_BEFORE = "check alone, 8B structure: graphify's check before (parameters' generation + buffers)"
WATCH_PASSED = "check alone, 8B structure: graphify's check, the model passed as an argument"
B_1_8_32 = ("batch", (1, 8, 32))
B_1_8 = ("batch", (1, 8))
STEP_81 = "trace step 81 (mixed, 512 tokens, 18 requests)"

def hf_vs_peer(title: str, model: str, config: str, text: str, process: int | None = None) -> Claim:
    """A transformers `generate()` claim at B = 1 / 8: `config`'s value beside the peer's
    (of the same process, where `process` is given: 2 is a restart)."""
    where = {"model": model} if process is None else {"model": model, "process": process}
    return Claim(title, "hf-generate", "per-token", Cell({**where, "config": config}, text, B_1_8),
                 Cell({**where, "config": HF_PEER}, text, B_1_8))


CLAIMS: tuple[Claim, ...] = (
    Claim("main job tokens/s, F&P + inductor, 1st process", "serving", "trace",
          serving(FP, "1st", "{tokens_per_s:,.0f} ({vs_ro:.3f}× the peer's)"),
          serving(SERVING_RO, "1st", "reduce-overhead {tokens_per_s:,.0f}")),
    Claim("same, FULL + inductor (every step one graph)", "serving", "trace",
          serving(FULL, "1st", "{tokens_per_s:,.0f} ({vs_ro:.3f}×)"),
          serving(SERVING_RO, "1st", "reduce-overhead {tokens_per_s:,.0f}")),
    Claim("main job p99 ms, F&P + inductor, 1st process", "serving", "trace",
          serving(FP, "1st", "{p99_ms:.2f}"), serving(SERVING_RO, "1st", "reduce-overhead {p99_ms:.2f}")),
    Claim("main job cold start s (1st process), F&P + inductor", "serving", "trace",
          serving(FP, "1st", "{startup_s:.1f} ({startup_vs_ro:.2f}× the peer's)"),
          serving(SERVING_RO, "1st", "reduce-overhead {startup_s:.1f}")),
    Claim("main job next-process start-up s (2nd process): F&P + inductor / FULL + inductor", "serving", "trace",
          Cell({"process": "2nd"}, "{startup_s:.1f}", ("config", (FP, FULL))),
          serving(SERVING_RO, "2nd", "reduce-overhead {startup_s:.1f}")),
    Claim("batch-8 decode step ms, F&P + inductor, 1st process", "serving", "decode",
          serving(FP, "1st", "{step_ms:.3f} ({step_vs_reduce_overhead:.3f}× the peer's), {kernels_per_step:.0f} kernels"),
          serving(SERVING_RO, "1st", "reduce-overhead {step_ms:.3f}, {kernels_per_step:.0f} kernels")),
    Claim("a 512-token mixed step (trace step 81) alone, ms; ours runs PIECEWISE", "decode-profile", "rows",
          Cell({"step": STEP_81, "config": "graphify FULL + inductor pieces"},
               "F&P of inductor pieces {step_ms:.2f}, {kernels_per_step:.0f} kernels"),
          Cell({"step": STEP_81, "config": SERVING_RO}, "reduce-overhead {step_ms:.2f}, {kernels_per_step:.0f} kernels")),
    Claim("whole-step compile for FULL graphs (`Options(compile=True)` on a split function), batch-8 decode",
          "decode-profile", "rows",
          Cell({"step": "batch-8 decode", "config": "graphify FULL, whole step compiled (Options(compile=True))"},
               "{step_ms:.3f} ms, {kernels_per_step:.0f} kernels, built in {capture_s:.1f} s"),
          Cell({"step": "batch-8 decode", "config": "graphify FULL + inductor pieces"},
               "inductor pieces {step_ms:.3f} ms, {kernels_per_step:.0f} kernels, built in {capture_s:.1f} s")),
    Claim("transformers `generate()`, 0.5B, ms/token in a 64-token call, B = 1 / 8 / 32: the one line",
          "hf-generate", "per-token", Cell({"model": "qwen0.5b", "config": HF_LINE}, "{ms_per_token:.2f}", B_1_8_32),
          Cell({"model": "qwen0.5b", "config": HF_PEER}, "{ms_per_token:.2f}", B_1_8_32)),
    Claim("same, `Options(compile=True)`", "hf-generate", "per-token",
          Cell({"model": "qwen0.5b", "config": HF_COMPILE}, "{ms_per_token:.2f}", B_1_8_32),
          Cell({"model": "qwen0.5b", "config": HF_PEER}, "{ms_per_token:.2f}", B_1_8_32)),
    Claim("same, first `generate()` s, B = 1: the one line / `Options(compile=True)`", "hf-generate", "per-token",
          Cell({"model": "qwen0.5b", "batch": 1}, "{first_generate_s:.1f}", ("config", (HF_LINE, HF_COMPILE))),
          Cell({"model": "qwen0.5b", "batch": 1, "config": HF_PEER}, "{first_generate_s:.1f}")),
    Claim("same, chat-like workload total s: the one line / `Options(compile=\"background\")`",
          "hf-generate", "chat",
          Cell({"model": "qwen0.5b", "chat_calls": 20}, "{chat_total_s:.1f}", ("config", (HF_LINE, HF_BACKGROUND))),
          Cell({"model": "qwen0.5b", "config": HF_PEER, "chat_calls": 20}, "{chat_total_s:.1f}")),
    hf_vs_peer("same, `Options(compile=\"background\")`, B = 1 / 8", "qwen0.5b", HF_BACKGROUND, "{ms_per_token:.2f}",
               process=1),
    hf_vs_peer("same, first `generate()` s, B = 1 / 8: `Options(compile=\"background\")`", "qwen0.5b", HF_BACKGROUND,
               "{first_generate_s:.1f}", process=1),
    hf_vs_peer("same, restarted on the first process's caches, first `generate()` s, B = 1 / 8", "qwen0.5b",
               HF_BACKGROUND, "{first_generate_s:.1f}", process=2),
    Claim("same, the `generate()` that takes the compiled graphs in, s, B = 1 / 8 (after the worker is done)",
          "hf-generate", "per-token",
          Cell({"model": "qwen0.5b", "config": HF_BACKGROUND, "process": 1}, "{swap_generate_s:.1f}", B_1_8)),
    Claim("same, that `generate()` ÷ a later one of its length, B = 1 / 8", "hf-generate", "per-token",
          Cell({"model": "qwen0.5b", "config": HF_BACKGROUND, "process": 1}, "{swap_vs_call:.2f}", B_1_8)),
    Claim("same, time to first token ÷ eager's, the two called in turn in one process, B = 1 / 8", "hf-generate",
          "per-token", Cell({"model": "qwen0.5b", "config": HF_BACKGROUND, "process": 1}, "{ttft_vs_eager_in_turn:.3f}",
                            B_1_8)),
    hf_vs_peer("transformers 8B, ms/token, B = 1 / 8: the one line", "llama8b", HF_LINE, "{ms_per_token:.2f}"),
    hf_vs_peer("same, `Options(compile=True)`", "llama8b", HF_COMPILE, "{ms_per_token:.2f}"),
    hf_vs_peer("same, first `generate()` s, B = 1 / 8: `Options(compile=True)`", "llama8b", HF_COMPILE,
               "{first_generate_s:.1f}"),
    Claim("same, B = 1, a token's kernels and GPU time: `Options(compile=True)`", "hf-generate", "per-token",
          Cell({"model": "llama8b", "config": HF_COMPILE, "batch": 1},
               "{kernels_per_token:.0f} kernels, {gpu_ms_per_token:.2f} GPU ms of {ms_per_token:.2f} ms"),
          Cell({"model": "llama8b", "config": HF_PEER, "batch": 1},
               "{kernels_per_token:.0f} kernels, {gpu_ms_per_token:.2f} GPU ms of {ms_per_token:.2f} ms")),
    hf_vs_peer("transformers 8B, `Options(compile=\"background\")`, ms/token, B = 1 / 8", "llama8b", HF_BACKGROUND,
               "{ms_per_token:.2f}", process=1),
    hf_vs_peer("same, steady ms/token", "llama8b", HF_BACKGROUND, "{steady_ms_per_token:.2f}", process=1),
    hf_vs_peer("same, first `generate()` s", "llama8b", HF_BACKGROUND, "{first_generate_s:.1f}", process=1),
    hf_vs_peer("same, restarted on the first process's caches, first `generate()` s", "llama8b", HF_BACKGROUND,
               "{first_generate_s:.1f}", process=2),
    Claim("same, the `generate()` that takes the compiled graphs in ÷ a later one of its length, B = 1 / 8",
          "hf-generate", "per-token",
          Cell({"model": "llama8b", "config": HF_BACKGROUND, "process": 1}, "{swap_vs_call:.2f}", B_1_8)),
    Claim("same, time to first token ÷ eager's, the two called in turn in one process, B = 1 / 8", "hf-generate",
          "per-token", Cell({"model": "llama8b", "config": HF_BACKGROUND, "process": 1}, "{ttft_vs_eager_in_turn:.3f}",
                            B_1_8)),
    Claim("same, a chat-like loop of 40 calls: the call that took compiled graphs in, its slowdown (÷ its own second "
          "pass) ÷ its neighbours'", "hf-generate", "chat",
          Cell({"model": "llama8b", "config": HF_BACKGROUND, "chat_calls": 40}, "{chat_swap_vs_neighbours:.2f}")),
    hf_vs_peer("transformers Gemma 3 1B shape (window 64, crossed), ms/token, B = 1 / 8: the one line", "gemma3-1b",
               HF_LINE, "{ms_per_token:.2f}"),
    hf_vs_peer("same, `Options(compile=True)`", "gemma3-1b", HF_COMPILE, "{ms_per_token:.2f}"),
    hf_vs_peer("same, first `generate()` s, B = 1 / 8: `Options(compile=True)`", "gemma3-1b", HF_COMPILE,
               "{first_generate_s:.1f}"),
    hf_vs_peer("same, `Options(compile=\"background\")`: ms/token", "gemma3-1b", HF_BACKGROUND, "{ms_per_token:.2f}"),
    hf_vs_peer("same, steady ms/token", "gemma3-1b", HF_BACKGROUND, "{steady_ms_per_token:.2f}"),
    hf_vs_peer("same, first `generate()` s", "gemma3-1b", HF_BACKGROUND, "{first_generate_s:.1f}"),
    hf_vs_peer("transformers MoE shape (8 experts, 2 active), ms/token, B = 1 / 8: `Options(compile=\"background\")`",
               "moe", HF_BACKGROUND, "{ms_per_token:.2f}"),
    hf_vs_peer("same, steady ms/token", "moe", HF_BACKGROUND, "{steady_ms_per_token:.2f}"),
    hf_vs_peer("same, first `generate()` s", "moe", HF_BACKGROUND, "{first_generate_s:.1f}"),
    Claim("FULL decode ÷ a hand-written `CUDAGraph` loop, B = 1 / 8 / 64 (0.5B and 8B)", "decode", "rows",
          Cell({}, "{graphify_vs_floor:.3f}", ("batch", (1, 8, 64)))),
    Claim("Dispatcher lookup, µs a call", "decode", "dispatch",
          Cell({"what": "Dispatcher.lookup (precomputed, used per call)"}, "{us_per_call:.3f}")),
    Claim("tensor parallel: TP=2 step ÷ a hand-written TP graph loop (0.5B and 8B, B = 1 / 8 / 64, two H200s)",
          "tensor-parallel", "rows", Cell({"tp": 2}, "{graphify_vs_hand:.3f}")),
    Claim("TP=2 ÷ TP=1 at 8B, B = 1, both of inductor-compiled pieces, symmetric-memory all-reduce; compared "
          "with: both as written, NCCL / symmetric memory", "tensor-parallel", "rows",
          Cell({"model": "llama-3-8b-shape", "batch": 1, "tp": 2, "lever": "pieces", "all_reduce": "symm_mem"},
               "{tp_vs_tp1:.3f} (TP=2 {graphify_ms:.2f} ms, {vs_weight_floor:.2f}× its weight floor)"),
          Cell({"model": "llama-3-8b-shape", "batch": 1, "tp": 2, "lever": "plain"}, "{tp_vs_tp1:.3f}",
               ("all_reduce", ("nccl", "symm_mem")))),
    Claim("TP=2 ÷ TP=1 at 8B, B = 1 / 8, inductor pieces with split-KV attention, symmetric memory", "tensor-parallel",
          "rows", Cell({"model": "llama-3-8b-shape", "tp": 2, "lever": "pieces+splitkv", "all_reduce": "symm_mem"},
                       "{tp_vs_tp1:.3f}", ("batch", (1, 8)))),
    Claim("same at TP=4 (four GPUs); compared with: TP=4 as written", "tensor-parallel", "rows",
          Cell({"model": "llama-3-8b-shape", "tp": 4, "lever": "pieces+splitkv", "all_reduce": "symm_mem"},
               "{tp_vs_tp1:.3f}", ("batch", (1, 8))),
          Cell({"model": "llama-3-8b-shape", "tp": 4, "lever": "plain", "all_reduce": "symm_mem"},
               "{tp_vs_tp1:.3f}", ("batch", (1, 8)))),
    Claim("70B shape at TP=4, B = 1 / 8 / 64: step ms ÷ the per-GPU weight-read floor (inductor pieces, split-KV)",
          "tensor-parallel", "rows",
          Cell({"model": "llama-3-70b-shape", "tp": 4, "lever": "pieces+splitkv"}, "{vs_weight_floor:.2f}",
               ("batch", (1, 8, 64)))),
    Claim("TP=2 ÷ TP=1 at 0.5B, B = 1 / 8 / 64, NCCL", "tensor-parallel", "rows",
          Cell({"model": "qwen2.5-0.5b-shape", "all_reduce": "nccl"}, "{tp_vs_tp1:.3f}", ("batch", (1, 8, 64)))),
    Claim("the main job's trace on TP=2, tokens/s ÷ TP=1's (0.5B shape, NCCL, two H200s)", "tensor-parallel-serving",
          "rows", Cell({"config": "TP=2 graphify FULL_AND_PIECEWISE"}, "{vs_tp1:.3f}")),
    Claim("same at the 8B shape, inductor pieces, symmetric-memory all-reduce", "tensor-parallel-serving", "rows",
          Cell({"config": "TP=2 symm_mem graphify FULL_AND_PIECEWISE + inductor pieces"}, "{vs_tp1:.3f}")),
    Claim("same on four GPUs, TP=4 tokens/s ÷ TP=1's (inductor pieces)", "tensor-parallel-serving", "rows",
          Cell({"config": "TP=4 symm_mem graphify FULL_AND_PIECEWISE + inductor pieces"}, "{vs_tp1:.3f}")),
    Claim("the main job's trace at the 8B shape as written on four GPUs, TP=4 tokens/s ÷ TP=1's; compared with: TP=2",
          "tensor-parallel-serving", "rows", Cell({"config": "TP=4 symm_mem graphify FULL_AND_PIECEWISE"}, "{vs_tp1:.3f}"),
          Cell({"config": "TP=2 symm_mem graphify FULL_AND_PIECEWISE"}, "{vs_tp1:.3f}")),
    Claim("transformers `tp_plan=\"auto\"` on two GPUs (NCCL, 1B shape), the one line's ms/token, B = 1 / 8; "
          "compared with: transformers' own compile under TP", "hf-tensor-parallel", "rows",
          Cell({"shape": "1b", "world": 2, "label": "graphify one line"}, "{ms_per_token:.2f}", B_1_8),
          Cell({"shape": "1b", "world": 2, "label": "transformers compile TP"}, "{ms_per_token:.2f}", B_1_8)),
    Claim("same at the 8B shape", "hf-tensor-parallel", "rows",
          Cell({"shape": "8b", "world": 2, "label": "graphify one line"}, "{ms_per_token:.2f}", B_1_8),
          Cell({"shape": "8b", "world": 2, "label": "transformers compile TP"}, "{ms_per_token:.2f}", B_1_8)),
    Claim("same at the 8B shape on four GPUs", "hf-tensor-parallel", "rows",
          Cell({"shape": "8b", "world": 4, "label": "graphify one line"}, "{ms_per_token:.2f}", B_1_8),
          Cell({"shape": "8b", "world": 4, "label": "transformers compile TP"}, "{ms_per_token:.2f}", B_1_8)),
    Claim("host time of one call, B = 1, static inputs + checked view ÷ a bare replay", "call-cost", "rows",
          Cell({"batch": 1, "what": "static + view (checked)"}, "{vs_replay:.2f}"),
          Cell({"batch": 1, "what": "replay"}, "`CUDAGraph.replay()` {us:.1f} µs")),
    Claim("the per-call check of what graphs read through a 24-layer transformers cache, µs", "call-cost", "rows",
          Cell({"what": "reach check alone: 24-layer transformers StaticCache"}, "{us:.1f}")),
    Claim("the per-call check of everything a call reads, Llama-3-8B structure (291 parameters), µs; compared with: "
          "the check before it watched more than the parameters", "call-cost", "rows",
          Cell({"what": WATCH_NOW}, "{us:.2f}"), Cell({"what": WATCH_BEFORE}, "{us:.2f}")),
    Claim("the same check with the model passed in as an argument, µs; compared with: the model in a closure",
          "call-cost", "rows", Cell({"what": WATCH_PASSED}, "{us:.2f}"), Cell({"what": WATCH_NOW}, "{us:.2f}")),
    Claim("capture ÷ a hand-written capture loop, 51 / 67 sizes (0.5B and 8B)", "startup", "rows",
          Cell({}, "{capture_vs_floor:.2f}", ("sizes", (51, 67)))),
    Claim("shape-specialised compile at 8 / 32 / 128 / 512 tokens: step time saved; compared with: its compile, "
          "cold caches, s", "compile-sizes", "rows",
          Cell({}, "{step_gain:.1%}", ("tokens", (8, 32, 128, 512))),
          Cell({}, "{compile_s_cold:.1f}", ("tokens", (8, 32, 128, 512)))),
    Claim("graph pools for all decode sizes, MiB: one pool largest first / smallest first / a pool per size",
          "memory", "rows",
          Cell({}, "{pool_mib:.0f}", ("config", ("decode: one pool, largest first", "decode: one pool, smallest first",
                                                 "decode: a pool per size")))),
)
