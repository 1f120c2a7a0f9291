"""Joining the zoo's results of one run, made a model at a time on several GPUs and calls.

A run of 33 models takes several device calls, often over sessions, so its result is merged
again and again: the earlier merge is itself a part. Nothing it held may be lost on the next
merge (the parts it named, the models cut short), and a model measured again replaces its
earlier rows rather than standing beside them (a rerun of the lines a call's end cut off).
"""

from __future__ import annotations

import json

__all__ = ["joined", "merge"]


def _key(row: dict) -> tuple:
    return (row["model"], row["batch"], row["length"], row["line"])


def _unique(items) -> list:
    return list(dict.fromkeys(items))


def _order(named: tuple[str, dict]) -> tuple:
    """Earlier merges first (they name their parts), then parts by when their run started
    (a rerun of a model after its first run, whatever its file is named), then by name."""
    name, d = named
    return ("parts" not in d, d.get("environment", {}).get("date") or "", name)


def joined(named: list[tuple[str, dict]]) -> dict:
    """The parts `named` ((file name, loaded result), in any order) as one result: an earlier
    merge's first (it names its parts), then each part as its run started, a later row
    replacing an earlier one of the same model, shape and line. `parts` gathers every part's,
    `failures` every part's but those of a line a later part measured; `cut_short` names the
    parts whose lines a call's end cut off and no complete part of the same name followed (a
    model's reruns on the device have its part's name)."""
    ordered = sorted(named, key=_order)
    rows: dict[tuple, dict] = {}
    parts, failures, cut = [], [], []
    for name, d in ordered:
        measured = {f"{r['line']} on {r['model']}:" for r in d["rows"]}  # how `benchmarks.zoo` names a failure
        failures = [f for f in failures if not f.startswith(tuple(measured))] + d["failures"]
        for r in d["rows"]:
            rows.pop(_key(r), None)  # re-inserted last: the table lists rows as measured
            rows[_key(r)] = r
        if "parts" in d:
            parts += d["parts"]
            cut += d.get("cut_short", [])
            continue
        parts.append(name)
        cut = [c for c in cut if c != name] + ([name] if d.get("partial") else [])
    return {"rows": list(rows.values()), "failures": _unique(failures), "parts": _unique(parts),
            "cut_short": _unique(cut)}


def merge(tag: str) -> dict:
    """One result (`zoo-TAG-<device>`) from the runs tagged `TAG-<model>` on one kind of
    device (and an earlier merge of that tag): their rows (ratios again), failures and parts,
    the environment of the earliest; the parts' files are removed. The tag is a prefix: a
    tag of its own for a rerun is `run3b`, not `run3-b` (which `run3` would take in)."""
    from ._report import RESULTS, table, write
    from .zoo import COLUMNS, ratios, with_failures

    paths = sorted(RESULTS.glob(f"zoo-{tag}-*.json"))
    if not paths:
        raise SystemExit(f"no results zoo-{tag}-*.json under {RESULTS}")
    loaded = [json.loads(p.read_text()) for p in paths]
    devices = {d["environment"]["device"] for d in loaded}
    if len(devices) != 1:
        raise SystemExit(f"the parts come from several devices: {sorted(devices)}")
    named = [(p.name, d) for p, d in zip(paths, loaded)]
    result = joined(named)
    result["rows"] = ratios(result["rows"])
    written = write(f"zoo-{tag}", min(named, key=_order)[1]["environment"], result,
                    with_failures(table(result["rows"], COLUMNS), result["failures"]))
    for p in paths:
        if p not in written:
            p.unlink()
            p.with_suffix(".md").unlink(missing_ok=True)
    return result
