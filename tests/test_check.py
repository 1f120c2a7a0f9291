"""`g.check()`: the differential check users run after capture, on every backend."""

from __future__ import annotations

import pytest
import torch

from graphify import Options, graphify, persistent, tokens


def test_check_passes_a_row_wise_function_at_every_size(backend):
    name, device = backend
    w = torch.randn(6, 6, device=device)
    g = graphify(lambda x, w: torch.tanh(x @ w), mode="FULL", sizes=(2, 4, 8), axes=(tokens(), persistent()), options=Options(backend=name)).capture(torch.randn(3, 6, device=device), w)
    report = g.check(atol=1e-4)
    assert report.ok, report
    assert [(r.num_tokens, r.where, r.mode, r.padded_to) for r in report.rows] == [
        (1, "between", "FULL", 2), (2, "captured", "FULL", 2), (3, "between", "FULL", 4), (4, "captured", "FULL", 4),
        (6, "between", "FULL", 8), (8, "captured", "FULL", 8), (9, "above", "NONE", None),
    ]  # what each checked call ran as: replays of the graphs, eager only above them
    assert g.stats.calls == 0  # the check is not counted as the caller's traffic


def test_check_finds_a_function_that_mixes_rows_across_the_batch(backend):
    name, device = backend
    g = graphify(lambda x: x + x.mean(0), mode="FULL", sizes=(2, 4, 8), options=Options(backend=name)).capture(
        torch.randn(3, 5, device=device)
    )
    report = g.check()
    assert not report.ok
    bad = {r.num_tokens for r in report.rows if not r.match}
    assert bad == {1, 3, 6}  # padded sizes only; captured sizes and eager above are right
    assert {r.num_tokens: r.mode for r in report.rows} == {1: "FULL", 2: "FULL", 3: "FULL", 4: "FULL", 6: "FULL",
                                                          8: "FULL", 9: "NONE"}
    assert all("padding changes real rows" in r.verdict for r in report.rows if not r.match)
    assert "MISMATCHES" in str(report) and "| 3 | between | FULL | 4 |" in str(report)


def test_check_with_request_axes_needs_and_uses_make_batch(backend):
    from graphify.models import init_params, new_paged_cache, varlen_axes, varlen_step
    from test_split import BLOCK, CFG, layout

    name, device = backend
    step = varlen_step(CFG, {k: v.to(device) for k, v in init_params(CFG, seed=3).items()}, "unified")
    cache = new_paged_cache(CFG, 256, BLOCK, device=device, seed=4)
    example = layout((3, 1, 5), (4, 7, 0)).build(CFG, device=device)
    g = graphify(step, mode="FULL", sizes=(4, 8, 16), axes=varlen_axes(), options=Options(backend=name)).capture(*example, cache)
    with pytest.raises(ValueError, match="pass make_batch"):
        g.check()
    before = cache.clone()

    def make_batch(n):  # n single-token decodes
        return (*layout([1] * n, [5] * n).build(CFG, device=device, seed=n), cache)

    report = g.check(make_batch, atol=1e-4, rtol=1e-4)
    assert report.ok, report
    assert [(r.num_tokens, r.where, r.mode) for r in report.rows] == [
        (2, "between", "FULL"), (4, "captured", "FULL"), (6, "between", "FULL"), (8, "captured", "FULL"),
        (12, "between", "FULL"), (16, "captured", "FULL"), (17, "above", "NONE"),
    ]  # replays of the graphs; eager only above them
    assert torch.equal(cache[:, :, 1:], before[:, :, 1:])  # the eager runs' K/V writes were put back
