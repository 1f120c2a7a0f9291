"""Warm-ups allocate from the graph's pool (`graphify.backends.pool_routing`).

On the CPU: the routing protocol against a model of torch's allocator bookkeeping, with its
asserts (a pool's use count, one routing per pool, the first matching routing wins). On
CUDA: a warm-up's memory is the pool's, not a cache beside it, and a graphified function
called inside another's warm-up captures into its own pool, both equal to eager."""

import gc
import types

import pytest
import torch

from conftest import replayed, requires_cuda
from graphify import Options, graphify
from graphify.backends import pool_routing


class Allocator:
    """torch's CUDACachingAllocator bookkeeping for private pools, asserts included:
    `begin` counts a use (creating the pool, or asserting a live one), refuses a second
    routing of one pool; `end` stops routing; `release` gives a use back (at zero the pool
    is releasable, and counting a use of it again asserts). An allocation goes to the
    first routing in the list."""

    def __init__(self):
        self.uses: dict = {}
        self.routing: list = []
        self.releasable: set = set()

    def begin(self, device, pool):
        if pool in self.uses:
            assert self.uses[pool] > 0, f"use_count > 0 failed for {pool}"
        self.uses[pool] = self.uses.get(pool, 0) + 1
        assert pool not in self.routing, "beginAllocateToPool: already recording to mempool_id"
        self.routing.append(pool)

    def end(self, device, pool):
        assert pool in self.routing, "endAllocatePool: not currently recording to mempool_id"
        self.routing.remove(pool)

    def release(self, device, pool):
        self.uses[pool] -= 1
        assert self.uses[pool] >= 0
        if self.uses[pool] == 0:
            self.releasable.add(pool)

    def allocates_to(self):
        return self.routing[0] if self.routing else None


@pytest.fixture
def allocator(monkeypatch):
    a = Allocator()
    monkeypatch.setattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", a.begin, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", a.end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", a.release, raising=False)
    return a


def capture_begin(a, pool):  # what CUDAGraph.capture_begin and capture_end do to the allocator
    a.begin(0, pool)


def test_a_warm_up_routes_to_its_pool_and_the_pool_stays_held_until_the_graph_holds_it(allocator):
    routing = pool_routing.Routing(0, (1, 0))
    assert allocator.allocates_to() is None and allocator.uses[(1, 0)] == 1
    with routing.warm_ups():
        assert allocator.allocates_to() == (1, 0)
        assert pool_routing.routed_pools() == ((0, (1, 0)),)
    assert allocator.allocates_to() is None and allocator.uses[(1, 0)] == 1  # between warm-up and capture: held
    capture_begin(allocator, (1, 0))
    allocator.end(0, (1, 0))
    routing.release()
    routing.release()  # idempotent
    assert allocator.uses[(1, 0)] == 1 and not allocator.releasable  # the graph's own use
    assert pool_routing.routed_pools() == ()


def test_a_failed_warm_up_leaves_its_pool_releasable_and_nothing_routed(allocator):
    routing = pool_routing.Routing(0, (2, 0))
    with pytest.raises(RuntimeError, match="host read"):
        with routing.warm_ups():
            raise RuntimeError("host read")
    routing.release()
    assert allocator.routing == [] and allocator.releasable == {(2, 0)}
    with pytest.raises(AssertionError, match="use_count"):  # why a failed pool's id is never captured into again
        pool_routing.Routing(0, (2, 0))


def test_a_capture_inside_another_warm_up_allocates_to_its_own_pool_and_the_outer_resumes(allocator):
    outer = pool_routing.Routing(0, (1, 0))
    with outer.warm_ups():
        with pool_routing.outside():
            assert allocator.allocates_to() is None and pool_routing.routed_pools() == ()
            inner = pool_routing.Routing(0, (3, 0))
            with inner.warm_ups():
                assert allocator.allocates_to() == (3, 0)  # not the outer pool, which would match first
            capture_begin(allocator, (3, 0))
            assert allocator.allocates_to() == (3, 0)
            allocator.end(0, (3, 0))
            inner.release()
        assert allocator.allocates_to() == (1, 0)  # the outer warm-up goes on routing to its pool
        assert pool_routing.routed_pools() == ((0, (1, 0)),)
    assert allocator.uses == {(1, 0): 1, (3, 0): 1}  # each held once: the outer by its routing, the inner by its graph
    outer.release()
    assert allocator.releasable == {(1, 0)}


