"""What the shared-pool tests share: a function whose graphs need a large intermediate, and a
callable of two structures (two widths) already replaying on CUDA."""

from __future__ import annotations

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
