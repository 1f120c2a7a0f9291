"""The tensor-parallel benchmark's targets and its Markdown (`benchmarks.tensor_parallel`)."""

from __future__ import annotations

from ._report import table

__all__ = ["TARGET_VS_HAND", "TARGET_8B", "TARGET_70B_VS_FLOOR", "targets", "render_decode", "render_serving"]

TARGET_VS_HAND = 1.05  # graphify TP=2 step ÷ the hand-written TP loop's, at every batch
TARGET_8B = {2: 0.6, 4: 0.4}  # 8B at B=1 and 8: TP step ÷ TP=1 step
TARGET_70B_VS_FLOOR = 2.0  # 70B at TP=4, B=1: step ÷ the per-GPU weight-read floor
BIG, HUGE = "llama-3-8b-shape", "llama-3-70b-shape"


def _best(rows: list[dict], key: str):
    """The row with the smallest `key` (None if no row has it)."""
    rows = [r for r in rows if r.get(key) is not None]
    return min(rows, key=lambda r: r[key], default=None)


def _where(r: dict) -> str:
    return f"{r['lever']} {r['all_reduce_label']}"


def targets(rows: list[dict], tp1_rows: list[dict] | None = None) -> dict:
    """The issue's targets from one run's TP rows: graphify ÷ hand at TP=2 (worst); the 8B
    TP ÷ TP=1 at B=1 and 8 per TP degree (best over kinds and levers, TP=1 under the same
    lever); the 70B TP=4 B=1 step ÷ its weight-read floor (best). None: not measured."""
    timed = [r for r in rows if r.get("graphify_vs_hand") is not None and r["tp"] == 2]
    worst = max(timed, key=lambda r: r["graphify_vs_hand"], default=None)
    out = {"graphify_vs_hand_worst": None if worst is None else worst["graphify_vs_hand"],
           "graphify_vs_hand_worst_at": None if worst is None else (
               f"{worst['model']} B={worst['batch']} {_where(worst)}"),
           "graphify_vs_hand_met": None if worst is None else worst["graphify_vs_hand"] <= TARGET_VS_HAND}
    for tp, goal in TARGET_8B.items():
        per_batch = {}
        for b in (1, 8):
            best = _best([r for r in rows if r["model"] == BIG and r["tp"] == tp and r["batch"] == b], "tp_vs_tp1")
            if best is not None:
                per_batch[b] = {"tp_vs_tp1": best["tp_vs_tp1"], "at": _where(best),
                                "tp_vs_tp1_plain": best.get("tp_vs_tp1_plain")}
        out[f"8b_tp{tp}"] = per_batch
        out[f"8b_tp{tp}_met"] = (None if len(per_batch) < 2 else
                                 all(v["tp_vs_tp1"] <= goal for v in per_batch.values()))
    best = _best([r for r in rows if r["model"] == HUGE and r["tp"] == 4 and r["batch"] == 1], "vs_weight_floor")
    out["70b_tp4_b1_vs_floor"] = None if best is None else best["vs_weight_floor"]
    out["70b_tp4_b1_at"] = None if best is None else _where(best)
    out["70b_tp4_b1_met"] = None if best is None else best["vs_weight_floor"] <= TARGET_70B_VS_FLOOR
    return out


STEP_COLUMNS = [("model", "model", "s"), ("tp", "TP", "d"), ("lever", "lever", "s"),
                ("all_reduce_label", "all-reduce", "s"), ("batch", "B", "d"), ("tp1_ms", "TP=1 ms", ".3f"),
                ("eager_ms", "eager TP ms", ".3f"), ("graphify_ms", "graphify TP ms", ".3f"),
                ("hand_ms", "hand TP ms", ".3f"), ("graphify_vs_hand", "graphify ÷ hand", ".3f"),
                ("tp_vs_tp1", "TP ÷ TP=1", ".3f"), ("tp_vs_tp1_plain", "TP ÷ TP=1 plain", ".3f"),
                ("weight_floor_ms", "weight floor ms", ".3f"), ("vs_weight_floor", "÷ floor", ".2f"),
                ("max_err", "max err", ".3g"), ("reference", "vs", "s")]
PROFILE_COLUMNS = [("model", "model", "s"), ("tp", "TP", "d"), ("lever", "lever", "s"),
                   ("all_reduce_label", "all-reduce", "s"), ("batch", "B", "d"), ("kernels", "kernels/step", ".0f"),
                   ("all_reduces", "all-reduces/step", ".0f"), ("gpu_ms", "GPU ms (sum)", ".3f"),
                   ("idle_us", "GPU idle µs", ".0f"), ("all_reduce_us", "µs / all-reduce (median)", ".1f"),
                   ("all_reduce_ms", "all-reduce ms/step", ".3f"), ("graphify_host_us", "host µs/step", ".1f")]
TP1_COLUMNS = [("model", "model", "s"), ("lever", "lever", "s"), ("batch", "B", "d"),
               ("graphify_ms", "TP=1 graphify ms", ".3f"), ("hand_ms", "hand ms", ".3f"),
               ("weight_floor_ms", "weight floor ms", ".3f"), ("vs_weight_floor", "÷ floor", ".2f"),
               ("kernels", "kernels/step", ".0f"), ("gpu_ms", "GPU ms (sum)", ".3f"), ("idle_us", "GPU idle µs", ".0f"),
               ("max_err", "max err vs eager", ".3g")]