def test_a_capture_sharing_the_outer_pool_inside_its_warm_up_is_not_refused(allocator):
    outer = pool_routing.Routing(0, (1, 0))
    with outer.warm_ups():
        with pool_routing.outside():  # an explicit Pool shared by both callables
            inner = pool_routing.Routing(0, (1, 0))
            with inner.warm_ups():
                assert allocator.allocates_to() == (1, 0)
            inner.release()
        assert allocator.allocates_to() == (1, 0)
    outer.release()
    assert allocator.uses[(1, 0)] == 0


def test_warm_ups_route_to_their_pool_only_where_no_graph_of_it_is_live(allocator):
    """A pool's second capture (a graph of it alive) warms up in the default pool: no routing
    made, none held, and the capture goes on the same way (the backend calls both methods)."""
    assert not pool_routing.routes(warmups=2, live=1)
    routing = pool_routing.NoRouting()
    with routing.warm_ups():
        assert allocator.allocates_to() is None and pool_routing.routed_pools() == ()
    routing.release()
    assert allocator.uses == {} and allocator.routing == []
    assert not pool_routing.routes(warmups=0, live=0)
    assert pool_routing.routes(warmups=2, live=0)
    first = pool_routing.Routing(0, (5, 0))
    with first.warm_ups():
        assert allocator.allocates_to() == (5, 0)
    first.release()
    assert allocator.releasable == {(5, 0)}


def test_the_cuda_backends_second_capture_into_a_pool_warms_up_unrouted(allocator, monkeypatch):
    """`TorchCudaBackend`'s warm-up and capture step with a live graph in the pool, every CUDA
    call stubbed: the warm-ups run unrouted and the capture follows (the step once failed here
    on a GPU only, with no routing to enter)."""
    import contextlib

    from graphify.backends import torch_cuda

    class Pool:
        live = 1
        window = contextlib.nullcontext

        @contextlib.contextmanager
        def capturing(self):
            yield (6, 0)

    class Stream:
        def synchronize(self):
            pass

    ran = []
    backend = torch_cuda.TorchCudaBackend.__new__(torch_cuda.TorchCudaBackend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch_cuda, "cupy_follows_torch", lambda s, d: contextlib.nullcontext())
    monkeypatch.setattr(torch_cuda, "eager_runs", lambda fn, args, **kw: ran.append(allocator.allocates_to()))
    monkeypatch.setattr(backend, "usage", lambda pool: (0, 0), raising=False)
    monkeypatch.setattr(backend, "_capture", lambda *a: "captured", raising=False)
    assert backend._warm_and_capture(None, (), Pool(), 2, False, Stream(), (True, None)) == "captured"
    assert ran == [None] and allocator.uses == {}
    Pool.live = 0
    assert backend._warm_and_capture(None, (), Pool(), 2, False, Stream(), (True, None)) == "captured"
    assert ran == [None, (6, 0)] and allocator.releasable == {(6, 0)}  # routed, then given back


def test_outside_any_warm_up_nothing_changes(allocator):
    with pool_routing.outside():
        assert allocator.routing == []
    assert allocator.uses == {}


# -- CUDA ----------------------------------------------------------------------------------

MiB = 1 << 20


def wide_then_narrow(x, w1, w2):
    """Intermediates (64 MiB at 512 rows) far larger than the output: a warm-up's peak."""
    return torch.relu(x @ w1) @ w2


def in_pools() -> int:
    """Reserved bytes of the caching allocator's segments in private (graph) pools."""
    return sum(s["total_size"] for s in torch.cuda.memory._snapshot()["segments"]
               if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))


def capture_stream_cache() -> int:
    """Reserved bytes of the capture stream's segments in no private pool: where a warm-up's
    freed blocks stayed cached when warm-ups allocated from the default pool."""
    from graphify.backends.torch_cuda import TorchCudaBackend

    stream = TorchCudaBackend().new_stream(torch.device("cuda", torch.cuda.current_device())).cuda_stream
    return sum(s["total_size"] for s in torch.cuda.memory._snapshot()["segments"]
               if s["stream"] == stream and tuple(s.get("segment_pool_id", (0, 0))) == (0, 0))


