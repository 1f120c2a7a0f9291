"""Uniform (speculative-decode) keys never pad further than vLLM's rule (each size rounded
up to a multiple of q, capped at max_num_reqs * q) nor further than a q = 1 decode pads its
requests (the sizes read as request counts). Both rules are written out here, apart from
graphify's, and compared over random size lists, q and request counts."""

from __future__ import annotations

import bisect

from hypothesis import given
from hypothesis import strategies as st

from graphify import Mode, dispatch, vllm_sizes
from graphify.plan.dispatch import Dispatcher
from graphify.plan.keys import plan_keys


def vllm_padded(sizes, q, max_reqs, reqs):
    """Tokens vLLM's uniform decode graph gives `reqs` requests of q tokens, or None."""
    ladder = sorted({-(-s // q) * q for s in sizes if max_reqs is None or -(-s // q) <= max_reqs})
    i = bisect.bisect_left(ladder, reqs * q)
    return ladder[i] if i < len(ladder) else None


def request_padded(sizes, q, max_reqs, reqs):
    """Tokens of the request ladder: requests padded as a q = 1 decode pads them."""
    ladder = sorted(s for s in sizes if s * q <= max(sizes) and (max_reqs is None or s <= max_reqs))
    i = bisect.bisect_left(ladder, reqs)
    return ladder[i] * q if i < len(ladder) else None


def graphify_padded(keys, q, reqs):
    d = dispatch(keys, reqs * q, uniform=True)
    assert d.mode in (Mode.FULL, Mode.NONE)
    if d.mode is Mode.NONE:
        return None
    assert d.key.uniform and d.key.num_reqs * q == d.key.num_tokens
    return d.key.num_tokens


@given(
    sizes=st.lists(st.integers(1, 600), min_size=1, max_size=30, unique=True).map(sorted),
    q=st.integers(1, 8),
    max_reqs=st.one_of(st.none(), st.integers(1, 300)),
    reqs=st.integers(1, 700),
)
def test_uniform_batches_pad_to_no_more_than_vllm_or_the_request_ladder(sizes, q, max_reqs, reqs):
    keys = plan_keys("FULL_DECODE_ONLY", sizes, uniform_query_len=q, max_num_reqs=max_reqs)
    ours = graphify_padded(keys, q, reqs)
    refs = [t for t in (vllm_padded(sizes, q, max_reqs, reqs), request_padded(sizes, q, max_reqs, reqs)) if t is not None]
    if refs:
        assert ours is not None and ours <= min(refs), (ours, refs)
        assert ours == min(refs)  # the union of the two ladders, nothing else
    else:
        assert ours is None
    fast, ref = Dispatcher(keys).lookup(reqs * q, uniform=True), dispatch(keys, reqs * q, uniform=True)
    assert (fast.mode, fast.key) == (ref.mode, ref.key)


@given(
    sizes=st.lists(st.integers(1, 600), min_size=1, max_size=30, unique=True).map(sorted),
    q=st.integers(1, 8),
    max_reqs=st.one_of(st.none(), st.integers(1, 300)),
)
def test_graph_count_grows_by_at_most_one_per_size(sizes, q, max_reqs):
    uniform = [k for k in plan_keys("FULL_DECODE_ONLY", sizes, uniform_query_len=q, max_num_reqs=max_reqs).full]
    vllm = {-(-s // q) for s in sizes if max_reqs is None or -(-s // q) <= max_reqs}
    ladder = {s for s in sizes if s * q <= max(sizes) and (max_reqs is None or s <= max_reqs)}
    assert len(uniform) == len(vllm | ladder) <= len(vllm) + len(ladder)
    assert len(uniform) - max(len(vllm), len(ladder)) <= len(sizes)
    if q == 1:
        assert {k.num_tokens for k in uniform} == ladder  # plain decode: the sizes themselves


def test_the_issue_examples():
    keys = plan_keys("FULL_DECODE_ONLY", (8, 16, 32, 64), uniform_query_len=8)
    assert graphify_padded(keys, 8, 1) == 8  # was a 64-token graph
    keys = plan_keys("FULL_DECODE_ONLY", (2, 4, 8, 16, 32), uniform_query_len=2, max_num_reqs=8)
    assert graphify_padded(keys, 2, 1) == 2  # was 4
    keys = plan_keys("FULL_DECODE_ONLY", (1, 2, 4, 8, 16, 24), uniform_query_len=3)
    assert graphify_padded(keys, 3, 3) == 9  # was 12
    assert graphify_padded(keys, 3, 8) == 24


def test_the_default_schedule_with_three_query_tokens():
    keys = plan_keys("FULL_AND_PIECEWISE", vllm_sizes(512), uniform_query_len=3, max_num_reqs=256)
    for reqs, graph_tokens in ((1, 3), (2, 6), (3, 9), (4, 12), (8, 24)):
        d = dispatch(keys, reqs * 3, uniform=True)
        assert d.mode is Mode.FULL and d.key.uniform and d.key.num_tokens == graph_tokens, (reqs, d)
    assert keys.piecewise == plan_keys("PIECEWISE", vllm_sizes(512)).piecewise  # the mixed ladder is unchanged
    worst = max(graphify_padded(keys, 3, r) / (3 * r) for r in range(1, 171))
    assert worst <= 2.0


def test_plain_decode_keys_are_unchanged():
    keys = plan_keys("FULL_DECODE_ONLY", vllm_sizes(64), max_num_reqs=16)
    assert sorted(k.num_tokens for k in keys.full) == [s for s in vllm_sizes(64) if s <= 16]
