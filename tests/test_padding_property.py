"""Property: any sequence of batch sizes (growing, shrinking, above the largest size) gives
eager's outputs, and the static buffers hold padding past the real rows after every call."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import calls_by_mode, counted
from graphify import Options, graphify, persistent, tokens

W = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))


def rowwise(x, w):
    return torch.tanh(x @ w) + x


G = graphify(rowwise, mode="FULL", sizes=(2, 4, 8), axes=(tokens(pad=-3.0), persistent()), options=Options(backend="sim")).capture(torch.randn(3, 5), W)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=12), st.integers(0, 2**16))
def test_any_sequence_of_batches_matches_eager_and_keeps_padding(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    buf = G.table.static.buffers[0]
    before = calls_by_mode(G)
    for n in sizes:
        x = torch.randn(n, 5, generator=gen)
        out = G(x, W)
        torch.testing.assert_close(out, rowwise(x, W), rtol=1e-5, atol=1e-5)
        if n <= 8:
            assert torch.equal(buf[n:], torch.full_like(buf[n:], -3.0))
    ran = {m: n - before[m] for m, n in calls_by_mode(G).items()}
    assert ran == counted(full=sum(n <= 8 for n in sizes), none=sum(n > 8 for n in sizes))  # replays up to 8 rows
