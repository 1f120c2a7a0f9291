"""What the shared-pool tests share: a function whose graphs need a large intermediate, a
callable of two structures (two widths) already replaying on CUDA, the one pool a callable's
structures share, and a call started in a thread."""

from __future__ import annotations

import threading

import torch

from graphify import graphify


def widened(x):
    """An intermediate 64 times its argument's size, an output a row of numbers."""
    return torch.relu(x.repeat(1, 64) - 0.5).sum(-1) + x[:, 0]


def two_structures_replaying(seed: int):
    """`graphify(widened)` called three times at each of two widths (its two structures'
    graphs made), the inputs from a generator seeded `seed`, and eager's answers for them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.rand(256, w, device="cuda", generator=gen) for w in (4096, 2048)]
    want = [widened(x) for x in xs]
    g = graphify(widened)
    for x in xs:
        for _ in range(3):
            g(x)
    torch.cuda.synchronize()
    return g, xs, want


def shared_pool(g):
    """The one pool a callable's structures share."""
    pools = {id(b.capture.session.pool): b.capture.session.pool
             for s in tuple(g._first_use.structures) for b in tuple(s.branches.values())}
    assert len(pools) == 1
    return next(iter(pools.values()))


def in_thread(call) -> tuple:
    """(thread, its results) of `call()` started in a thread."""
    got = []
    t = threading.Thread(target=lambda: got.append(call()))
    t.start()
    return t, got
