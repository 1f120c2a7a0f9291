"""Per-batch exclusions from FULL graphs (vLLM's cascade attention), and what request-axis
arguments hold under a mixed-batch FULL graph."""

from __future__ import annotations

import torch

from conftest import calls_by_mode, counted
from graphify import Mode, Options, graphify, reqs, tokens


def varlen_params():
    from graphify.models import init_params
    from test_split import CFG

    return init_params(CFG, seed=3)


def test_a_batch_that_may_not_use_full_graphs_runs_piecewise_or_eagerly(backend):
    params = varlen_params()
    from graphify.models import model_support, new_paged_cache, split_ops, varlen_axes, varlen_step
    from test_split import BLOCK, CFG, check_against_eager, layout
    from graphify.transforms import split

    name, device = backend
    step = varlen_step(CFG, {k: v.to(device) for k, v in params.items()}, "unified")
    cache = new_paged_cache(CFG, 256, BLOCK, device=device, seed=4)
    example = layout((3, 1, 5), (4, 7, 0)).build(CFG, device=device)
    cascade = lambda *args: int(args[0].shape[0]) != 4  # noqa: E731 - say batches of 4 tokens need cascade attention
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes())
    for mode, excluded_runs_as in (("FULL_AND_PIECEWISE", Mode.PIECEWISE), ("FULL", Mode.NONE)):
        g = graphify(pw, mode=mode, sizes=(4, 8, 16), support=model_support("unified"), options=Options(backend=name, allow_full=cascade))
        g = g.capture(*example, cache)
        decode, excluded = layout([1] * 3, [5] * 3), layout([1] * 4, [6] * 4)
        check_against_eager(g, step, cache, [decode, excluded], device)
        ran = calls_by_mode(g)
        assert ran[Mode.FULL] == 1 and ran[excluded_runs_as] == 1 and sum(ran.values()) == 2, (mode, ran)


def test_request_axis_arguments_of_a_mixed_full_graph_hold_as_many_rows_as_tokens(backend):
    name, device = backend
    seen = []

    def fn(x, lens):
        seen.append((x.shape[0], lens.shape[0]))
        return x * 2, lens + 1

    g = graphify(fn, mode="FULL", sizes=(4, 8), axes=(tokens(), reqs(pad=1)),
                 options=Options(backend=name, side_effects="at_capture"))  # `seen` logs the capture's runs
    g = g.capture(torch.randn(5, 3, device=device), torch.ones(2, dtype=torch.long, device=device))
    graphs = {pair for pair in seen if pair[0] in (4, 8)}  # (a shape probe with fake tensors also runs fn)
    assert graphs == {(4, 4), (8, 8)}  # the relaxed key of n tokens serves 1..n requests: n request rows
    x = torch.randn(5, 3, device=device)
    out, lens = g(x, torch.tensor([2, 3], device=device))
    assert out.shape == (5, 3) and lens.tolist() == [3, 4]  # cut back to the real requests
    assert torch.equal(out, x * 2)
    assert calls_by_mode(g) == counted(full=1)  # the mixed batch replayed the relaxed 8-token graph
