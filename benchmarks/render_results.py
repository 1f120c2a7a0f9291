"""Render the results tables from the result files.

`python3 -m benchmarks.render_results` rewrites benchmarks/results/README.md whole, and the
blocks of README.md between `<!-- generated:NAME -->` and `<!-- /generated -->`, from
benchmarks/results/*.json (one run of a benchmark each) and gpu-tests-*.txt (pytest
summaries). What each benchmark's files hold, and the rows of README's short table, are
data in `benchmarks._render_tables`. A rendered row is one configuration: each value is the
range over the runs that measured it, beside how many runs those were, their dates, device,
versions and files. Only GPU runs are results; the CPU simulation's files are ignored here,
as they are by git. Standard library only.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import re
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import _render_plots
from ._render_zoo import render_zoo
from ._render_tables import BENCHES, CLAIMS, Bench, Cell, Claim, Table

RESULTS = Path(__file__).resolve().parent / "results"
README = RESULTS.parent.parent / "README.md"
BLOCK = re.compile(r"(<!-- generated:([\w-]+) -->\n)(.*?)(<!-- /generated -->)", re.S)


# -- runs: the files, read ---------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Run:
    """One result file: `era` counts the benchmark's code changes at or before its date."""

    file: str
    bench: Bench
    env: dict
    data: dict
    era: int
    aliases: tuple[str, ...] = ()

    @property
    def date(self) -> str:
        return self.env["date"][:10]

    @property
    def stem(self) -> str:
        """The file name less `-<device>.json`, as benchmarks._report names files."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.env["device"].lower()).strip("-")
        return self.file.removesuffix(".json").removesuffix(f"-{slug}")


def bench_of(file: str) -> Bench | None:
    """The benchmark whose kind is the longest prefix of `file`'s name."""
    fits = [b for b in BENCHES if file.startswith(b.kind + "-")]
    return max(fits, key=lambda b: len(b.kind)) if fits else None


def era_of(bench: Bench, date: str) -> int:
    when = _dt.datetime.fromisoformat(date)
    return sum(_dt.datetime.fromisoformat(since) <= when for since, _ in bench.eras)


def era_label(bench: Bench, era: int) -> str:
    return f"after: {bench.eras[era - 1][1]}" if era else f"before: {bench.eras[0][1]}"


def load_runs(folder: Path = RESULTS) -> list[Run]:
    """Every GPU run in `folder`, oldest first; a file with the same content as another is
    one run (the later name kept, the other listed as its alias)."""
    by_text: dict[str, Run] = {}
    for path in sorted(folder.glob("*.json")):
        bench, text = bench_of(path.name), path.read_text()
        data = json.loads(text)
        env = data.pop("environment")
        if bench is None or not env.get("gpu"):
            continue
        old = by_text.get(text)
        aliases = (old.file, *old.aliases) if old else ()
        by_text[text] = Run(path.name, bench, env, data, era_of(bench, env["date"]), aliases)
    return sorted(by_text.values(), key=lambda r: (r.env["date"], r.file))


# -- aggregation: one row per configuration -----------------------------------------------------
@dataclass
class Group:
    """The rows of one configuration, with the runs they came from."""

    key: tuple
    era: int
    device: str
    rows: list[dict] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)

    def add(self, run: Run, row: dict) -> None:
        self.rows.append(row)
        if run not in self.runs:
            self.runs.append(run)


