"""Numbers in the READMEs come from result files.

1. benchmarks/results/README.md, and every block of README.md between
   `<!-- generated:NAME -->` and `<!-- /generated -->`, equal what benchmarks.render_results
   renders now from benchmarks/results/: a hand-edited or stale number fails. After adding
   a result file or changing the renderer, run `python3 -m benchmarks.render_results`.
2. README.md holds no measurement outside its generated blocks (code and inline code
   included). A measurement is
   - a number followed by a unit, with or without a space: ms, s, min, µs, us, ns, x, ×,
     %, KiB, MiB, GiB, MB, GB, GB/s, TB/s, tok/s, tokens/s, kernels ("4.2 s", "1.3x", "317
     kernels", "42 ms/token"), the number perhaps in thousands ("62.2k tok/s"); or
   - a number in thousands ("54k"); or
   - a bare decimal fraction, a ratio such as "0.877", unless it is a version: right after
     torch, transformers, CUDA, Python, Triton or "==", or one part of a dotted triple
     (2.13.0).
   A number inside a word is neither (H100, 0.5B, Qwen2.5, bf16, 80gb in a file name), nor
   is a number without a unit ("512 tokens", "64 graphs", "8 structures", "B = 8"): those
   are sizes and constants of the library. Constants that do carry a unit are listed in
   ALLOWED, each with its reason; each must still occur, so the list cannot go stale.
3. The renderer's own prose (what each benchmark measures, how to run it, the code changes
   it names) holds no measurement either, by the same rule.
4. Every cell of README's short table, graphify's and what it is compared with, has result
   files behind it.
Everything here reads files only: it runs without a GPU.
"""

from __future__ import annotations

import difflib
import re

import pytest

from benchmarks import render_results as rr

UNITS = r"tokens/s|tok/s|TB/s|GB/s|kernels|KiB|MiB|GiB|MB|GB|min|ms|µs|us|ns|s|x|×|%"
MEASUREMENT = re.compile(
    rf"(?<![\w.])\d+(?:[.,]\d+)*k?\s?(?:{UNITS})(?!\w)"  # a number and its unit
    r"|(?<![\w.])\d+(?:\.\d+)?k(?!\w)"  # thousands
    r"|(?<![\w.])\d+\.\d+(?![\w.])"  # a bare decimal fraction
)
VERSION_BEFORE = re.compile(r"(?:torch|transformers|CUDA|Python|Triton|==)\s*$")

ALLOWED = {  # phrase in README.md -> why its number is not a measurement
    "32 MiB on Hopper": "the size of the cuBLAS workspace torch allocates on Hopper GPUs, a documented constant",
    "over 8 MiB": "models/_symm_mem.py's DEFAULT_MAX_BYTES, the library's own threshold for NCCL",
    "above 1 MiB on two GPUs and 512 KiB on more": "models/_symm_mem.py's ONE_SHOT_MAX_BYTES and "
    "ONE_SHOT_MAX_BYTES_MANY, the library's own defaults for the two-shot all-reduce",
}


def measurements(text: str) -> list[str]:
    """The measurement-like numbers in `text`, by the rule in this module's docstring."""
    found = []
    for line in text.splitlines():
        found += [m.group(0) for m in MEASUREMENT.finditer(line) if not VERSION_BEFORE.search(line[: m.start()])]
    return found


def outside_blocks(text: str) -> str:
    return rr.BLOCK.sub("", text)


def first_difference(have: str, want: str) -> str:
    diff = difflib.unified_diff(have.splitlines(), want.splitlines(), "on disk", "rendered now", n=0, lineterm="")
    return "\n".join(list(diff)[:12])


@pytest.fixture(scope="module")
def rendered():
    runs, suites = rr.load_runs(), rr.load_suites()
    return runs, suites


def test_the_results_readme_is_rendered_from_the_files(rendered):
    have = (rr.RESULTS / "README.md").read_text()
    want = rr.render_results_readme(*rendered)
    assert have == want, "stale: run python3 -m benchmarks.render_results\n" + first_difference(have, want)


def test_the_readmes_generated_blocks_are_rendered_from_the_files(rendered):
    have = rr.README.read_text()
    assert {m.group(2) for m in rr.BLOCK.finditer(have)} == set(rr.BLOCKS)
    want = rr.render_readme(have, *rendered)
    assert have == want, "stale: run python3 -m benchmarks.render_results\n" + first_difference(have, want)


def test_the_readme_quotes_no_measurement_outside_its_generated_blocks():
    text = outside_blocks(rr.README.read_text())
    for phrase in ALLOWED:
        assert phrase in text, f"ALLOWED names {phrase!r}, which README.md no longer holds"
        text = text.replace(phrase, "")
    assert measurements(text) == []


def test_the_renderers_prose_quotes_no_measurement():
    prose = [rr.INTRO, rr.SUITES_ABOUT] + [part for b in rr.BENCHES for part in (b.title, b.about)]
    prose += [what for b in rr.BENCHES for _, what in b.eras]
    assert [m for text in prose for m in measurements(text)] == []


