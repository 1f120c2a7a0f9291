"""The call structures of one callable captured on first use share one graph pool
(`graphify.plan.pool.PoolsByDevice`): its calls run one after another and hand out copies,
so a structure's graphs may reuse the memory of another's. Outputs always compared with
eager's on fresh random inputs."""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import replayed, requires_cuda
from shared_pool_cases import two_structures_replaying, widened
from graphify import Options, Pool, graphify


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


def test_calls_of_two_structures_from_two_threads_never_replay_at_once(backend, monkeypatch):
    """Their runtimes share one lock: a replay and the copy of its outputs end before another
    structure's replay into the same blocks begins."""
    import threading
    import time

    from graphify.call import runtime as runtime_module

    name, device = backend
    active, guard, overlaps = {}, threading.Lock(), []
    real = runtime_module.Runtime._replay

    def spied(self, plan, *args, **kwargs):
        with guard:
            pool = self.table.pool
            overlaps.extend(t for t, p in active.items() if p is pool and t != threading.get_ident())
            active[threading.get_ident()] = pool
        try:
            time.sleep(0.002)  # a replay in flight
            return real(self, plan, *args, **kwargs)
        finally:
            with guard:
                active.pop(threading.get_ident(), None)

    g = graphify(widened, options=Options(backend=name))
    gen = torch.Generator().manual_seed(8)
    xs = {w: torch.rand(4, w, generator=gen).to(device) for w in (48, 32)}
    for x in xs.values():
        for _ in range(3):
            g(x)
    monkeypatch.setattr(runtime_module.Runtime, "_replay", spied)
    wrong = []

    def calls(x):
        for _ in range(30):
            if not torch.allclose(g(x), widened(x), rtol=1e-5, atol=1e-4):
                wrong.append(x.shape)

    threads = [threading.Thread(target=calls, args=(x,)) for x in xs.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == [] and wrong == []
    assert len({id(p) for p in pools_of(g)}) == 1


def test_a_capture_holds_off_another_threads_drop_of_its_pools_last_graph():
    """Between taking a pool id and counting the graph captured into it, a drop of the id's
    last graph elsewhere would leave torch a capture into a released id. torch gives a
    graph's use of its pool back in the C++ destructor, before any Python finalizer (pybind11),
    so the capture keeps such a graph alive: its destructor runs after the capture counts."""
    import threading

    from graphify.backends.graph_pool import GraphPool

    ids = iter(range(100))
    pool = GraphPool(lambda: next(ids))
    destroyed = []

    class Graph:  # its __del__ stands for ~CUDAGraph, which releases torch's use of the id
        def __init__(self, name):
            self.name = name

        def __del__(self):
            destroyed.append(self.name)

    old = Graph("old")
    pool.for_capture()
    pool.holds(old, pool.id)

    def drop():
        nonlocal old
        del old

    with pool.capturing() as pool_id:
        other = threading.Thread(target=drop)
        other.start()
        other.join(5)
        assert destroyed == [] and pool_id == 0  # still alive: torch still counts the id
        new = Graph("new")
        pool.holds(new, pool_id)
    assert destroyed == ["old"] and pool.live == 1
    with pool.capturing() as again:
        assert again == 0  # `new` lives: the same id
    del new
    with pool.capturing() as fresh:
        assert fresh == 1  # every graph of id 0 gone: a fresh one


def test_cupy_structures_keep_a_pool_each():
    from graphify.call.shared_calls import SharedCalls
    from graphify.plan.pool import PoolsByDevice

    pools = PoolsByDevice("f", SharedCalls)

    class Backend:
        def __init__(self, name):
            self.name = name

    cuda, cupy, device = Backend("cuda"), Backend("cupy"), torch.device("cuda", 0)
    assert pools(cuda, device) is pools(cuda, device) and pools(cuda, device).shared is not None
    assert pools(cupy, device) is not pools(cupy, device) and pools(cupy, device).shared is None
    assert pools(cuda, torch.device("cuda", 1)) is not pools(cuda, device)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("how", ["one thread, two streams", "two threads, one stream", "two threads, two streams"])
def test_two_structures_called_at_once_answer_as_eager(how):
    """Their graphs share blocks: the shared lock orders threads, and a call on another
    stream than the last waits for it."""
    import threading

    g, xs, want = two_structures_replaying(9)
    outs: list = [[], []]
    if how == "one thread, two streams":
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        for _ in range(100):
            for i, s in enumerate(streams):
                with torch.cuda.stream(s):
                    outs[i].append(g(xs[i]))
    else:
        def work(i):
            s = torch.cuda.Stream() if how == "two threads, two streams" else torch.cuda.current_stream()
            with torch.cuda.stream(s):
                for _ in range(100):
                    outs[i].append(g(xs[i]))
            s.synchronize()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    torch.cuda.synchronize()
    for i in range(2):
        assert all(torch.allclose(o, want[i], rtol=1e-4, atol=1e-2) for o in outs[i])
    assert len({id(p) for p in pools_of(g)}) == 1


def test_a_capture_under_a_shared_pool_first_orders_the_callers_stream(backend):
    """`capturing()` (held by first-use captures, whose split ops and piece warm-ups run in
    the pool's blocks) waits for the last replay's stream as a replay does; a split
    function's capture (`whole`) marks what it ran for the next stream."""
    name, device = backend
    g = graphify(widened, options=Options(backend=name))
    x = torch.rand(4, 48).to(device)
    for _ in range(3):
        g(x)
    runtime = next(iter(g._first_use.structures[0].branches.values())).runtime
    shared, ordered = runtime.shared, []
    shared.cuda = True
    shared.order = lambda: ordered.append("ordered")
    shared.mark = lambda moved=False: ordered.append("marked")
    with runtime.capturing(whole=False):
        assert ordered == ["ordered"]
    with runtime.capturing(whole=True):
        assert ordered == ["ordered", "ordered"]
    assert ordered[-1] == "marked"
    ordered.clear()
    g(x)
    assert ordered == ["ordered", "marked"]  # and every replay
