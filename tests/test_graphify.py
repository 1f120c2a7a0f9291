"""Behaviour of graphify(fn, mode=FULL ...), run on every backend: the CPU simulation
everywhere, real CUDA graphs where a GPU exists. Every graph path is compared with eager
execution on fresh random inputs."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from conftest import calls_by_mode, counted
from graphify import (
    Options,
    CaptureError,
    Mode,
    PersistentSwapError,
    Pool,
    Support,
    graphify,
    persistent,
    reqs,
    tokens,
)

SIZES = (1, 2, 4, 8, 16)


def mlp(x, w1, w2):
    return F.gelu(x @ w1) @ w2


def weights(device, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, 64, generator=g).to(device), torch.randn(64, d, generator=g).to(device)


# A padded batch runs the matrix products at the padded row count, where CPU BLAS may block
# the sum differently: real rows agree to rounding, not bit for bit (5 rows padded to 8 gave
# 1.7e-5 once). Captured sizes are compared exactly.
PADDED_TOL = dict(rtol=1e-4, atol=1e-4)


def captured_mlp(backend, *, sizes=SIZES, pool=None, **options):
    name, device = backend
    w1, w2 = weights(device)
    g = graphify(mlp, mode="FULL", sizes=sizes, axes=(tokens(), persistent(), persistent()),
                 pool=pool, options=Options(backend=name, **options))
    return g.capture(torch.randn(3, 32, device=device), w1, w2), w1, w2


def test_replay_is_bit_exact_with_eager_at_captured_sizes(backend):
    g, w1, w2 = captured_mlp(backend)
    for n in SIZES:
        x = torch.randn(n, 32, device=backend[1])
        assert torch.equal(g(x, w1, w2), mlp(x, w1, w2))
    assert calls_by_mode(g) == counted(full=len(SIZES))


def test_between_sizes_pads_then_cuts_back(backend):
    g, w1, w2 = captured_mlp(backend)
    for n in (3, 5, 7, 9, 15):
        x = torch.randn(n, 32, device=backend[1])
        out = g(x, w1, w2)
        assert out.shape == (n, 32)
        torch.testing.assert_close(out, mlp(x, w1, w2), rtol=1e-4, atol=1e-4)
    padded = {r.padded_to for r in g.stats.rows()}
    assert padded == {4, 8, 16}
    assert calls_by_mode(g) == counted(full=5)


def test_padded_rows_never_change_real_rows(backend):
    g, w1, w2 = captured_mlp(backend, sizes=(8,))
    x = torch.randn(5, 32, device=backend[1])
    first = g(x, w1, w2).clone()
    g(torch.randn(8, 32, device=backend[1]) * 100, w1, w2)  # fill every row with other data
    assert torch.equal(g(x, w1, w2), first)
    assert calls_by_mode(g) == counted(full=3)


def test_batch_above_largest_size_runs_eagerly_and_is_counted(backend):
    g, w1, w2 = captured_mlp(backend)
    x = torch.randn(40, 32, device=backend[1])
    assert torch.equal(g(x, w1, w2), mlp(x, w1, w2))
    none = g.stats.by_mode()[0]
    assert none.mode is Mode.NONE and (none.calls, none.tokens) == (1, 40)
    assert calls_by_mode(g) == counted(none=1)


def test_capture_returns_a_new_callable_and_the_old_one_still_works(backend):
    name, device = backend
    w1, w2 = weights(device)
    g0 = graphify(mlp, mode="FULL", sizes=SIZES, axes=(tokens(), persistent(), persistent()), options=Options(backend=name))
    g1 = g0.capture(torch.randn(2, 32, device=device), w1, w2)
    assert g0.table is None and g1.table is not None and len(g1.table) == len(SIZES)
    x = torch.randn(4, 32, device=device)
    assert torch.equal(g0(x, w1, w2), mlp(x, w1, w2))
    assert g0.stats.by_mode()[0].calls == 1 and g1.stats.calls == 0
    assert g1.__wrapped__ is mlp and g1.__name__ == "mlp"


def test_decoder_decode_step_matches_eager_and_writes_the_same_cache(backend):
    from graphify.models import DecoderConfig, decode_step, init_params, new_kv_cache

    name, device = backend
    cfg = DecoderConfig.tiny()
    step = decode_step(cfg, init_params(cfg, seed=1, device=device))
    cache = new_kv_cache(cfg, 8, device=device, seed=2)
    g = graphify(step, mode="FULL", sizes=(1, 2, 4, 8), axes=(tokens(), tokens(), tokens(), persistent()), options=Options(backend=name))
    g = g.capture(*batch(cfg, 3, device), cache)
    for n in (1, 2, 3, 4, 6, 8):
        ids, pos, rows = batch(cfg, n, device)
        ref_cache = cache.clone()
        ref = step(ids, pos, rows, ref_cache)
        out = g(ids, pos, rows, cache)
        if n in (1, 2, 4, 8):
            assert torch.equal(out, ref)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache[:, :, 1:], ref_cache[:, :, 1:], rtol=1e-5, atol=1e-5)
    assert calls_by_mode(g) == counted(full=6)


def batch(cfg, n, device):
    ids = torch.randint(0, cfg.vocab_size, (n,), device=device)
    pos = torch.randint(1, cfg.max_seq_len, (n,), device=device)
    rows = torch.randperm(8, device=device)[:n] + 1
    return ids, pos, rows


# -- semantics ---------------------------------------------------------------------------

def test_default_outputs_survive_later_calls(backend):
    g, w1, w2 = captured_mlp(backend, sizes=(4,))
    a, b = torch.randn(4, 32, device=backend[1]), torch.randn(4, 32, device=backend[1])
    out_a = g(a, w1, w2)
    for _ in range(3):
        g(b, w1, w2)
    torch.testing.assert_close(out_a, mlp(a, w1, w2))
    assert calls_by_mode(g) == counted(full=4)


def test_view_outputs_are_never_silently_stale_on_cuda(backend):
    name, device = backend
    g, w1, w2 = captured_mlp(backend, sizes=(4,), outputs="view")
    a, b = torch.randn(4, 32, device=device), torch.randn(4, 32, device=device)
    out_a = g(a, w1, w2)
    torch.testing.assert_close(out_a, mlp(a, w1, w2))  # valid until the next call
    out_b = g(b, w1, w2)
    torch.testing.assert_close(out_b, mlp(b, w1, w2))
    assert calls_by_mode(g) == counted(full=2)
    if name == "cuda":  # torch can poison the old view's storage: reading it raises
        with pytest.raises(RuntimeError, match="overwritten by a later call"):
            out_a.sum()
    else:  # CPU builds of torch cannot poison a storage: the old view goes unchecked (documented);
        # it is the graph's one static output, as the new one is (what it reads now is not the point)
        assert out_a.data_ptr() == out_b.data_ptr()


def test_capture_is_largest_first_with_gc_frozen(backend):
    name, device = backend
    seen = []

    def spy(x):
        seen.append((x.shape[0], gc.isenabled()))
        return x + 1

    assert gc.isenabled()
    graphify(spy, mode="FULL", sizes=SIZES, options=Options(backend=name, side_effects="at_capture")).capture(
        torch.randn(2, 3, device=device))  # `seen` logs the capture's runs
    sizes = [s for s, _ in seen]
    assert sizes == sorted(sizes, reverse=True) and set(sizes) == set(SIZES)
    assert not any(enabled for _, enabled in seen) and gc.isenabled()


def test_one_pool_shared_by_two_functions(backend):
    pool = Pool("shared")
    g1, *_ = captured_mlp(backend, pool=pool)
    g2, *_ = captured_mlp(backend, pool=pool, sizes=(4, 8))
    labels = [label for label, _ in pool.report().per_graph]
    assert len(labels) == len(SIZES) + 2 and all("graphify(mlp" in s for s in labels)
    assert g1.table.pool is g2.table.pool is pool


def test_keyword_arguments_are_bound_like_the_function(backend):
    g, w1, w2 = captured_mlp(backend)
    x = torch.randn(5, 32, device=backend[1])
    torch.testing.assert_close(g(x, w2=w2, w1=w1), mlp(x, w1, w2), rtol=1e-4, atol=1e-4)
    assert calls_by_mode(g) == counted(full=1)


def test_full_decode_only_graphs_uniform_batches_and_runs_mixed_ones_eagerly(backend):
    name, device = backend

    def per_request_sum(x, lens):
        return x * 2, lens + 1

    g = graphify(per_request_sum, mode="FULL_DECODE_ONLY", sizes=(2, 4, 8), axes=(tokens(), reqs(pad=1)), options=Options(backend=name))
    assert g.resolution.mode is Mode.FULL_DECODE_ONLY
    g = g.capture(torch.randn(3, 5, device=device), torch.ones(3, dtype=torch.long, device=device))
    x, lens = torch.randn(3, 5, device=device), torch.randint(1, 9, (3,), device=device)
    out, new_lens = g(x, lens)  # 3 tokens, 3 requests: uniform decode
    assert torch.equal(out, x * 2) and torch.equal(new_lens, lens + 1) and new_lens.shape == (3,)
    out, new_lens = g(torch.randn(6, 5, device=device), lens)  # 6 tokens, 3 requests: mixed
    assert out.shape == (6, 5) and new_lens.shape == (3,)
    assert [(r.mode, r.calls) for r in g.stats.by_mode()] == [(Mode.NONE, 1), (Mode.PIECEWISE, 0), (Mode.FULL, 1)]


def test_downgrade_is_resolved_and_reported():
    g = graphify(mlp, mode="FULL", support=[Support.ALWAYS, Support.UNIFORM_SINGLE_TOKEN_DECODE])
    assert g.resolution.mode is Mode.FULL_DECODE_ONLY and "UNIFORM_SINGLE_TOKEN_DECODE" in g.resolution.reasons[0]
    assert "requested FULL" in g.summary()
    g = graphify(mlp, mode="FULL_AND_PIECEWISE")
    assert g.resolution.mode is Mode.FULL and "split(fn, ops)" in g.resolution.reasons[0]


def test_summary_and_explain(backend):
    g, *_ = captured_mlp(backend)
    assert f"{len(SIZES)} graphs on {backend[0]}" in g.summary()
    assert g.explain(5) == "num_tokens=5 -> FULL (tokens=8) (relaxed FULL graph)"
    assert "closest captured: (tokens=16)" in g.explain(100)


def test_static_inputs_skip_the_copy(backend, monkeypatch):
    g, w1, w2 = captured_mlp(backend)
    copies = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (copies.append(len(d)), real(d, s)))
    x, kept_w1, kept_w2 = g.static_inputs(8)
    assert kept_w1 is w1 and kept_w2 is w2
    data = torch.randn(8, 32, device=backend[1])
    x.copy_(data)
    assert torch.equal(g(x, w1, w2), mlp(data, w1, w2))
    assert copies == []  # the argument was the static buffer: nothing copied
    g(data.clone(), w1, w2)
    assert copies == [1]
    assert calls_by_mode(g) == counted(full=2)
    with pytest.raises(ValueError, match="largest captured size"):
        g.static_inputs(17)


def test_the_static_inputs_tuple_skips_checks_but_anything_else_is_checked(backend, monkeypatch):
    g, w1, w2 = captured_mlp(backend)
    static = g.static_inputs(5)
    checks = []
    real = g._runtime.rows_and_check
    monkeypatch.setattr(g._runtime, "rows_and_check", lambda args: (checks.append(1), real(args))[1])
    for _ in range(3):
        data = torch.randn(5, 32, device=backend[1])
        static[0].copy_(data)
        torch.testing.assert_close(g(*static), mlp(data, w1, w2), **PADDED_TOL)
    assert checks == []  # exactly the handed-out tuple: checked once, when it was made
    with pytest.raises(PersistentSwapError):
        g(static[0], w1.clone(), w2)  # another tensor in its place is checked as usual
    assert checks == [1]
    smaller = g.static_inputs(3)  # a new tuple (checked as it is made) replaces the old one
    data = torch.randn(3, 32, device=backend[1])
    smaller[0].copy_(data)
    torch.testing.assert_close(g(*smaller), mlp(data, w1, w2), **PADDED_TOL)
    assert checks == [1, 1]
    out = g(*static)  # the old tuple is checked again (5 rows), and computes on what its views hold
    torch.testing.assert_close(out, mlp(static[0].clone(), w1, w2), **PADDED_TOL)
    assert checks == [1, 1, 1]
    assert calls_by_mode(g) == counted(full=5)  # the refused call is not one


def test_padding_rows_are_restored_only_when_a_batch_shrinks(backend, monkeypatch):
    name, device = backend
    g = graphify(lambda x: x * 3, mode="FULL", sizes=(4, 8), axes=(tokens(pad=-7.0),), options=Options(backend=name))
    g = g.capture(torch.randn(2, 5, device=device))
    copies = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (copies.append(len(d)), real(d, s)))
    buf = g.table.static.buffers[0]
    for n, expected in ((7, 1), (7, 1), (3, 2), (3, 1), (4, 1), (2, 2), (2, 1)):
        x = torch.randn(n, 5, device=device)
        assert torch.equal(g(x), x * 3)
        padded = 4 if n <= 4 else 8
        assert torch.equal(buf[n:padded], torch.full_like(buf[n:padded], -7.0))
        assert copies.pop() == expected  # the input, plus padding where a larger batch left data
    x, = g.static_inputs(8)
    x.copy_(torch.randn(8, 5, device=device))
    view = x[:3]  # caller wrote 8 rows but passes 3: rows 3..4 must be padding again
    assert torch.equal(g(view), view * 3)
    assert torch.equal(buf[3:4], torch.full_like(buf[3:4], -7.0))
    assert calls_by_mode(g) == counted(full=8)


def test_random_ops_draw_fresh_numbers_on_every_replay(backend):
    name, device = backend
    g = graphify(lambda x: x + torch.rand_like(x), mode="FULL", sizes=(4,), options=Options(backend=name))
    g = g.capture(torch.randn(4, 8, device=device))
    x = torch.randn(4, 8, device=device)
    a, b = g(x).clone(), g(x).clone()
    assert not torch.equal(a, b)
    assert calls_by_mode(g) == counted(full=2)  # two replays of one graph, not two eager draws
    assert bool(((a - x) >= 0).all() and ((a - x) < 1).all())


def test_explicit_out_axes_cut_request_outputs_and_bad_ones_are_named(backend):
    name, device = backend

    def pair(x, lens):
        return x.sum(-1), lens * 2  # per token, per request

    g = graphify(pair, mode="FULL", sizes=(8,), axes=(tokens(), reqs()), options=Options(out_axes=("tokens", "reqs"), backend=name)).capture(torch.randn(5, 3, device=device), torch.ones(2, device=device))
    x, lens = torch.randn(6, 3, device=device), torch.randn(4, device=device)
    a, b = g(x, lens)
    assert torch.equal(a, x.sum(-1)) and torch.equal(b, lens * 2)
    assert calls_by_mode(g) == counted(full=1)
    with pytest.raises(CaptureError, match="out_axes has 3 entries but the function returns 2"):
        graphify(pair, mode="FULL", sizes=(8,), axes=(tokens(), reqs()), options=Options(out_axes=("tokens", "reqs", None), backend=name)).capture(torch.randn(5, 3, device=device), torch.ones(2, device=device))
    with pytest.raises(CaptureError, match="not an output axis"):
        graphify(pair, mode="FULL", sizes=(8,), axes=(tokens(), reqs()), options=Options(out_axes="rows", backend=name)).capture(torch.randn(5, 3, device=device), torch.ones(2, device=device))


def test_compiled_functions_get_an_unguarded_warmup_before_full_capture():
    calls, twin_calls = [], []

    def twin(x):
        twin_calls.append(x.shape[0])
        return x * 3

    def fn(x):
        calls.append(x.shape[0])
        return x * 3

    fn._torchdynamo_orig_callable = twin  # what torch.compile's wrapper carries
    g = graphify(fn, mode="FULL", sizes=(4,), options=Options(backend="sim", side_effects="at_capture")).capture(
        torch.randn(2, 3))  # `calls` and `twin_calls` log the capture's runs
    # the eager twin runs under the op guard, never the compiled code; the simulation then
    # tapes the twin's ops (compiled kernels are invisible to its dispatch-level tape)
    assert twin_calls == [4, 4]
    assert len(calls) == 1  # the unguarded warm-up (it compiles)
    x = torch.randn(3, 3)
    torch.testing.assert_close(g(x), x * 3)
    assert calls_by_mode(g) == counted(full=1) and twin_calls == [4, 4] and len(calls) == 1  # a replay runs neither


def test_output_alias_shares_memory_on_a_storage_of_its_own():
    from graphify.base.alias import alias as _alias
    from graphify.base.alias import alias_maker
    from graphify.base.alias import metadata as _metadata

    base = torch.randn(6, 4)
    view = base[2:5]
    make = alias_maker(view)  # what checked views use: one fresh alias per call
    first, second = make(), make()
    for alias in (_alias(view, _metadata(view)), first, second):
        assert torch.equal(alias, view) and alias.data_ptr() == view.data_ptr()
        assert alias.shape == view.shape and alias.stride() == view.stride()
        assert alias.untyped_storage() is not view.untyped_storage()
    assert first.untyped_storage() is not second.untyped_storage()
    base.add_(1)
    assert torch.equal(first, view) and torch.equal(second, view)  # same memory: they follow every write


def test_graphify_as_a_decorator_with_options():
    @graphify(mode="FULL", sizes=(2, 4), axes=(tokens(),), options=Options(backend="sim"))
    def double(x):
        return x * 2

    assert double.mode is Mode.FULL and double.sizes == (2, 4)
    x = torch.randn(3, 5)
    captured = double.capture(x)
    torch.testing.assert_close(captured(x), x * 2)
    assert calls_by_mode(captured) == counted(full=1)


def test_a_padding_ratio_in_the_limits_runs_wasteful_batches_eagerly():
    """`Options(limits=Limits(padding_ratio=1.5))`: 3 rows pad to 4 (1.33x) and replay; 5 rows
    would pad to 8 (1.6x) and run eagerly."""
    from graphify import Limits

    w = torch.randn(4, 4)
    g = graphify(lambda x: x @ w, sizes=(4, 8), options=Options(backend="sim", limits=Limits(padding_ratio=1.5)))
    g = g.capture(torch.randn(8, 4))
    for rows in (3, 5):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(g(x), x @ w)
    assert calls_by_mode(g) == counted(full=1, none=1)