@pytest.mark.parametrize("text", [
    "the first generate() took 4.2 s against 2.6 s", "0.86 ms of host a step", "0.196 and 0.436 µs a call",
    "1.3-2.9x the peer's", "p99 went to 10–16 ms", "NCCL 0.877 (two runs)", "317 kernels a step", "a 20% drift",
    "62,238 tok/s", "transformers 5.17, 5.23 and 5.24", "42 ms/token", "62.2k tok/s", "a peer at 44-54k",
    "45 min of device time",
])
def test_a_planted_measurement_is_found(text):
    assert measurements(text)


@pytest.mark.parametrize("text", [
    "up to 512 tokens and 64 graphs per structure", "At most 8 structures", "torch 2.13.0", "torch==2.13.0",
    "transformers 5.24", "the 0.5B model on an H100", "Qwen2.5-0.5B in bf16", "B = 1 / 8 / 32",
    "`decode-8b-nvidia-h100-80gb-hbm3.json`", "8 xdist workers", "51 sizes", "Python 3.12",
])
def test_sizes_versions_and_names_are_not_measurements(text):
    assert measurements(text) == []


def test_a_hand_edited_number_in_a_block_is_stale(rendered):
    text = rr.README.read_text()
    block = next(m for m in rr.BLOCK.finditer(text) if m.group(2) == "results-short")
    edited = text[: block.start(3)] + block.group(3).replace("|", "| 9.99 |", 1) + text[block.end(3):]
    assert edited != text and rr.render_readme(edited, *rendered) == rr.render_readme(text, *rendered)


def test_every_claim_of_the_short_table_has_runs_behind_it(rendered):
    runs, _ = rendered
    for claim in rr.CLAIMS:
        for cell, (text, used) in zip((claim.ours, claim.peer), rr.claim_cells(runs, claim)):
            if cell is not None:
                assert used and "-" not in text.split(" / "), f"no result file behind {claim.what!r}: {cell.text!r}"


def test_an_unknown_generated_block_is_an_error_not_left_stale(rendered):
    with pytest.raises(KeyError, match="no-such-table"):
        rr.render_readme("<!-- generated:no-such-table -->\n| 1.5 ms |\n<!-- /generated -->\n", *rendered)


def test_a_claim_sets_ours_beside_the_peer_on_one_kind_of_card(rendered):
    """Cards move a token's time by tens of percent: a claim whose ours came from an H100 and
    whose peer from an H200 would compare the cards, not the tools."""
    runs, _ = rendered
    mixed = [claim.what for claim in rr.CLAIMS
             if len({r.env["device"] for _, used in rr.claim_cells(runs, claim) for r in used}) > 1]
    assert not mixed, mixed