def natural(value: object) -> tuple:
    """A sort key that orders numbers by value and numbers inside strings too ("prefill 512"
    before "prefill 2048"), with missing values last."""
    if value is None:
        return (2,)
    if isinstance(value, (int, float)):
        return (0, value)
    return (1, [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", str(value))])


def groups(runs: Iterable[Run], bench: Bench, table: Table) -> list[Group]:
    """Rows of `table` across the runs of `bench`, one group per (code era, device,
    configuration): the newest era first, then in the order of the configuration's fields."""
    out: dict[tuple, Group] = {}
    for run in (r for r in runs if r.bench is bench):
        for row in table.rows(run.data):
            key = tuple(row.get(c.field) for c in table.key)
            group = out.setdefault((run.era, run.env["device"], key), Group(key, run.era, run.env["device"]))
            group.add(run, row)
    return sorted(out.values(), key=lambda g: (-g.era, g.device, [natural(v) for v in g.key]))


def span(values: Iterable[object], fmt: str) -> str:
    """The range of `values` as text: "lo–hi", one value where they format the same, "-" where
    there is none; strings are listed as they are."""
    present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not present:
        return "-"
    if any(isinstance(v, str) for v in present):
        return ", ".join(dict.fromkeys(map(str, present)))
    lo, hi = format(min(present), fmt), format(max(present), fmt)
    return lo if lo == hi else f"{lo}–{hi}"


def show(value: object) -> str:
    if value is None:
        return "-"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def dates(runs: Sequence[Run]) -> str:
    """The first and last date of `runs`."""
    first, last = min(r.date for r in runs), max(r.date for r in runs)
    return first if first == last else f"{first} to {last}"


def versions(runs: Sequence[Run]) -> str:
    """torch, CUDA and transformers of `runs`, each version once."""
    stamps = [", ".join(f"{k} {r.env[k]}" for k in ("torch", "cuda", "transformers") if r.env.get(k)) for r in runs]
    return "; ".join(dict.fromkeys(s.replace("cuda", "CUDA") for s in stamps))


def files(runs: Sequence[Run]) -> str:
    return ", ".join(f"`{r.stem}`" for r in sorted(runs, key=lambda r: r.file))


def device(name: str) -> str:
    return name.removeprefix("NVIDIA ")


def markdown(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def table_rows(bench: Bench, table: Table, runs: Sequence[Run]) -> list[list[str]]:
    """One markdown row per configuration: key, code era, ranges, then where they came from."""
    out = []
    for g in groups(runs, bench, table):
        era = [era_label(bench, g.era)] if bench.eras else []
        values = [span((row.get(c.field) for row in g.rows), c.fmt) for c in table.cols]
        out.append([*map(show, g.key), *era, *values, str(len(g.runs)), dates(g.runs), device(g.device),
                    versions(g.runs), files(g.runs)])
    return out


def render_table(bench: Bench, table: Table, runs: Sequence[Run]) -> str:
    header = [c.header for c in table.key] + (["code"] if bench.eras else []) + [c.header for c in table.cols]
    return markdown([*header, "runs", "dates", "device", "versions", "files"], table_rows(bench, table, runs))


# -- the GPU test suite's runs, from gpu-tests-*.txt ------------------------------------------------
SUMMARY = re.compile(
    r"(?:\b\d+ (?:passed|failed|skipped|xfailed|xpassed|errors?|deselected|warnings?),? ?)+(?=(?:\([^)]*\) )?in \d)"
)
COUNTED = ("passed", "failed", "errors", "error", "skipped", "xfailed", "xpassed")
# Outcomes of a step that ran one test file outside pytest's summary line, as a file states them.
STEP_OUTCOMES = (r"(tests/\w+\.py) (\d+ of \d+ passed)", r"(tests/\w+\.py|the suite)[^.;]*? (did not finish)")
VERSIONS = (("torch", r"torch ([\w.+]+)"), ("CUDA", r"CUDA ([\d.]+)"), ("transformers", r"transformers ([\d.]+)"))


@dataclass(frozen=True)
class Suite:
    """One run of the test suite as a gpu-tests file records it (newest first in the file)."""

    file: str
    date: str
    device: str
    commit: str
    versions: str
    results: tuple[tuple[str, str], ...]  # (what ran, its counts)


def counts(summary: str) -> str:
    """pytest's summary reduced to its outcomes, failures always shown."""
    found = dict((word, int(n)) for n, word in re.findall(r"(\d+) (\w+)", summary))
    found.setdefault("failed", 0)
    return ", ".join(f"{found[w]} {w}" for w in COUNTED if w in found)


def results_of(block: str) -> tuple[tuple[str, str], ...]:
    """Every pytest summary in `block` (lines ending in a comma joined to the next), named by
    the last clause before it on its line, else by the line before it up to its first colon;
    the block's first unnamed summary is the suite's. Then the STEP_OUTCOMES the block states."""
    out, before = [], ""
    for line in re.sub(r",\n\s*", ", ", block).splitlines():
        if m := SUMMARY.search(line):
            same_line = re.split(r"[.;] ", line[: m.start()])[-1].strip().rstrip(":")
            what = same_line or (before.split(": ")[0].rstrip(":") if out else "the suite")
            out.append((what, counts(m.group(0))))
        before = line.strip() or before
    text = " ".join(block.split())
    out += [(m.group(1), m.group(2)) for pattern in STEP_OUTCOMES for m in re.finditer(pattern, text)]
    return tuple(out)


def parse_suite(file: str, block: str) -> Suite:
    """A gpu-tests block: its date, device, commit, versions and pytest summaries."""

    def find(pattern: str) -> str:
        m = re.search(pattern, block, re.M)
        return m.group(1) if m else ""

    stamp = ", ".join(f"{name} {v}" for name, pattern in VERSIONS if (v := find(pattern)))
    kind = find(r"^[Dd]evice: .*\(device kind ([\w-]+)\)")
    device_ = find(r"^[Dd]evice: (.+?)(?:,| \(|$)") + (f" ({kind})" if kind else "")
    return Suite(file, find(r"^date: (\d{4}-\d\d-\d\d \d\d:\d\d) UTC"), device_,
                 find(r"(?:commit|tree of) ([0-9a-f]{7,40})\b"), stamp, results_of(block))


def load_suites(folder: Path = RESULTS) -> list[Suite]:
    """Every suite run in gpu-tests-*.txt, newest first within each file."""
    out = []
    for path in sorted(folder.glob("gpu-tests-*.txt")):
        for block in re.split(r"^--- previous session.*---$", path.read_text(), flags=re.M):
            out.append(parse_suite(path.name, block))
    return out


def suite_row(s: Suite) -> list[str]:
    results = "; ".join(f"{what}: {n}" for what, n in s.results) or "-"
    return [s.date, device(s.device), f"`{s.commit}`" if s.commit else "-", s.versions, results, f"`{s.file}`"]


SUITE_HEADER = ("date (UTC)", "device", "commit", "versions", "results", "file")


# -- the results README ----------------------------------------------------------------------------
INTRO = """# Results

Rendered by `python3 -m benchmarks.render_results` from the result files in this folder (each
benchmark writes `<benchmark>[-<tag>]-<device>.json` and a Markdown table beside it); edit the
renderer, never this page. A row is one configuration of one benchmark on one device: each value
is the range (lowest–highest) over the runs that measured it, `runs` counts them, `dates` spans
them, and `files` names them (`<file>-<device>.json` here). Where a change to the code changed
what a configuration measures, the `code` column says on which side of it the runs were, and runs
on either side are never put in one range. Lent hosts differ from run to run, on the host side
most: ratios taken within one run (the `÷` columns) compare better than times across runs.
"""

SUITES_ABOUT = """## GPU test suite

Each run of `python3 -m pytest -q` on a lent GPU, as recorded in `gpu-tests-*.txt` (newest
first): the tree it ran on and pytest's counts for each part that ran.
"""


def later_changes(bench: Bench, runs: Sequence[Run]) -> str:
    """A line naming the code changes no run of `bench` has measured yet."""
    newest = max((r.era for r in runs if r.bench is bench), default=0)
    pending = [f"{what} ({since[:10]})" for since, what in bench.eras[newest:]]
    return f"Changed since the newest run, so not yet measured: {'; '.join(pending)}.\n\n" if pending else ""


def render_bench(bench: Bench, runs: Sequence[Run]) -> str:
    parts = [f"## {bench.title} (`{bench.command}`)\n\n{bench.about}\n\n{later_changes(bench, runs)}"]
    for table in bench.tables:
        parts.append(f"### {table.title}\n\n{render_table(bench, table, runs)}\n\n")
    return "".join(parts)


def undescribed(folder: Path = RESULTS) -> list[str]:
    """GPU result files of no benchmark in BENCHES: listed, so that none goes unseen."""
    return [p.name for p in sorted(folder.glob("*.json"))
            if bench_of(p.name) is None and json.loads(p.read_text())["environment"].get("gpu")]


def render_index(runs: Sequence[Run]) -> str:
    """Every file read, and those beside them that are not."""
    read = [[f"`{r.file}`", r.bench.kind, r.env["date"][:16].replace("T", " "), device(r.env["device"]),
             ", ".join(f"`{a}`" for a in r.aliases) or "-"] for r in runs]
    notes = sorted(p.name for p in RESULTS.glob("*.txt") if not p.name.startswith("gpu-tests-")) + undescribed()
    return ("## Files\n\nThe runs read, oldest first (a file with the same content as another is one run):\n\n"
            + markdown(["file", "benchmark", "date (UTC)", "device", "same run as"], read)
            + "\n\nNot rendered: free-form notes, and result files no benchmark here describes: "
            + (", ".join(f"`{n}`" for n in notes) or "none") + ".\n")


def render_results_readme(runs: Sequence[Run], suites: Sequence[Suite]) -> str:
    plots = _render_plots.readme_block(_render_plots.series(runs)).replace("](benchmarks/results/", "](")
    body = [INTRO, "\n## Plots\n\n", plots, "\n"]
    body += [render_bench(b, runs) for b in BENCHES if any(r.bench is b for r in runs)]
    body.append(SUITES_ABOUT + "\n" + markdown(SUITE_HEADER, map(suite_row, suites)) + "\n\n")
    body.append(render_index(runs))
    return "".join(body)



# -- README.md: the short table and the GPU tests' last runs --------------------------------------
def picked(runs: Sequence[Run], kind: str, table: str, where: dict, device: str | None = None) -> list[tuple[Run, dict]]:
    """(run, row) of the newest code era among the rows `where` selects (on `device` only,
    where given)."""
    bench = next(b for b in BENCHES if b.kind == kind)
    tab = next(t for t in bench.tables if t.name == table)
    rows = [(run, row) for run in runs if run.bench is bench for row in tab.rows(run.data)
            if all(row.get(k) == v for k, v in where.items())]
    if device is not None:
        rows = [(run, row) for run, row in rows if run.env["device"] == device]
    newest = max((run.era for run, _ in rows), default=0)
    return [(run, row) for run, row in rows if run.era == newest]


def fill(text: str, rows: Sequence[dict]) -> str:
    """`text` with each `{field:fmt}` replaced by the range of that field over `rows`."""
    out = []
    for literal, name, fmt, _ in string.Formatter().parse(text):
        out.append(literal)
        if name is not None:
            out.append(span((row.get(name) for row in rows), fmt or ""))
    return "".join(out)


def render_cell(runs: Sequence[Run], kind: str, table: str, cell: Cell | None,
                device: str | None = None) -> tuple[str, list[Run]]:
    """The cell's text and the runs behind it, all on one kind of card: `device`, or that of
    the newest run the cell selects on a card with a row for each of its values (a range over
    two cards would compare the cards; a newer card's run of B = 1 alone leaves B = 8 out)."""
    if cell is None:
        return "-", []
    wheres = [{**cell.where, cell.per[0]: v} for v in cell.per[1]] if cell.per else [cell.where]
    shown = [name for _, name, _, _ in string.Formatter().parse(cell.text) if name is not None]

    def measured(where, device=None):  # a row counts where it holds every field the cell shows
        return [(run, row) for run, row in picked(runs, kind, table, where, device)
                if all(row.get(name) is not None for name in shown)]

    if device is None:
        found = [[run for run, _ in measured(where)] for where in wheres]
        complete = set.intersection(*({run.env["device"] for run in runs} for runs in found))
        every = [run for runs in found for run in runs]
        candidates = [run for run in every if run.env["device"] in complete] or every
        device = max(candidates, key=lambda r: r.env["date"]).env["device"] if candidates else None
    texts, used = [], []
    for where in wheres:
        rows = measured(where, device)
        texts.append(fill(cell.text, [row for _, row in rows]) if rows else "-")
        used += [run for run, _ in rows if run not in used]
    return " / ".join(texts), used


def claim_cells(runs: Sequence[Run], claim: Claim) -> tuple[tuple[str, list[Run]], tuple[str, list[Run]]]:
    """(text, runs) of the claim's two cells, the peer's on the card ours came from."""
    ours, ours_runs = render_cell(runs, claim.kind, claim.table, claim.ours)
    device = ours_runs[0].env["device"] if ours_runs else None
    return (ours, ours_runs), render_cell(runs, claim.kind, claim.table, claim.peer, device)


def claim_row(runs: Sequence[Run], claim: Claim) -> list[str]:
    (ours, ours_runs), (peer, peer_runs) = claim_cells(runs, claim)
    used = list(dict.fromkeys(ours_runs + peer_runs))
    return [claim.what, ours, peer, str(len(used)) + library_versions(used), dates(used), files(used)]


def library_versions(runs: Sequence[Run]) -> str:
    """The transformers versions the runs used (the device's and the newest can differ, and
    the line's cost follows transformers' own code), or nothing where none was recorded."""
    versions = sorted({r.env["transformers"] for r in runs if r.env.get("transformers")},
                      key=lambda v: tuple(int(x) for x in re.findall(r"\d+", v)))
    return f" (transformers {', '.join(versions)})" if versions else ""


def render_short(runs: Sequence[Run]) -> str:
    header = ["what", "graphify", "compared with", "runs", "dates", "files"]
    return markdown(header, (claim_row(runs, c) for c in CLAIMS)) + "\n"


def render_gpu_tests(suites: Sequence[Suite]) -> str:
    """The newest run recorded in each gpu-tests file, and the newest run of the transformers
    tests under another transformers version than the suite's."""
    newest = sorted({s.file: s for s in reversed(suites)}.values(), key=lambda s: s.date, reverse=True)
    hf = next((dataclasses.replace(s, results=tuple(r for r in s.results if r[0].startswith("transformers")),
                                   versions=re.sub(r", transformers [\d.]+", "", s.versions))
               for s in suites if any(what.startswith("transformers") for what, _ in s.results)), None)
    return markdown(SUITE_HEADER, map(suite_row, newest + ([hf] if hf else []))) + "\n"


BLOCKS: dict[str, Callable[[Sequence[Run], Sequence[Suite]], str]] = {
    "results-short": lambda runs, suites: render_short(runs),
    "gpu-tests": lambda runs, suites: render_gpu_tests(suites),
    "plots": lambda runs, suites: _render_plots.readme_block(_render_plots.series(runs)),
    "zoo": lambda runs, suites: render_zoo(runs),
}


def render_readme(text: str, runs: Sequence[Run], suites: Sequence[Suite]) -> str:
    """`text` (README.md) with every generated block rendered afresh; an unknown block name
    is an error, not left stale."""

    def block(m: re.Match) -> str:
        if m.group(2) not in BLOCKS:
            raise KeyError(f"README.md: no renderer for generated block {m.group(2)!r}")
        return m.group(1) + BLOCKS[m.group(2)](runs, suites) + m.group(4)

    return BLOCK.sub(block, text)


def main() -> None:
    runs, suites = load_runs(), load_suites()
    (RESULTS / "README.md").write_text(render_results_readme(runs, suites))
    README.write_text(render_readme(README.read_text(), runs, suites))
    drawn = [_render_plots.draw(s, _render_plots.path_of(s)) for s in _render_plots.series(runs)]
    plots = "no plots (matplotlib is missing)" if None in drawn else f"{len(drawn)} plots"
    print(f"rendered {RESULTS / 'README.md'}, README.md's blocks and {plots} from {len(runs)} runs")


if __name__ == "__main__":
    main()
