"""The tensor-parallel benchmark's targets and its Markdown (`benchmarks.tensor_parallel`)."""

from __future__ import annotations

from ._report import table

__all__ = ["TARGET_VS_HAND", "TARGET_8B_B1", "targets", "render_decode", "render_serving"]

TARGET_VS_HAND = 1.05  # graphify TP step ÷ the hand-written TP loop's, at every batch
TARGET_8B_B1 = 0.6  # 8B at B=1: TP step ÷ TP=1 step


def targets(rows: list[dict], big: str) -> dict:
    """The issue's targets, from one run's rows; the 8B B=1 ratio per all-reduce kind, and
    `8b_b1_tp_vs_tp1` the best of them. `big`: the 8B model's label."""
    timed = [r for r in rows if r.get("graphify_vs_hand") is not None]
    worst = max(timed, key=lambda r: r["graphify_vs_hand"], default=None)
    b1 = {r["all_reduce_label"]: r["tp_vs_tp1"] for r in rows
          if r["model"] == big and r.get("batch") == 1}
    best = min(b1, key=b1.get, default=None)
    return {
        "graphify_vs_hand_worst": None if worst is None else worst["graphify_vs_hand"],
        "graphify_vs_hand_worst_at": None if worst is None else (
            f"{worst['model']} B={worst['batch']} {worst['all_reduce_label']}"),
        "graphify_vs_hand_met": None if worst is None else worst["graphify_vs_hand"] <= TARGET_VS_HAND,
        "8b_b1_tp_vs_tp1_by_all_reduce": b1,
        "8b_b1_best_all_reduce": best,
        "8b_b1_tp_vs_tp1": None if best is None else b1[best],
        "8b_b1_met": None if best is None else b1[best] <= TARGET_8B_B1,
    }


DECODE_COLUMNS = [("model", "model", "s"), ("batch", "B", "d"), ("all_reduce_label", "all-reduce", "s"),
                  ("tp1_ms", "TP=1 ms", ".3f"), ("eager_ms", "eager TP ms", ".3f"),
                  ("graphify_ms", "graphify TP ms", ".3f"), ("hand_ms", "hand TP ms", ".3f"),
                  ("graphify_vs_hand", "graphify ÷ hand", ".3f"), ("tp_vs_tp1", "TP ÷ TP=1", ".3f"),
                  ("hand_vs_tp1", "hand TP ÷ TP=1", ".3f"), ("speedup_vs_eager", "speedup vs eager", ".1f"),
                  ("graphify_host_us", "host µs/step", ".1f"), ("max_err_vs_single_gpu", "max err vs 1 GPU", ".3g"),
                  ("hand_max_err", "hand max err", ".3g")]


def _verdict(met) -> str:
    return "not measured" if met is None else "met" if met else "NOT met"


def render_decode(result: dict) -> str:
    world, t = result["world"], result["targets"]
    lines = []
    if not result["env"]["gpu"]:
        lines.append("**CPU smoke run: tiny model, gloo, simulation backend. These timings are not GPU timings.**\n")
    lines.append(
        f"TP={world} decode at KV length {result['kv_len']}, random weights ({result['dtype']}). TP=1: the single-GPU "
        f"model in graphify FULL graphs. TP={world}, per all-reduce kind (nccl: NCCL's functional all-reduce; "
        "symm_mem: the one-shot all-reduce through symmetric memory, NVLink P2P, no multicast; a→b: a fell back to b): "
        "eager; graphify FULL with `group=` (the all-reduces inside the graphs, each graph checking that every rank "
        "replays the same one); hand: one `torch.cuda.CUDAGraph` per batch size of the same step, inputs copied into "
        "static buffers, no checks (the floor). Step times: CUDA events over back-to-back calls, medians, rank 0. "
        "Host µs: graphify TP calls issued back to back.\n")
    lines.append(table([r for r in result["rows"] if r.get("batch") is not None], DECODE_COLUMNS))
    for r in result["rows"]:
        if r.get("skipped"):
            lines.append(f"\n{r['model']}: skipped ({r['skipped']}).")
    for reason in dict.fromkeys(r["fallback_reason"] for r in result["rows"] if r.get("fallback_reason")):
        lines.append(f"\nsymm_mem fell back to nccl: {reason}.")
    worst = t["graphify_vs_hand_worst"]
    lines.append(f"\nTargets: graphify TP ÷ hand TP <= {TARGET_VS_HAND} at every batch: "
                 + _verdict(t["graphify_vs_hand_met"])
                 + ("" if worst is None else f" (worst {worst:.3f}, {t['graphify_vs_hand_worst_at']})")
                 + f". 8B at B=1, TP ÷ TP=1 <= {TARGET_8B_B1}: {_verdict(t['8b_b1_met'])}"
                 + "".join(f"; {kind} {v:.3f}" for kind, v in t["8b_b1_tp_vs_tp1_by_all_reduce"].items()) + ".")
    return "\n".join(lines)


SERVING_COLUMNS = [("config", "configuration", "s"), ("tokens_per_s", "tokens/s", ".0f"), ("p50_ms", "p50 ms", ".3f"),
                   ("p99_ms", "p99 ms", ".3f"), ("startup_s", "start-up s", ".2f"), ("steps_full_pct", "FULL %", ".0f"),
                   ("steps_piecewise_pct", "PIECEWISE %", ".0f"), ("steps_none_pct", "NONE %", ".0f"),
                   ("max_err_vs_single_gpu", "max err vs 1 GPU", ".3g")]


def render_serving(result: dict) -> str:
    t, r, world = result["trace"], result["ratios"], result["world"]
    lines = []
    if not result["env"]["gpu"]:
        lines.append("**CPU smoke run: tiny model, gloo, simulation backend. These timings are not GPU timings.**\n")
    config = result["config"]
    lines.append(f"The main job's trace ({config['model']}, {config['dtype']}): {t['requests']} requests (seed "
                 f"{t['seed']}), {t['steps']} steps, {t['tokens']} tokens, at most {t['max_batch_tokens']} tokens a "
                 f"step; step kinds {t['step_kinds']}. graphify FULL_AND_PIECEWISE over `split` at TP=1 and TP={world} "
                 "(all-reduces inside FULL graphs and inside PIECEWISE pieces). Step latency: CUDA events, rank 0; "
                 "max err: largest |logit - single-GPU eager| over every step.\n")
    lines.append(table(result["rows"], SERVING_COLUMNS))
    for kind, ratio in r.items():
        lines.append(f"\nTP={world} {kind} ÷ TP=1: tokens/s {ratio['tokens_per_s']:.2f}x, p99 {ratio['p99']:.2f}x.")
    return "\n".join(lines)
