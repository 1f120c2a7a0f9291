"""Static input buffers in tiers (graphify.plan.static_buffers): under first use the buffers
grow with the batch sizes met instead of being sized for the largest possible key, and every
graph keeps reading the tier it was captured on. Outputs compared with eager on fresh random
inputs; the tiers' rows read from the table."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphify import Mode, Options, graphify, persistent, tokens
from graphify.base.axes import Kind
from graphify.plan.static_buffers import tier_rows


def mlp(x, w):
    return torch.tanh(x @ w) + x


def weight(device):
    return torch.randn(16, 16, generator=torch.Generator().manual_seed(5)).to(device)


def static_of(g):
    return g._first_use.current().runtime.table.static


def tiers(g) -> list[int]:
    return [t.rows[Kind.TOKENS] for t in static_of(g).tiers]


def replays(g) -> int:
    return sum(r.calls for r in g.stats.by_mode() if r.mode is not Mode.NONE)


# -- the pure rule -------------------------------------------------------------------------------
@given(st.integers(1, 600), st.integers(0, 600), st.one_of(st.none(), st.integers(0, 9)))
def test_a_new_tier_holds_the_key_doubles_the_last_and_stays_within_the_largest_key(need, above, power):
    # asked only where no tier holds the key: the last tier (a power of two) is smaller than it
    largest = None if power is None or 2**power >= need else 2**power
    limit = need + above  # a key never exceeds the largest key
    rows = tier_rows({Kind.TOKENS: need, Kind.REQS: 1}, None if largest is None else
                     {Kind.TOKENS: largest, Kind.REQS: 1}, {Kind.TOKENS: limit, Kind.REQS: 1})
    got = rows[Kind.TOKENS]
    assert need <= got <= limit
    assert got == limit or got & (got - 1) == 0  # a power of two unless cut at the limit
    assert got < 2 * need or got == 2 * largest  # no more than the next power of two, or twice the last tier
    if largest is not None:
        assert got >= min(2 * largest, limit)
    assert rows[Kind.REQS] == 1


# -- first use grows them; graphs keep theirs ----------------------------------------------------
def test_first_use_holds_rows_for_the_sizes_met_not_the_largest_key(backend):
    name, device = backend
    w = weight(device)
    g = graphify(mlp, axes=(tokens(), persistent()), options=Options(backend=name))
    for _ in range(3):
        x = torch.randn(1, 16, device=device)
        torch.testing.assert_close(g(x, w), mlp(x, w))
    assert tiers(g) == [1]  # one row, where one tier for every key would hold 512
    for _ in range(3):
        x = torch.randn(8, 16, device=device)
        torch.testing.assert_close(g(x, w), mlp(x, w))
    assert tiers(g) == [1, 8]


def test_graphs_of_every_tier_replay_eagers_answer_in_any_order(backend):
    name, device = backend
    w = weight(device)
    g = graphify(mlp, axes=(tokens(), persistent()), options=Options(backend=name))
    order = [1, 1, 8, 8, 3, 3, 1, 20, 20, 2, 8, 3, 1, 20, 5, 5, 1]
    for n in order:
        x = torch.randn(n, 16, device=device)
        torch.testing.assert_close(g(x, w), mlp(x, w), rtol=1e-5, atol=1e-5)
    assert tiers(g) == [1, 8, 32]  # 3 and 5 fit in the 8-row tier, 2 as well (the smallest that holds it)
    assert replays(g) >= len(order) - 6  # each size's first call (or two) runs eagerly


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=16), st.integers(0, 2**16))
def test_any_stream_of_sizes_matches_eager_and_the_tiers_stay_within_twice_the_largest(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    w = weight("cpu")
    g = graphify(mlp, axes=(tokens(), persistent()), options=Options(backend="sim"))
    for n in sizes:
        x = torch.randn(n, 16, generator=gen)
        torch.testing.assert_close(g(x, w), mlp(x, w), rtol=1e-5, atol=1e-5)
    structure = g._first_use.current() if g._first_use.structures else None
    if structure is not None and structure.runtime.table.entries:
        held = tiers(g)
        assert sum(held) <= 4 * max(sizes)  # powers of two, each at least twice the last
        assert held == sorted(held)


def test_padded_keys_read_one_tier_sized_for_the_largest(backend):
    name, device = backend
    w = weight(device)
    g = graphify(mlp, axes=(tokens(pad=-2.0), persistent()), sizes=(4, 8), options=Options(backend=name))
    for n in (3, 3, 7, 7, 2):
        x = torch.randn(n, 16, device=device)
        torch.testing.assert_close(g(x, w), mlp(x, w))
    static = static_of(g)
    assert [t.rows[Kind.TOKENS] for t in static.tiers] == [8]
    buf = static.buffers[0]
    assert torch.equal(buf[2:8], torch.full_like(buf[2:8], -2.0))  # padding restored after the 7-row call


def test_a_capture_writing_its_input_is_refused_whatever_the_tier(backend):
    name, device = backend

    def scales_in_place(x):
        return x.mul_(2)

    g = graphify(scales_in_place, axes=(tokens(),), options=Options(backend=name))
    with pytest.warns(UserWarning, match="in place"):
        for n in (1, 1, 1, 6, 6, 6):
            x = torch.randn(n, 16, device=device)
            want = x * 2
            torch.testing.assert_close(g(x.clone()), want)


def test_request_rows_count_only_where_an_argument_has_them(backend):
    """Uniform decode of two-token queries: keys of 8 tokens hold 4 request rows. A function
    with no request-axis argument is handed static inputs of 8 token rows all the same."""
    from graphify import Batching

    name, device = backend
    w = weight(device)
    g = graphify(mlp, mode="FULL_DECODE_ONLY", sizes=(2, 4, 8), axes=(tokens(), persistent()),
                 batching=Batching(uniform_query_len=2), options=Options(backend=name)).capture(
        torch.randn(4, 16, device=device), w)
    assert g.table.static.tiers[0].rows[Kind.REQS] < 8
    x, same_w = g.static_inputs(8)
    x.copy_(torch.randn(8, 16, device=device))
    torch.testing.assert_close(g(x, same_w), mlp(x, w))


def test_static_inputs_without_a_request_count_hand_out_the_request_rows_the_tier_has(backend):
    """A request-axis argument of a uniform decode (two-token queries): `static_inputs(8)`
    gives 8 token rows and the tier's 4 request rows, and a call with them answers as eager."""
    from graphify import Batching, reqs

    def scaled(x, r, w):
        return torch.tanh(x @ w) * r.repeat_interleave(2)[:, None]

    name, device = backend
    w = weight(device)
    g = graphify(scaled, mode="FULL_DECODE_ONLY", sizes=(2, 4, 8), axes=(tokens(), reqs(), persistent()),
                 batching=Batching(uniform_query_len=2), options=Options(backend=name)).capture(
        torch.randn(4, 16, device=device), torch.randn(2, device=device), w)
    x, r, same_w = g.static_inputs(8)
    assert (x.shape[0], r.shape[0]) == (8, 4)
    x.copy_(torch.randn(8, 16, device=device))
    r.copy_(torch.randn(4, device=device))
    torch.testing.assert_close(g(x, r, same_w), scaled(x, r, w))