@pytest.mark.cuda
@requires_cuda
def test_a_warm_up_leaves_no_cache_beside_the_graph_pool():
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(256, 32768, device="cuda", generator=gen)
    w2 = torch.randn(32768, 64, device="cuda", generator=gen)
    graphify(wide_then_narrow)(torch.randn(8, 256, device="cuda", generator=gen), w1, w2)  # the capture stream's own set-up
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before, pooled = capture_stream_cache(), in_pools()
    g = graphify(wide_then_narrow)
    for i in range(4):  # captured on first use, then replayed, each on fresh inputs equal to eager
        x = torch.randn(512, 256, device="cuda", generator=gen)  # within first use's largest key
        torch.testing.assert_close(g(x, w1, w2), wide_then_narrow(x, w1, w2), rtol=1e-3, atol=5e-2)
    torch.cuda.synchronize()
    grown = capture_stream_cache() - before
    assert grown <= 2 * MiB, f"{grown / MiB:.1f} MiB cached on the capture stream beside the graph pool"
    assert in_pools() - pooled >= 512 * 32768 * 4  # the intermediate lives in the graph's pool
    assert replayed(g) >= 3


def inner_fn(x, w):
    return torch.tanh(x @ w) + 1


@pytest.mark.cuda
@requires_cuda
def test_a_graphified_function_first_called_inside_another_warm_up_equals_eager():
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(128, 128, device="cuda", generator=gen)
    inner = graphify(inner_fn)

    def outer_fn(x):
        return inner(x * 2, w).sum(-1) + x.mean(-1)

    outer = graphify(outer_fn, options=Options(backend="cuda"))
    for n in (16, 16, 32, 16):
        x = torch.randn(n, 128, device="cuda", generator=gen)
        want = (inner_fn(x * 2, w)).sum(-1) + x.mean(-1)
        torch.testing.assert_close(outer(x), want, rtol=1e-3, atol=1e-3)
    assert replayed(outer) >= 1


class KeepsPerSize(torch.nn.Module):
    """Makes a tensor the second time it meets a batch size and keeps it (a lazily built table,
    a cache's buffer). Under first use the second call of a size is its warm-up: the tensor,
    made there, must not sit in a block another graph of the pool replays into."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.seen, self.kept = width, {}, {}

    def forward(self, x):
        n = x.shape[0]
        if self.seen.get(n, 0) < 2:
            self.seen[n] = self.seen.get(n, 0) + 1
        if self.seen[n] == 2 and n not in self.kept:
            self.kept[n] = torch.arange(n * self.width, device=x.device, dtype=x.dtype).reshape(n, self.width) / 7
        table = self.kept[n] if n in self.kept else self.table(n, x)
        return torch.relu(x * 3 - 1).exp() + table

    def table(self, n, x):
        return torch.arange(n * self.width, device=x.device, dtype=x.dtype).reshape(n, self.width) / 7


@pytest.mark.cuda
@requires_cuda
def test_a_tensor_a_warm_up_keeps_is_never_in_memory_another_graph_of_the_pool_replays_into():
    gen = torch.Generator(device="cuda").manual_seed(2)
    model = KeepsPerSize(8192)  # 2 MiB intermediates at 64 rows: blocks of the large pool
    g = graphify(model, options=Options(backend="cuda"))
    with torch.no_grad():
        # a size's second call warms up (and makes its table), the third captures; then each
        # size's graph replays between the other's
        for n in (64, 64, 64, 128, 128, 128, 64, 128, 64, 128):
            x = torch.randn(n, 8192, device="cuda", generator=gen)
            table = torch.arange(n * 8192, device="cuda", dtype=x.dtype).reshape(n, 8192) / 7
            torch.testing.assert_close(g(x), torch.relu(x * 3 - 1).exp() + table, rtol=1e-5, atol=1e-5)
    assert replayed(g) >= 4
    kept = {n: t.clone() for n, t in model.kept.items()}
    g(torch.randn(64, 8192, device="cuda", generator=gen))
    torch.cuda.synchronize()
    for n, t in model.kept.items():
        assert torch.equal(t, kept[n]), f"the tensor kept for batch {n} was overwritten by a replay"


class Benchmarker:
    """inductor's benchmarker as its callers use it: `benchmark` ends in `benchmark_gpu`, where
    its buffers are made; each notes where the allocator routes at that moment."""

    def __init__(self, allocator):
        self.allocator, self.seen = allocator, []

    def benchmark(self, fn, **kwargs):
        self.seen.append(("benchmark", self.allocator.allocates_to()))
        return self.benchmark_gpu(fn, **kwargs)

    def benchmark_gpu(self, fn, **kwargs):
        self.seen.append(("benchmark_gpu", self.allocator.allocates_to()))
        return fn()


def test_kernel_tuning_inside_a_warm_up_allocates_outside_the_graph_pool(allocator):
    """The compile line's first warm-up tunes Triton kernels; the benchmarker's flush buffer
    and argument clones must not become segments of the graph's pool for its whole life."""
    from graphify.compile.tuning_memory import tune_outside_pools

    bench = Benchmarker(allocator)
    tune_outside_pools(bench)
    tune_outside_pools(bench)  # idempotent: wrapped once
    assert not getattr(bench.benchmark_gpu.__wrapped__, "graphify_outside", False)
    routing = pool_routing.Routing(0, (1, 0))
    with routing.warm_ups():
        assert bench.benchmark(allocator.allocates_to) is None  # the timed kernel's own memory too
        assert allocator.allocates_to() == (1, 0)  # the warm-up goes on routing to its pool
        assert pool_routing.routed_pools() == ((0, (1, 0)),)
    routing.release()
    assert bench.seen == [("benchmark", None), ("benchmark_gpu", None)]
    assert allocator.uses == {(1, 0): 0} and allocator.routing == []


