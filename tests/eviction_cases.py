"""Library objects evicted or freed while graphs that launch them live; run as
`python tests/eviction_cases.py NAME` in a process of its own (before graphify kept them
alive, these crashed the process: a segfault must fail one test, not the suite).

Prints `SURVIVED` when every graph still equals eager after the eviction. With
`GRAPHIFY_NO_KEEPALIVE=1` graphify's protection is switched off (a control run: it shows
the case provokes what it claims to)."""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from graphify import graphify, tokens


def _no_keepalive() -> None:
    import graphify.backends.keepalive as keepalive
    import graphify.capture.session as session
    import graphify.backends.torch_cuda as torch_cuda

    @contextlib.contextmanager
    def nothing(hold, device, uses_fft=False):
        yield hold

    session.holding = nothing
    torch_cuda.clear_cublas_workspaces = lambda: None
    keepalive.clear_cublas_workspaces = lambda: None


def check(got, want, what: str) -> None:
    if hasattr(got, "get"):  # CuPy
        got, want = torch.as_tensor(got.get()), torch.as_tensor(want.get())
    if not torch.allclose(got.float().cpu(), want.float().cpu(), rtol=1e-3, atol=1e-3):
        print(f"MISMATCH {what}: max err {(got.float() - want.float()).abs().max().item():.3g}", flush=True)
        sys.exit(3)


def ran(g, *, full: int, none: int) -> None:
    """What `g`'s calls ran as: `full` replays and `none` eager calls, or the case fails."""
    got = {r.mode.value: r.calls for r in g.stats.by_mode()}
    if got != {"NONE": none, "PIECEWISE": 0, "FULL": full}:
        print(f"RAN {got}, not {full} FULL and {none} NONE", flush=True)
        sys.exit(5)


def cupy_fft_evicted() -> None:
    """The issue's CuPy case: sizes above the largest run eagerly, their plans evict the
    graphs' plans from CuPy's 16-plan cache, then a graph replays."""
    import cupy as cp

    fn = lambda x: cp.abs(cp.fft.rfft(x, axis=-1))  # noqa: E731
    g = graphify(fn, mode="FULL", sizes=[1, 2, 4, 8, 16, 32, 64], axes=(tokens(),))
    g = g.capture(cp.random.standard_normal((8, 256), dtype=cp.float32))
    for n in range(65, 90):
        x = cp.random.standard_normal((n, 256), dtype=cp.float32)
        check(g(x), fn(x), f"eager {n}")
    for n in (1, 2, 3, 5, 8, 16, 33, 64):
        x = cp.random.standard_normal((n, 256), dtype=cp.float32)
        check(g(x), fn(x), f"replay {n}")
    cp.fft.config.get_plan_cache().clear()
    x = cp.random.standard_normal((4, 256), dtype=cp.float32)
    check(g(x), fn(x), "after clear()")
    ran(g, full=8 + 1, none=25)  # 65 to 89 rows eagerly; the rest replayed, after the evictions too


def torch_fft_evicted(first_use: bool = False) -> None:
    """The issue's torch case: a 2-plan cache, sizes above the largest run eagerly, then a
    graph replays; also max_size and clear() while the graphs live, and after release()."""
    cache = torch.backends.cuda.cufft_plan_cache[0]
    cache.max_size = 2
    fn = lambda x: torch.fft.rfft(x, dim=-1).abs()  # noqa: E731
    g = graphify(fn, mode="FULL", sizes=range(1, 9))
    if first_use:
        for n in range(1, 9):  # each size captured by the call that first needs it
            x = torch.randn(n, 256, device="cuda")
            g(x), check(g(x), fn(x), f"first use {n}")
    else:
        g = g.capture(torch.randn(8, 256, device="cuda"))
    for n in range(9, 20):
        x = torch.randn(n, 256, device="cuda")
        check(g(x), fn(x), f"eager {n}")
    cache.max_size = 1  # remembered while the graphs live
    cache.clear()  # skipped while the graphs live
    for n in range(1, 20):
        x = torch.randn(n, 256, device="cuda")
        check(g(x), fn(x), f"replay {n}")
    # above 8 rows eagerly (twice 11 sizes); captured ahead of time, 1 to 8 rows replay; on first
    # use, each size is captured by its first call and replayed from then on, but for the very
    # first call (the warm-up of the call structure)
    ran(g, full=(15 if first_use else 0) + 8, none=(1 if first_use else 0) + 2 * 11)
    g.release()
    assert cache.max_size == 1, cache.max_size  # the user's last word, applied once released
    print("PINNED-THEN-RESTORED", flush=True)


def cublas_workspace_cleared() -> None:
    """torch.compile's CUDA graph trees clear cuBLAS workspaces around every recording; a
    graph's workspace must not go back to eager code (matrix products with a long inner
    dimension use split-K, which writes the workspace)."""
    w = torch.randn(8192, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(64, 8192, device="cuda", dtype=torch.bfloat16)

    def fn(x):
        return (x @ w) @ v

    g = graphify(fn, mode="FULL", sizes=[8, 16, 32]).capture(torch.randn(16, 8192, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # what reduce-overhead does at each recording
    # The caching allocator hands a freed block only to allocations on the stream that freed
    # it: the workspace belonged to graphify's capture stream, so allocate there (any eager
    # work on that stream, graphify's own warm-ups of another table included, would).
    from graphify.backends.torch_cuda import TorchCudaBackend

    with torch.cuda.stream(TorchCudaBackend().new_stream(torch.device("cuda", 0))):
        fillers = [torch.full((1 << 20,), float(i), device="cuda") for i in range(64)]  # 4 MiB each
    torch.cuda.synchronize()
    for _ in range(5):
        for n in (5, 8, 16, 32):
            x = torch.randn(n, 8192, device="cuda", dtype=torch.bfloat16)
            check(g(x), fn(x), f"replay {n}")
    torch.cuda.synchronize()
    ran(g, full=5 * 4, none=0)
    for i, f in enumerate(fillers):
        if not bool((f == float(i)).all()):
            print(f"CORRUPTED filler {i}: a replay wrote into memory eager code owns", flush=True)
            sys.exit(4)


CASES = {
    "cupy-fft-evicted": cupy_fft_evicted,
    "torch-fft-evicted": torch_fft_evicted,
    "torch-fft-evicted-first-use": lambda: torch_fft_evicted(first_use=True),
    "cublas-workspace-cleared": cublas_workspace_cleared,
}

if __name__ == "__main__":
    if os.environ.get("GRAPHIFY_NO_KEEPALIVE") == "1":
        _no_keepalive()
    CASES[sys.argv[1]]()
    torch.cuda.synchronize()
    print("SURVIVED", flush=True)