def test_the_plots_are_the_result_files_medians_with_the_peer_beside(tmp_path):
    from benchmarks import _render_plots as rp

    runs = rr.load_runs()
    plots = {s.name: s for s in rp.series(runs)}
    assert set(plots) == {"main-job", "hf-generate", "zoo"}
    main, hf = plots["main-job"], plots["hf-generate"]
    assert main.peers and all("reduce-overhead" in p for p in main.peers)
    assert hf.peers and all("transformers' own compile" in p for p in hf.peers)
    # a bar is the median of its configuration's rows in the newest era on the plot's card
    rows = [row["tokens_per_s"] for run, row in rr.picked(runs, "serving", "trace",
                                                           {"config": rp.SERVING_PEER, "process": "1st"})
            if run.env["device"] == main.device]
    import statistics

    assert main.bars[f"{rp.SERVING_PEER} (1st process)"]["tokens_per_s"] == statistics.median(rows)
    # README's block names every plot, and the images it names are in the tree
    block = rp.readme_block(list(plots.values()))
    for name in plots:
        assert f"](benchmarks/results/plots/{name}.png)" in block
        assert (rp.PLOTS / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pytest.importorskip("matplotlib")
    drawn = rp.draw(main, tmp_path / "main.png")
    assert drawn is not None and drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_swap_call_is_set_against_a_later_call_of_its_length():
    from benchmarks._render_tables import hf_per_token_rows

    data = {"args": {"new_tokens": 64}, "rows": [
        {"config": "a", "ms_per_token": 8.0, "ttft_ms": 60.0, "swap_generate_s": 0.846},  # a run before the field
        {"config": "b", "ms_per_token": 8.0, "ttft_ms": 60.0, "swap_generate_s": 0.9, "swap_vs_call": 1.7},
        {"config": "c", "ms_per_token": 8.0, "ttft_ms": 60.0},  # no swap in this line
        {"config": "chat", "chat_total_s": 3.0},
    ]}
    rows = hf_per_token_rows(data)
    assert [r["config"] for r in rows] == ["a", "b", "c"]
    assert abs(rows[0]["swap_vs_call"] - 846 / (60 + 63 * 8)) < 1e-12
    assert rows[1]["swap_vs_call"] == 1.7 and rows[2]["swap_vs_call"] is None


def test_a_claims_runs_name_the_transformers_versions_they_ran_under():
    """The line's cost follows transformers' own code (5.24 packs grouped-query attention in
    eager decode, 5.17 does not), so a claim names the versions behind it; runs that recorded
    none add nothing."""
    def run(version):
        env = {"device": "d", "date": "2026-11-27T00:00:00+00:00"} | ({"transformers": version} if version else {})
        return rr.Run("f.json", rr.BENCHES[0], env, {}, 0, ())

    assert rr.library_versions([run("5.24.0"), run("5.17.0"), run("5.24.0")]) == " (transformers 5.17.0, 5.24.0)"
    assert rr.library_versions([run("5.9.0"), run("5.17.0")]) == " (transformers 5.9.0, 5.17.0)"
    assert rr.library_versions([run(None)]) == ""


def test_a_claim_counts_only_the_runs_that_measured_what_it_shows():
    """A field added to a benchmark is absent from its older runs: those runs match the cell's
    rows but did not measure its field, so they are neither in its range nor among its runs."""
    from benchmarks._render_tables import Cell

    def run(name, date, **row):
        data = {"args": {"new_tokens": 64}, "rows": [{"model": "m", "config": "c", "batch": 1, "ms_per_token": 8.0,
                                                      "ttft_ms": 60.0, **row}]}
        return rr.Run(name, next(b for b in rr.BENCHES if b.kind == "hf-generate"),
                      {"device": "d", "date": date}, data, 0, ())

    runs = [run("old.json", "2026-11-27T00:00:00+00:00"), run("new.json", "2026-11-28T00:00:00+00:00", x=1.018),
            run("newer.json", "2026-11-28T01:00:00+00:00", x=1.04)]
    text, used = rr.render_cell(runs, "hf-generate", "per-token", Cell({"model": "m"}, "{x:.3f}"))
    assert text == "1.018–1.040" and [r.file for r in used] == ["new.json", "newer.json"]
    text, used = rr.render_cell(runs, "hf-generate", "per-token", Cell({"model": "m"}, "{ms_per_token:.1f}"))
    assert len(used) == 3
    assert rr.render_cell(runs[:1], "hf-generate", "per-token", Cell({"model": "m"}, "{x:.3f}")) == ("-", [])


def test_a_suite_run_is_read_with_its_summaries_and_the_steps_it_states():
    """A cut run has no pytest summary: the block's own words say so, and its row does too."""
    from benchmarks.render_results import parse_suite

    block = """Device: NVIDIA H200 (nvidia-h200, one GPU; torch 2.11.0+cu130, CUDA 13.0, transformers 5.17.0)
date: 2026-11-28 13:01 UTC (the tree of commit b7860de)

Result: the suite did not finish (cut by its own limit); tests/test_background_compile.py 1 of 1 passed.
"""
    suite = parse_suite("gpu-tests-x.txt", block)
    assert (suite.date, suite.commit, suite.device) == ("2026-11-28 13:01", "b7860de", "NVIDIA H200")
    assert suite.results == (("tests/test_background_compile.py", "1 of 1 passed"), ("the suite", "did not finish"))
    whole = parse_suite("gpu-tests-x.txt", block.replace("Result:", "3 failed, 1455 passed, 9 skipped in 381.93s\n"))
    assert whole.results[0] == ("the suite", "1455 passed, 3 failed, 9 skipped")


def test_the_zoo_block_is_the_zoo_files_medians_per_model_and_batch():
    """A zoo cell is the median over runs of the line's ms ÷ reduce-overhead's; the summary's
    geometric mean is over the best graphify line of each shape."""
    import math
    import statistics

    from benchmarks import _render_zoo as rz

    runs = rr.load_runs()
    med, used = rz.zoo_medians(runs)
    if not med:
        pytest.skip("no zoo results in the tree")
    rows = [row for run in used for row in run.data["rows"]]
    (model, length, batch, _), = [k for k in med if k[3] == "graphify_compile"][:1]
    want = statistics.median(r["vs_peer"] for r in rows if (r["model"], r["length"], r["batch"], r["line"])
                             == (model, length, batch, "graphify_compile"))
    assert med[model, length, batch, "graphify_compile"]["vs_peer"] == want
    block = rz.render_zoo(runs)
    assert f"| {model} |" in block
    shapes = {(r["model"], r["length"], r["batch"]) for r in rows if r["line"] == "reduce_overhead"}
    best = [min(med[(*s, line)]["vs_peer"] for line in rz.OURS if (*s, line) in med) for s in shapes]
    assert f"geometric mean {math.exp(statistics.fmean(map(math.log, best))):.2f}" in block
    series = rz.zoo_series(runs)
    assert series.bars and all(set(v) <= {"b1", "b8"} for v in series.bars.values())
