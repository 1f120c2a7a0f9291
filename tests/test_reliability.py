"""Reliability: random differential testing of every mode against eager, faults during
capture and eager fallback, concurrent callers, and leaks over many calls.

`GRAPHIFY_DIFF_CALLS` sets the random calls per mode (CI default 40; the device run uses
10,000)."""

from __future__ import annotations

import gc
import os
import random
import threading
import tracemalloc

import pytest
import torch

from conftest import calls_by_mode, counted, expected_calls
from graphify import Options, CaptureError, Mode, Pool, graphify, persistent, sglang_piecewise_sizes, tokens
from graphify.models import BatchLayout, DecoderConfig, init_params, model_support, new_paged_cache, split_ops, varlen_axes, varlen_step
from graphify.transforms import split

CALLS = int(os.environ.get("GRAPHIFY_DIFF_CALLS", "40"))
MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
CFG = DecoderConfig.tiny(max_seq_len=128, layers=1)
MAX_SIZE = 32  # captured sizes go up to here; random batches go above it


def random_layout(rnd: random.Random) -> BatchLayout:
    """A random batch: decodes, prefills, chunked prefills and spec-decode requests mixed,
    sometimes all decodes (a uniform batch), up to 40 tokens (above the largest size)."""
    r = rnd.randint(1, 8)
    if rnd.random() < 0.3:
        return BatchLayout((1,) * r, tuple(rnd.randint(1, 60) for _ in range(r)), 16, 8)
    q, c = [], []
    for _ in range(r):
        kind = rnd.choice(("decode", "prefill", "chunk", "spec"))
        q.append({"decode": 1, "prefill": rnd.randint(1, 12), "chunk": rnd.randint(1, 12), "spec": 3}[kind])
        c.append(0 if kind == "prefill" else rnd.randint(1, 60))
    return BatchLayout(tuple(q), tuple(c), 16, 8)


@pytest.mark.parametrize("mode", MODES)
def test_random_calls_match_eager_in_every_mode(backend, mode):
    name, device = backend
    step = varlen_step(CFG, init_params(CFG, seed=0, device=device), "unified")
    cache = new_paged_cache(CFG, 80, 16, device=device, seed=1)
    example = BatchLayout((3, 1, 5), (4, 7, 0), 16, 8).build(CFG, device=device)
    fn = split(step, split_ops("unified"), *example, cache, axes=varlen_axes())
    g = graphify(fn, mode=mode, sizes=sglang_piecewise_sizes(MAX_SIZE), axes=varlen_axes(), support=model_support("unified"), options=Options(backend=name))
    if mode != "NONE":
        g = g.capture(*example, cache)
    ref_cache = cache.clone()
    rnd = random.Random(f"{mode}-{name}")
    worst, mismatches, seen = 0.0, 0, []
    with torch.inference_mode():
        for i in range(CALLS):
            layout = random_layout(rnd)
            seen.append((sum(layout.query_lens), all(q == 1 for q in layout.query_lens)))  # (tokens, uniform decode)
            batch = layout.build(CFG, device=device, seed=i)
            got, want = g(*batch, cache), step(*batch, ref_cache)
            err = (got - want).abs().max().item()
            worst = max(worst, err)
            mismatches += not (got.shape == want.shape and err <= 1e-4 * (1 + want.abs().max().item()))
    assert mismatches == 0, f"{mismatches} of {CALLS} calls differ from eager (worst {worst:.3g})"
    # the KV writes agree too (block 0 is scratch: padded rows write there, eager runs do not)
    torch.testing.assert_close(cache[:, :, 1:], ref_cache[:, :, 1:], rtol=1e-4, atol=1e-4)
    # what each call ran as, as vLLM would dispatch it: an always-eager graphify fails here
    assert calls_by_mode(g) == expected_calls(g.resolution.mode, seen, MAX_SIZE)


def mlp(x, w):
    return torch.tanh(x @ w) * 2


