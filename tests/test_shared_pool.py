"""The call structures of one callable captured on first use share one graph pool
(`graphify.plan.pool.PoolsByDevice`): its calls run one after another and hand out copies,
so a structure's graphs may reuse the memory of another's. Outputs always compared with
eager's on fresh random inputs."""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import replayed, requires_cuda
from graphify import Options, Pool, graphify


def widened(x):
    """An intermediate 64 times its argument's size, an output a row of numbers."""
    return torch.relu(x.repeat(1, 64) - 0.5).sum(-1) + x[:, 0]


def pools_of(g) -> list:
    """Each structure's pool (the pool of its branches' capture sessions), by structure."""
    return [b.capture.session.pool for s in tuple(g._first_use.structures) for b in tuple(s.branches.values())]


def interleaved(g, device, widths=(48, 32), rounds=3, rows=(4, 7)):
    """Calls of two structures (trailing widths) by turns, each equal to eager's."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(rounds):
        for width in widths:
            for n in rows:
                x = torch.rand(n, width, generator=gen).to(device)
                torch.testing.assert_close(g(x), widened(x), rtol=1e-5, atol=1e-4)


def test_the_structures_of_a_callable_share_one_pool_and_answer_as_eager(backend):
    name, device = backend
    g = graphify(widened, options=Options(backend=name))
    interleaved(g, device)
    pools = pools_of(g)
    assert len(pools) == 2 and pools[0] is pools[1]
    assert replayed(g) >= 8


def test_views_keep_a_pool_per_structure(backend):
    """A view of one structure's output stays valid across another structure's call."""
    name, device = backend
    g = graphify(widened, options=Options(backend=name, outputs="view"))
    gen = torch.Generator().manual_seed(6)
    a, b = (torch.rand(4, w, generator=gen).to(device) for w in (48, 32))
    for _ in range(3):
        got_a = g(a)
        got_b = g(b)
        torch.testing.assert_close(got_a, widened(a), rtol=1e-5, atol=1e-4)  # read after b's call
        torch.testing.assert_close(got_b, widened(b), rtol=1e-5, atol=1e-4)
    pools = pools_of(g)
    assert len(pools) == 2 and pools[0] is not pools[1]


def test_a_users_pool_serves_every_structure(backend):
    name, device = backend
    mine = Pool("mine")
    g = graphify(widened, options=Options(backend=name), pool=mine)
    interleaved(g, device)
    assert [p is mine for p in pools_of(g)] == [True, True]


@pytest.mark.cuda
@requires_cuda
def test_a_second_structure_reuses_the_first_ones_memory():
    """Structures captured larger first: the smaller one's graphs fit in the memory the
    larger one's left free, so the shared pool holds about the larger one's alone."""
    gen = torch.Generator(device="cuda").manual_seed(7)

    def reserved(widths) -> int:
        g = graphify(widened)
        for width in widths:
            for _ in range(3):  # a first sighting, then captured and replayed
                x = torch.rand(256, width, device="cuda", generator=gen)
                torch.testing.assert_close(g(x), widened(x), rtol=1e-5, atol=1e-3)
        torch.cuda.synchronize()
        pools = {id(p): p for p in pools_of(g)}
        assert replayed(g) >= 2 * len(widths)
        return sum(p.report().reserved_bytes for p in pools.values()), g

    wide, keep_wide = reserved((4096,))  # 256 MiB of intermediate at 256 rows
    narrow, keep_narrow = reserved((2048,))
    both, keep_both = reserved((4096, 2048))
    assert len({id(p) for p in pools_of(keep_both)}) == 1
    assert narrow > 0 and both < wide + narrow
    assert both <= wide + (4 << 20), f"{both >> 20} MiB for both structures, {wide >> 20} MiB for the wider alone"
    del keep_wide, keep_narrow, keep_both
    gc.collect()
