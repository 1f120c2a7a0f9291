"""Uniform (speculative) decode keys pad requests, not tokens: with query length q, a
batch of r requests pads exactly as a plain decode of r requests would."""

from __future__ import annotations

import pytest

from graphify import Dispatcher, Mode, dispatch, pad_to, plan_keys, vllm_sizes


def test_the_issue_example_pads_one_request_to_three_tokens():
    keys = plan_keys("FULL_AND_PIECEWISE", vllm_sizes(512), uniform_query_len=3, max_num_reqs=256)
    for reqs, graph_tokens in ((1, 3), (2, 6), (4, 12), (8, 24), (3, 12)):
        d = dispatch(keys, reqs * 3, uniform=True)
        assert d.mode is Mode.FULL and d.key.uniform and d.key.num_tokens == graph_tokens, (reqs, d)
        assert d.key.num_reqs == graph_tokens // 3
    assert keys.piecewise == plan_keys("PIECEWISE", vllm_sizes(512)).piecewise  # the mixed ladder is unchanged


@pytest.mark.parametrize("q", [1, 2, 3, 4, 5])
def test_padding_waste_over_the_default_schedule_equals_request_padding(q):
    sizes = vllm_sizes(512)
    keys = plan_keys("FULL_AND_PIECEWISE", sizes, uniform_query_len=q, max_num_reqs=256)
    table = Dispatcher(keys)
    worst = 0.0
    for reqs in range(1, 257):
        tokens = reqs * q
        if tokens > 512:
            break
        d = table.lookup(tokens, uniform=True)
        assert d == dispatch(keys, tokens, uniform=True)
        padded_reqs = pad_to(sizes, reqs)
        if padded_reqs is not None and padded_reqs * q <= 512:
            assert d.mode is Mode.FULL and d.key.num_tokens == padded_reqs * q  # the request ladder, times q
        worst = max(worst, d.key.num_tokens / tokens if d.key is not None else 1.0)
    assert worst <= 2.0  # never more than doubling, whatever q (was 8x for q = 3)


def test_plain_decode_keys_are_unchanged():
    keys = plan_keys("FULL_DECODE_ONLY", vllm_sizes(64), max_num_reqs=16)
    assert sorted(k.num_tokens for k in keys.full) == [s for s in vllm_sizes(64) if s <= 16]