def captured(backend, sizes=(4, 8, 16), **kw):
    name, device = backend
    w = torch.randn(16, 16, device=device)
    g = graphify(mlp, mode="FULL", sizes=sizes, axes=(tokens(), persistent()), options=Options(backend=name), **kw)
    return g.capture(torch.randn(4, 16, device=device), w), w


def test_exception_in_eager_fallback_propagates_and_the_callable_keeps_working(backend):
    name, device = backend

    def picky(x, w):
        if x.shape[0] == 20:
            raise ValueError("twenty rows are not allowed")
        return mlp(x, w)

    w = torch.randn(16, 16, device=device)
    g = graphify(picky, mode="FULL", sizes=(4, 8), axes=(tokens(), persistent()), options=Options(backend=name))
    g = g.capture(torch.randn(4, 16, device=device), w)
    with pytest.raises(ValueError, match="twenty rows"):
        g(torch.randn(20, 16, device=device), w)  # above the largest size: eager, the user's error as is
    x = torch.randn(6, 16, device=device)
    torch.testing.assert_close(g(x, w), mlp(x, w))
    assert calls_by_mode(g)[Mode.FULL] == 1  # the call after the error replayed its graph


def test_out_of_memory_during_capture_says_what_to_do_and_leaks_nothing(backend):
    name, device = backend

    def hungry(x, w):
        if x.shape[0] >= 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")
        return mlp(x, w)

    pool = Pool("squeezed")
    w = torch.randn(16, 16, device=device)
    g = graphify(hungry, mode="FULL", sizes=(4, 8, 16), axes=(tokens(), persistent()), pool=pool, options=Options(backend=name))
    with pytest.raises(CaptureError) as info:
        g.capture(torch.randn(4, 16, device=device), w)
    msg = str(info.value)
    assert "graphify(hungry" in msg and "(tokens=16)" in msg
    assert "fewer sizes or a smaller maximum" in msg and "still works" in msg
    assert pool.report().per_graph == ()  # nothing captured is kept
    x = torch.randn(5, 16, device=device)
    torch.testing.assert_close(g(x, w), mlp(x, w))  # the uncaptured callable still runs
    assert calls_by_mode(g) == counted(none=1)  # eagerly: a first call of a structure is its warm-up
    smaller = graphify(hungry, mode="FULL", sizes=(4, 8), axes=(tokens(), persistent()), pool=pool, options=Options(backend=name)).capture(x, w)  # the advice works
    torch.testing.assert_close(smaller(x, w), mlp(x, w))
    assert calls_by_mode(smaller) == counted(full=1)


def test_concurrent_callers_never_see_each_others_outputs(backend):
    """Copies (the default) are safe across threads. Views are not: a thread's read can race
    another thread's replay inside one op (seen on the H100), which is why views are
    documented for single-threaded callers."""
    name, device = backend
    g, w = captured(backend)
    wrong, ok = [], []

    def worker(seed: int):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(40):
            x = torch.randn(int(torch.randint(1, 17, (1,), generator=gen)), 16, generator=gen).to(device)
            out = g(x, w)
            (ok if torch.allclose(out, mlp(x, w), rtol=1e-5, atol=1e-5) else wrong).append(seed)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, f"{len(wrong)} calls returned another caller's result"
    assert len(ok) == 160
    assert calls_by_mode(g) == counted(full=160)  # every call replayed (1 to 16 rows, all captured sizes)


def test_no_host_or_device_memory_grows_over_many_calls_or_stays_after_drop(backend):
    name, device = backend
    xs = [torch.randn(n, 16, device=device) for n in range(1, 21)]
    gc.collect()
    tracemalloc.start()
    start_host = tracemalloc.get_traced_memory()[0]
    g, w = captured(backend, sizes=(1, 2, 4, 8, 16))
    for x in xs:  # every plan built once
        g(x, w)
    gc.collect()
    before_host = tracemalloc.get_traced_memory()[0]
    before_dev = torch.cuda.memory_allocated() if name == "cuda" else 0
    for i in range(10_000):
        g(xs[i % len(xs)], w)
    gc.collect()
    grown_host = tracemalloc.get_traced_memory()[0] - before_host
    if name == "cuda":
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before_dev <= 1 << 20
    assert grown_host <= 1 << 20, f"host memory grew {grown_host} bytes over 10,000 calls"
    del g, w
    gc.collect()
    left = tracemalloc.get_traced_memory()[0] - start_host
    tracemalloc.stop()
    assert left <= 1 << 20, f"{left} bytes of host memory stayed after the callable was dropped"


