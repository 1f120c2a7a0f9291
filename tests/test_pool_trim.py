"""`Pool.trim()` gives back only memory no live graph works in: a backend whose allocator
frees the free blocks live graphs use between replays (CuPy's `free_all_blocks`) is not
asked while a graph of the pool lives (a failed capture trims its pool: before, that freed
the working memory of the pool's other graphs). The CUDA case is in test_cuda_cupy.py."""

from __future__ import annotations

import gc

import pytest
import torch

from graphify import Pool
from graphify.backends.cupy_graph import CupyBackend
from graphify.backends.sim import SimBackend
from graphify.backends.torch_cuda import TorchCudaBackend


class Recording:
    """A backend as `Pool` sees it, writing down the trims it is asked for."""

    def __init__(self, name: str, frees_live: bool):
        self.name, self.trim_frees_live_graphs, self.trims = name, frees_live, 0

    def new_pool_handle(self, device):
        return object()

    def trim(self, handle, device):
        self.trims += 1


class Graph:  # what a pool tracks while it lives (a captured entry)
    pass


@pytest.mark.parametrize("frees_live", [True, False])
def test_a_pool_is_trimmed_while_graphs_live_only_where_that_frees_nothing_they_use(frees_live):
    backend, pool = Recording("cupy" if frees_live else "cuda", frees_live), Pool("p")
    pool.trim()
    assert backend.trims == 0  # no handle yet: nothing to give back
    pool.handle_for(backend, torch.device("cpu"), "f")
    graph = Graph()
    pool.track(graph, "f 4", 1024)
    pool.trim()
    assert backend.trims == (0 if frees_live else 1)
    del graph
    gc.collect()
    pool.trim()
    assert backend.trims == (1 if frees_live else 2)  # the last graph gone: given back


def test_each_backend_says_whether_its_trim_frees_live_graphs_memory():
    assert CupyBackend.trim_frees_live_graphs is True
    assert TorchCudaBackend.trim_frees_live_graphs is False and SimBackend.trim_frees_live_graphs is False