def test_a_compile_inside_a_warm_up_allocates_outside_the_graph_pool_and_inductors_tuning_is_wrapped(allocator):
    from torch._inductor.runtime import benchmarking

    from graphify.compile.compiled import KeptCompiles

    kept = KeptCompiles()
    assert benchmarking.benchmarker.benchmark_gpu.graphify_outside  # made an inductor backend: tuning wrapped
    seen = []

    def inner(gm, example_inputs):  # what inductor's compile allocates (frozen constants, max-autotune's inputs)
        seen.append(allocator.allocates_to())
        return gm.forward

    kept.inner = inner
    gm = torch.fx.symbolic_trace(lambda x: x * 2 + 1)
    routing = pool_routing.Routing(0, (1, 0))
    with routing.warm_ups():
        compiled = kept(gm, [torch.randn(3)])
        assert allocator.allocates_to() == (1, 0)
    routing.release()
    x = torch.randn(5)
    assert seen == [None] and torch.equal(compiled(x), x * 2 + 1)


def test_compiled_code_loaded_from_a_file_has_its_kernel_tuning_wrapped_before_it_runs(monkeypatch):
    """The background line's caller loads the worker's saved code, whose first run may tune kernels
    inside a warm-up: the benchmarker is wrapped before anything is loaded."""
    from graphify.compile import aot

    calls = []
    monkeypatch.setattr(aot, "tune_outside_pools", lambda: calls.append("wrapped"))
    with pytest.raises(Exception):  # not a saved function (pickle's error on torch 2.11 and 2.13)
        aot.load("unused", b"not a saved function")
    assert calls == ["wrapped"]


@pytest.mark.cuda
@requires_cuda
def test_inductors_kernel_timing_in_a_warm_up_leaves_no_segment_in_the_graph_pool():
    """On the GPU, against torch's allocator: inductor's own benchmarker, called inside a routed
    warm-up, puts its L2-sized flush buffer in the pool unless wrapped (the control), and
    nothing there once wrapped."""
    from torch._inductor.runtime import benchmarking

    from graphify.backends.torch_cuda import TorchCudaBackend
    from graphify.compile.tuning_memory import tune_outside_pools

    tune_outside_pools()
    bench = benchmarking.benchmarker
    x = torch.randn(1 << 20, device="cuda")
    grown = {}
    for name, method in (("unwrapped", type(bench).benchmark_gpu.__get__(bench)), ("wrapped", bench.benchmark_gpu)):
        pool_id = torch.cuda.graph_pool_handle()
        routing = pool_routing.Routing(torch.cuda.current_device(), pool_id)
        try:
            with routing.warm_ups():
                assert method(lambda: x * 2) > 0
            torch.cuda.synchronize()
            grown[name] = TorchCudaBackend().usage(types.SimpleNamespace(id=pool_id))[0]  # the pool's reserved bytes
        finally:
            routing.release()
    torch.cuda.empty_cache()
    assert grown["unwrapped"] >= 16 * MiB, grown  # the control: the flush buffer lands in a routed pool
    assert grown["wrapped"] == 0, grown