def test_a_kept_capture_error_pins_no_static_buffer():
    """pytest.raises, a log or a retry loop may keep the error: its traceback must not keep
    the static buffers (or, on CUDA, their memory) alive."""
    import gc
    import weakref

    from graphify.backends import sim

    made = []
    real_empty = sim.SimBackend.empty

    def empty(self, shape, dtype, device):
        t = real_empty(self, shape, dtype, device)
        made.append(weakref.ref(t))
        return t

    def wide(x, w):
        if x.shape[0] == 64:
            raise torch.OutOfMemoryError("simulated")
        return x @ w

    sim.SimBackend.empty = empty
    try:
        with pytest.raises(CaptureError) as info:
            graphify(wide, mode="FULL", sizes=(8, 64), axes=(tokens(), persistent()), options=Options(backend="sim")).capture(
                torch.randn(4, 8), torch.randn(8, 8)
            )
    finally:
        sim.SimBackend.empty = real_empty
    gc.collect()
    assert made and info.value is not None
    assert not [r for r in made if r() is not None]


def test_a_process_that_froze_its_objects_keeps_them_frozen_through_captures():
    """A server freezes what it made at start-up so collections stay cheap; a capture holds
    the GC still without thawing them (gc.unfreeze() would). (The suite freezes what its
    collection imported: tests/conftest.py.)"""
    already = gc.get_freeze_count() > 0
    if not already:
        gc.collect()
        gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        g = graphify(lambda x: torch.tanh(x) * 2, mode="FULL", sizes=(2, 4), axes=(tokens(),),
                     options=Options(backend="sim"))
        g.capture(torch.randn(4, 8))
        x = torch.randn(3, 8)
        torch.testing.assert_close(g(x), torch.tanh(x) * 2)
        assert gc.get_freeze_count() > frozen // 2  # not thawed (objects freed since leave the count)
        assert gc.isenabled()
    finally:
        if not already:
            gc.unfreeze()


def test_a_pool_that_outlived_its_graphs_captures_again(backend):
    """torch frees a graph pool once its last graph is gone and fails an internal assert on a
    capture into it before its next empty_cache (leaving the RNG in capture mode for every
    later capture); such a capture takes a fresh pool id (graphify.backends.graph_pool). The
    simulation refuses that capture as torch does."""
    name, device = backend
    pool = Pool("outlived")
    for _ in range(3):  # captured, released, captured again into the same Pool
        g = graphify(lambda x: torch.tanh(x) * 2, mode="FULL", sizes=(2, 4), axes=(tokens(),), pool=pool,
                     options=Options(backend=name)).capture(torch.randn(4, 8, device=device))
        x = torch.randn(3, 8, device=device)
        torch.testing.assert_close(g(x), torch.tanh(x) * 2)
        assert calls_by_mode(g)[Mode.FULL] == 1
        g.release()
        del g
        gc.collect()
    kept = graphify(lambda x: x + 1, mode="FULL", sizes=(4,), axes=(tokens(),), pool=pool,
                    options=Options(backend=name)).capture(torch.randn(4, 8, device=device))
    first = pool._handle.id
    also = graphify(lambda x: x * 3, mode="FULL", sizes=(4,), axes=(tokens(),), pool=pool,
                    options=Options(backend=name)).capture(torch.randn(4, 8, device=device))
    assert pool._handle.id == first  # while a graph lives, the pool's graphs share one id (and memory)
    x = torch.randn(4, 8, device=device)
    torch.testing.assert_close(kept(x), x + 1)
    torch.testing.assert_close(also(x), x * 3)
