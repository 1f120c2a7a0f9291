"""The all-reduce crossover benchmark's pure parts (`benchmarks.all_reduce_crossover`): the
message sizes, each size's fastest kind and every kind's ratio to it, the thresholds a
measurement suggests for `models._symm_mem.choose`, and the Markdown. No process group here,
so tests can feed it made-up timings."""

from __future__ import annotations

import math

import torch

from graphify.models._symm_mem import DEFAULT_MAX_BYTES, KINDS, choose, thresholds

from ._report import table

__all__ = ["TOKENS", "messages", "summarise", "suggest", "render"]

TOKENS = tuple(2**i for i in range(11))  # 1, 2, 4, ..., 1024 tokens: decode to a 1024-token prefill chunk


def messages(tokens, hiddens, dtype: torch.dtype) -> list[dict]:
    """One message per (hidden, tokens): its shape and bytes, smallest hidden first."""
    size = torch.empty((), dtype=dtype).element_size()
    return [{"hidden": h, "tokens": t, "bytes": t * h * size} for h in hiddens for t in tokens]


def today(nbytes: int, dtype: torch.dtype, world: int) -> str:
    """The kind the library's defaults give a message on `world` GPUs (`thresholds`)."""
    return choose(nbytes, dtype, *thresholds(DEFAULT_MAX_BYTES, world=world), DEFAULT_MAX_BYTES)


def summarise(cells: list[dict], dtype: torch.dtype, world: int) -> list[dict]:
    """One row per message from its cells (one per kind: "us" per reduce, None where the kind
    did not run; "ok" whether it equalled NCCL's sum): every kind's µs, the fastest kind among
    those that ran and gave the right sum, each kind's ratio to it, and today's kind."""
    rows: dict[tuple, dict] = {}
    for c in cells:
        row = rows.setdefault((c["hidden"], c["tokens"]), {"hidden": c["hidden"], "tokens": c["tokens"],
                                                           "bytes": c["bytes"], "kib": c["bytes"] / 1024,
                                                           "max_err": 0.0, "ok": True})
        row[f"{c['kind']}_us"] = c["us"]
        if c["us"] is not None:
            row["max_err"] = max(row["max_err"], c["max_err"])
            row["ok"] = row["ok"] and c["ok"]
    for row in rows.values():
        timed = {k: row[f"{k}_us"] for k in KINDS if row.get(f"{k}_us") is not None and _ok(cells, row, k)}
        row["fastest"] = min(timed, key=timed.get) if timed else None
        for k in KINDS:
            us = row.get(f"{k}_us")
            row[f"{k}_ratio"] = None if us is None or not timed else us / timed[row["fastest"]]
        row["today"] = today(row["bytes"], dtype, world)
    return sorted(rows.values(), key=lambda r: (r["bytes"], r["hidden"]))


def _ok(cells: list[dict], row: dict, kind: str) -> bool:
    """Whether `kind`'s cell of `row`'s message gave NCCL's sum."""
    return all(c["ok"] for c in cells if (c["hidden"], c["tokens"], c["kind"]) == (row["hidden"], row["tokens"], kind))


def _cost(rows: list[dict], dtype: torch.dtype, one: int, two: int, max_bytes: int) -> float:
    """Sum over the messages of the chosen kind's time ÷ the fastest's (inf: a kind that did not run)."""
    total = 0.0
    for r in rows:
        ratio = r.get(f"{choose(r['bytes'], dtype, one, two, max_bytes)}_ratio")
        total += math.inf if ratio is None else ratio
    return total


def suggest(rows: list[dict], dtype: torch.dtype, world: int) -> dict:
    """The thresholds of `choose` (one-shot up to `one_shot_max_bytes`, two-shot up to
    `two_shot_max_bytes`, NCCL above) that lose least over the measured messages: the least
    sum of each message's chosen time ÷ its fastest (every size weighs alike), each threshold
    a measured size (what lies between two sizes goes to the smaller one's kind); ties go to
    the larger one-shot range, then the smaller two-shot range. `max_bytes`: the buffer they
    need. Beside it, the same sum for the library's defaults on `world` GPUs."""
    timed = [r for r in rows if r.get("fastest") is not None]
    if not timed:
        return {"one_shot_max_bytes": None, "two_shot_max_bytes": None, "max_bytes": None, "cost": None,
                "today_cost": None, "messages": 0}
    top = max(r["bytes"] for r in timed)
    edges = sorted({0, *(r["bytes"] for r in timed)})
    cost, minus_one, two = min((_cost(timed, dtype, one, two, top), -one, two)
                               for one in edges for two in edges if two >= one)
    one = -minus_one
    two = two if two > one else 0  # an empty two-shot range is none
    need = max(DEFAULT_MAX_BYTES, one, two)
    today_cost = _cost(timed, dtype, *thresholds(DEFAULT_MAX_BYTES, world=world), DEFAULT_MAX_BYTES)
    return {"one_shot_max_bytes": one, "two_shot_max_bytes": two, "max_bytes": need, "cost": cost,
            "today_cost": today_cost, "messages": len(timed)}


COLUMNS = [("hidden", "hidden", "d"), ("tokens", "tokens", "d"), ("kib", "KiB", ".0f"),
           ("one_shot_us", "one-shot µs", ".1f"), ("two_shot_us", "two-shot µs", ".1f"), ("nccl_us", "NCCL µs", ".1f"),
           ("fastest", "fastest", "s"), ("one_shot_ratio", "one-shot ÷ fastest", ".2f"),
           ("two_shot_ratio", "two-shot ÷ fastest", ".2f"), ("nccl_ratio", "NCCL ÷ fastest", ".2f"),
           ("today", "today's choice", "s"), ("max_err", "max err vs NCCL", ".3g"), ("ok", "sums ok", "")]


def render(result: dict) -> str:
    """The result as Markdown: how it was measured, the table, the unavailable kinds, the suggestion."""
    lines = []
    if not result["gpu"]:
        lines.append("**CPU run: gloo, the correctness pass; these timings are host timings, not GPU timings.**\n")
    lines.append(f"All-reduce of a [tokens, hidden] {result['dtype']} message over {result['world']} ranks: "
                 f"{result['how']}; the time is the slowest rank's median over {result['reps']} replays ÷ "
                 f"{result['reduces']} reduces per graph. Each kind checked against NCCL's sum on fresh random inputs "
                 f"({result['checks']} per message). Multicast off: {result['multicast_env']}.\n")
    rows = [{**r, "ok": "yes" if r["ok"] else "NO"} for r in result["rows"]]
    lines.append(table(rows, COLUMNS))
    for kind, reason in result["unavailable"].items():
        lines.append(f"\n{kind}: not measured ({reason})")
    s = result["suggestion"]
    if s["one_shot_max_bytes"] is not None:
        lines.append(f"\nSuggested: `all_reduce_fn(..., max_bytes={s['max_bytes']}, one_shot_max_bytes="
                     f"{s['one_shot_max_bytes']}, two_shot_max_bytes={s['two_shot_max_bytes']})` — sum of chosen ÷ "
                     f"fastest over {s['messages']} messages {s['cost']:.2f} (today's rule: {s['today_cost']:.2f}; "
                     f"{s['messages']:.0f} is every message at its fastest).")
    return "\n".join(lines)
