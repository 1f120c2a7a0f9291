"""Which kernels one zoo line runs that another does not, from a `--profile` run's rows.

Two lines can tie in kernels a call and still differ by 10% of a call's GPU time: another
reduction schedule, a convolution cuDNN chose otherwise, a copy. `--profile` keeps each row's
every kernel (name, count a call, µs a call); this lines two rows' up by kernel, inductor's
numbered names folded into one (`triton_poi_fused_add_mul_12` and `_13` are one kind:
the numbers are the order inductor emitted them in), and lists the kinds whose time differs
most, each with its class (`benchmarks._kernel_classes`).

    python3 -m benchmarks.zoo_kernels zoo-prof-b3 timm/efficientnet_b3 1 reduce_overhead graphify_compile
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

from ._kernel_classes import kernel_class

__all__ = ["kind", "by_kind", "difference", "report"]

_NUMBERED = re.compile(r"^(triton_\w+?)_\d+$")


def kind(name: str) -> str:
    """A kernel's name without inductor's running number (other names unchanged)."""
    m = _NUMBERED.match(name)
    return m.group(1) if m else name


def by_kind(kernels: list) -> dict[str, tuple[float, float]]:
    """{kind: (count a call, µs a call)} from a row's (name, count, µs) kernels."""
    out: dict = defaultdict(lambda: [0.0, 0.0])
    for name, count, us in kernels:
        out[kind(name)][0] += count
        out[kind(name)][1] += us
    return {k: (c, us) for k, (c, us) in out.items()}


def difference(a: list, b: list) -> list[tuple[str, float, float, float, float]]:
    """(kind, count in a, count in b, µs in a, µs in b) for every kind either runs, the
    largest difference in time first."""
    ka, kb = by_kind(a), by_kind(b)
    rows = [(k, ka.get(k, (0, 0))[0], kb.get(k, (0, 0))[0], ka.get(k, (0, 0))[1], kb.get(k, (0, 0))[1])
            for k in ka.keys() | kb.keys()]
    return sorted(rows, key=lambda r: (-abs(r[4] - r[3]), r[0]))


def _row(rows: list[dict], model: str, batch: int, line: str, length=None) -> dict:
    found = [r for r in rows if r["model"] == model and r["batch"] == batch and r["line"] == line
             and (length is None or r.get("length") == length)]
    if not found:
        raise SystemExit(f"no row for {model} B = {batch}{'' if length is None else f' length {length}'} {line}")
    lengths = sorted({r.get("length") for r in found}, key=str)
    if len(lengths) > 1:
        raise SystemExit(f"{model} B = {batch} {line} was measured at lengths {lengths}: name one (--length)")
    if not found[-1].get("every_kernel"):
        raise SystemExit(f"{model} B = {batch} {line} was not profiled (benchmarks.zoo --profile)")
    return found[-1]


def report(rows: list[dict], model: str, batch: int, line_a: str, line_b: str, top: int = 25, length=None) -> str:
    """A table of the `top` kinds whose µs a call differ most between two lines' rows (at
    `length`, for a model measured at several), and the totals per class."""
    a, b = (_row(rows, model, batch, line, length)["every_kernel"] for line in (line_a, line_b))
    diff = difference(a, b)
    at = "" if length is None else f" length {length}"
    out = [f"{model} B = {batch}{at}: {line_a} (a) against {line_b} (b), a call", "",
           "| kernel | class | count a | count b | µs a | µs b | b - a µs |", "|---|---|---|---|---|---|---|"]
    out += [f"| `{k[:90]}` | {kernel_class(k)} | {ca:.0f} | {cb:.0f} | {ua:.1f} | {ub:.1f} | {ub - ua:+.1f} |"
            for k, ca, cb, ua, ub in diff[:top]]
    classes: dict = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for k, ca, cb, ua, ub in diff:
        c = classes[kernel_class(k)]
        c[0] += ca; c[1] += cb; c[2] += ua; c[3] += ub  # noqa: E702
    out += ["", "| class | count a | count b | µs a | µs b |", "|---|---|---|---|---|"]
    out += [f"| {cls} | {ca:.0f} | {cb:.0f} | {ua:.1f} | {ub:.1f} |" for cls, (ca, cb, ua, ub) in sorted(classes.items())]
    picks = [picks_of(rows, model, batch, line, length) for line in (line_a, line_b)]
    shown = [k for k, *_ in diff[:top] if k in picks[0] or k in picks[1]]
    if shown:
        out += ["", "Autotuner's picks (`benchmarks._kernel_configs`; one per kernel compiled of that name):", "",
                "| kernel | picks a | picks b |", "|---|---|---|"]
        out += [f"| `{k[:90]}` | {described(picks[0].get(k))} | {described(picks[1].get(k))} |" for k in shown]
    return "\n".join(out)


def picks_of(rows: list[dict], model: str, batch: int, line: str, length=None) -> dict[str, list[dict]]:
    """The picks a line's rows of `model` recorded (`configs`): each row records the kernels
    its own shape's compile built, so a kernel an earlier shape built is looked up there; the
    row of `batch` (and `length`) first. By kind (`kind`: inductor's running number folded), as
    the table is."""
    mine = [r for r in rows if r["model"] == model and r["line"] == line]
    picks: dict[str, list[dict]] = {}
    for r in sorted(mine, key=lambda r: (r["batch"] != batch, length is not None and r.get("length") != length)):
        folded: dict[str, list[dict]] = {}
        for name, configs in (r.get("configs") or {}).items():
            folded.setdefault(kind(name), []).extend(configs)
        for name, configs in folded.items():
            picks.setdefault(name, configs)
    return picks


def described(configs: "list[dict] | None") -> str:
    """`XBLOCK=1024 w4 s1`-like text for each pick, or '-'."""
    if not configs:
        return "-"
    def one(c: dict) -> str:
        blocks = [f"{k}={v}" for k, v in c.items() if k.endswith("BLOCK")]
        tail = [f"w{c['num_warps']}" if "num_warps" in c else "", f"s{c['num_stages']}" if "num_stages" in c else "",
                "coordesc" if c.get("found_by_coordesc") else ""]
        return " ".join(blocks + [t for t in tail if t])
    return ", ".join(sorted({one(c) for c in configs}))


def _rows_of(result: str) -> list[dict]:
    """The rows of a result file, or of the one result named (`zoo-prof-b3`: its merged file,
    or its one part)."""
    from ._report import RESULTS

    path = RESULTS / result
    if path.is_file():
        return json.loads(path.read_text())["rows"]
    loaded = {p.name: json.loads(p.read_text()) for p in sorted(RESULTS.glob(f"{result}-*.json"))}
    merged = [d for d in loaded.values() if "parts" in d]
    if len(merged) == 1 or len(loaded) == 1:
        return (merged or list(loaded.values()))[0]["rows"]
    if not loaded:
        raise SystemExit(f"no result {result!r} under {RESULTS}")
    raise SystemExit(f"{result!r} names {len(loaded)} files ({', '.join(loaded)}): merge them first "
                     f"(python3 -m benchmarks.zoo --merge {result.removeprefix('zoo-')}) or name one")


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", help="a result file, or its name under benchmarks/results/ without the device")
    parser.add_argument("model")
    parser.add_argument("batch", type=int)
    parser.add_argument("line_a")
    parser.add_argument("line_b")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--length", type=int, default=None, help="the sequence length, for an encoder")
    args = parser.parse_args(argv)
    text = report(_rows_of(args.result), args.model, args.batch, args.line_a, args.line_b, args.top, args.length)
    print(text)
    return text


if __name__ == "__main__":
    main()