def test_no_memory_for_a_new_tier_runs_those_calls_eagerly_with_one_warning(monkeypatch):
    from graphify.backends.sim import SimBackend

    empty = SimBackend.empty

    def short_of_memory(self, shape, dtype, device):
        if shape and shape[0] > 16:
            raise torch.OutOfMemoryError("no memory (made to)")
        return empty(self, shape, dtype, device)

    monkeypatch.setattr(SimBackend, "empty", short_of_memory)
    w = weight("cpu")
    g = graphify(mlp, axes=(tokens(), persistent()), options=Options(backend="sim"))
    with pytest.warns(UserWarning, match="no device memory for the static input buffers"):
        for n in (1, 1, 1, 20, 20, 20, 1):
            x = torch.randn(n, 16)
            torch.testing.assert_close(g(x, w), mlp(x, w))
    assert tiers(g) == [1]
    assert replays(g) >= 3  # the batches of one row replay; those of 20 run eagerly


def test_rows_no_tier_holds_are_refused_by_name():
    g = graphify(mlp, axes=(tokens(), persistent()), options=Options(backend="sim"))
    w = weight("cpu")
    for _ in range(3):
        g(torch.randn(2, 16), w)
    static = static_of(g)
    assert static.tier_of(2, None) == 0
    with pytest.raises(ValueError, match="no static buffers hold 5 token rows"):
        static.tier_of(5, None)