def _verdict(met) -> str:
    return "not measured" if met is None else "met" if met else "NOT met"


def render_decode(result: dict) -> str:
    t = result["targets"]
    lines = []
    if not result["env"]["gpu"]:
        lines.append("**CPU smoke run: tiny model, gloo, simulation backend. These timings are not GPU timings.**\n")
    levers = "; ".join(f"{k}: {v}" for k, v in result.get("levers", {}).items())
    lines.append(
        f"Decode at KV length {result['kv_len']}, random weights ({result['dtype']}), world {result['world']}, "
        f"TP degrees {result.get('tp')}; a TP degree below the world runs in groups of consecutive ranks at once, "
        "rank 0's group reported. TP=1: the single-GPU model, each rank its own. Levers: "
        f"{levers}. Per all-reduce kind (nccl: NCCL's functional all-reduce; symm_mem: the one-shot all-reduce "
        "through symmetric memory, NVLink P2P, no multicast; a→b: a fell back to b): eager; graphify FULL with "
        "`group=` (the all-reduces inside the graphs, each graph checking that every rank replays the same one); "
        "hand: one `torch.cuda.CUDAGraph` per batch size of the same function, inputs copied into static buffers, "
        "no checks (the floor). TP ÷ TP=1 compares the same lever. Weight floor: one rank's weight bytes ÷ the "
        "GPU's peak HBM bandwidth. Step times: CUDA events over back-to-back calls, medians, rank 0. Profile: "
        "torch.profiler over 5 replays (rank 0); an all-reduce's time includes its wait for the peers.\n")
    timed = [r for r in result["rows"] if r.get("batch") is not None]
    lines.append(table(timed, STEP_COLUMNS))
    if any(r.get("kernels") is not None for r in timed):
        lines.append("\nPer step, graphify's graphs:\n")
        lines.append(table(timed, PROFILE_COLUMNS))
    if result.get("tp1_rows"):
        lines.append("\nTP=1 (one GPU, the whole model):\n")
        lines.append(table(result["tp1_rows"], TP1_COLUMNS))
    for r in result["rows"]:
        if r.get("skipped"):
            lines.append(f"\n{r['model']} at TP={r['tp']}: skipped ({r['skipped']}).")
    for reason in dict.fromkeys(r["fallback_reason"] for r in result["rows"] if r.get("fallback_reason")):
        lines.append(f"\nsymm_mem fell back to nccl: {reason}.")
    worst = t["graphify_vs_hand_worst"]
    parts = [f"graphify TP=2 ÷ hand TP=2 <= {TARGET_VS_HAND} at every batch: {_verdict(t['graphify_vs_hand_met'])}"
             + ("" if worst is None else f" (worst {worst:.3f}, {t['graphify_vs_hand_worst_at']})")]
    for tp, goal in TARGET_8B.items():
        got = t.get(f"8b_tp{tp}", {})
        parts.append(f"8B TP={tp} ÷ TP=1 <= {goal} at B=1 and 8: {_verdict(t.get(f'8b_tp{tp}_met'))}"
                     + "".join(f"; B={b} {v['tp_vs_tp1']:.3f} ({v['at']})" for b, v in got.items()))
    v = t.get("70b_tp4_b1_vs_floor")
    parts.append(f"70B TP=4 B=1 step ÷ weight floor <= {TARGET_70B_VS_FLOOR}: {_verdict(t.get('70b_tp4_b1_met'))}"
                 + ("" if v is None else f" ({v:.2f}, {t['70b_tp4_b1_at']})"))
    lines.append("\nTargets: " + ". ".join(parts) + ".")
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
                 f"step; step kinds {t['step_kinds']}. graphify FULL_AND_PIECEWISE over `split` "
                 f"({'inductor-compiled pieces' if result.get('inductor_pieces') else 'pieces as written'}) at TP=1 "
                 f"and TP={result.get('tp', [world])} "
                 "(all-reduces inside FULL graphs and inside PIECEWISE pieces). Step latency: CUDA events, rank 0; "
                 "max err: largest |logit - single-GPU eager| over every step.\n")
    lines.append(table(result["rows"], SERVING_COLUMNS))
    for why in result.get("skipped", []):
        lines.append(f"\nSkipped {why}.")
    for kind, ratio in r.items():
        lines.append(f"\n{kind} ÷ TP=1: tokens/s {ratio['tokens_per_s']:.2f}x, p99 {ratio['p99']:.2f}x.")
    if any("ms_by_kind" in row for row in result["rows"]):
        lines.append("\nms a trace spends per step kind (where TP wins or loses):\n")
        kinds = [k for k, steps in t["step_kinds"].items() if steps]  # the trace's kinds, in their order
        by_kind = [{"config": row["config"], **{k: row.get("ms_by_kind", {}).get(k, 0.0) for k in kinds}}
                   for row in result["rows"]]
        lines.append(table(by_kind, [("config", "configuration", "s"), *((k, k, ".1f") for k in kinds)]))
    return "\n".join(lines)
