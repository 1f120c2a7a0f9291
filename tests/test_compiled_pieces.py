"""Compiled pieces (transforms._compile): identical layers share one compile, a dynamic one
serves every size, and the sizes graphify specialises (Options(compile_sizes=...)) get a
static compile made by their warm-up. Counted with a recording stand-in for inductor
(fast), and once with inductor itself on the CPU (the simulation backend)."""

from __future__ import annotations

import pytest
import torch

import graphify.transforms._compile as compile_mod
from conftest import calls_by_mode, counted
from graphify import Options, graphify, vllm_sizes
from graphify.plan.keys import plan_keys
from graphify.plan.keys import specialised_sizes
from graphify.models import BlockTables, DecoderConfig, init_params, new_paged_cache, split_ops, varlen_axes, varlen_step
from graphify.transforms import split
from graphify.transforms._compile import piece_key


def tiny(layers: int):
    cfg = DecoderConfig.tiny(max_seq_len=256, layers=layers)
    step = varlen_step(cfg, init_params(cfg, seed=0, device="cpu"), "unified")
    cache = new_paged_cache(cfg, 64, 16, device="cpu", seed=1)
    tables = BlockTables(64, 16, 16)
    example = tables.batch(cfg, (0, 1, 2), (3, 1, 2), (3, 5, 6), device="cpu", seed=0)
    return cfg, step, cache, tables, example


def test_identical_layers_have_one_key():
    _, step, cache, _, example = tiny(layers=4)
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes())
    keys = [piece_key(p.module) for p in pw.pieces if p.kind == "graph"]
    assert len(keys) == 5 and len(set(keys)) == 3  # embed + layer 0, three identical middles, last + head
    assert keys[1] == keys[2] == keys[3]


@pytest.fixture
def recorded(monkeypatch):
    """inductor replaced by a recorder that returns the piece itself (eager). Each call:
    (piece, "from_graph" | "from_example_inputs", rows, the dispatch mode active or None)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    calls = []

    def fake(gm, inputs, shapes, options):
        traced = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        rows = next(t.shape[0] for t, v in zip(inputs, traced)  # an input whose dim 0 the trace made symbolic
                    if isinstance(v, torch.Tensor) and v.dim() and isinstance(v.shape[0], torch.SymInt))
        calls.append((id(gm), shapes, rows, _get_current_dispatch_mode()))
        return gm

    monkeypatch.setattr(compile_mod, "_compile", fake)
    return calls


@pytest.mark.parametrize("rule, static_rows", [("none", {1}), ("all", {1, 2, 4, 8, 64}), ((4, 64), {1, 4, 64})])
def test_specialised_sizes_get_static_compiles_made_by_warm_ups(recorded, rule, static_rows):
    _, step, cache, tables, example = tiny(layers=4)
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes(), compile=True)
    distinct = {id(p.module.shared.gm) for p in pw.pieces if p.kind == "graph"}
    assert len(distinct) == 3
    g = graphify(pw, mode="FULL_AND_PIECEWISE", sizes=(1, 2, 4, 8, 64), options=Options(backend="sim", compile_sizes=rule)).capture(*example, cache)
    dynamic = [c for c in recorded if c[1] == "from_graph"]
    static = [c for c in recorded if c[1] == "from_example_inputs"]
    # one dynamic compile per distinct piece, made when a size that is not specialised first needs it
    assert sorted(c[0] for c in dynamic) == ([] if rule == "all" else sorted(distinct))
    assert {rows for _, _, rows, _ in static} == static_rows  # size 1 always: the dynamic compile assumes >= 2
    assert len(static) == 3 * len(static_rows)  # once per distinct piece and size, shared by the layers
    cfg = DecoderConfig.tiny(max_seq_len=256, layers=4)
    big = ((40, 40), (0, 0))  # above the largest size: the program runs eagerly, on the dynamic compile
    for q, ctx in (((1,) * 8, (30,) * 8), ((2, 1, 3), (0, 9, 20)), big):  # a decode batch (FULL), a mixed one
        batch = tables.batch(cfg, tuple(range(10, 10 + len(q))), q, ctx, device="cpu", seed=len(q))
        ref = cache.clone()
        torch.testing.assert_close(g(*batch, cache), step(*batch, ref), rtol=1e-5, atol=1e-5)
    assert calls_by_mode(g) == counted(full=1, piecewise=1, none=1)  # decode FULL, mixed in pieces, 80 tokens eager
    assert sorted(c[0] for c in recorded if c[1] == "from_graph") == sorted(distinct)


def test_full_keys_compile_outside_every_dispatch_mode(recorded):
    """FULL keys of compiled pieces with no PIECEWISE schedule to warm them: the first
    warm-up runs under the capture's write recorder (and, for the first key, the op guard).
    A compile made there failed on the H100 and kept an eager fallback for the size, so the
    FULL graphs replayed eager kernels. Every compile happens outside those modes, and each
    captured size still has its static compile before its capture."""
    cfg, step, cache, tables, example = tiny(layers=4)
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes(), compile=True)
    sizes = (2, 4, 8)
    g = graphify(pw, mode="FULL", sizes=sizes, options=Options(backend="sim", compile_sizes="all")).capture(*example, cache)
    assert recorded and [c[3] for c in recorded if c[3] is not None] == []
    static = {(piece, rows) for piece, shapes, rows, _ in recorded if shapes == "from_example_inputs"}
    distinct = {id(p.module.shared.gm) for p in pw.pieces if p.kind == "graph"}
    assert static >= {(piece, n) for piece in distinct for n in sizes}
    for q, ctx in (((1,) * 4, (30,) * 4), ((2, 1, 3), (0, 9, 20))):
        batch = tables.batch(cfg, tuple(range(10, 10 + len(q))), q, ctx, device="cpu", seed=len(q) + 7)
        ref = cache.clone()
        torch.testing.assert_close(g(*batch, cache), step(*batch, ref), rtol=1e-5, atol=1e-5)
    assert calls_by_mode(g) == counted(full=2)  # FULL graphs take the mixed batch too


def test_specialised_sizes_rules():
    keys = plan_keys("FULL_AND_PIECEWISE", vllm_sizes(512))
    assert specialised_sizes("all", keys) == frozenset(vllm_sizes(512))
    assert specialised_sizes("none", keys) == frozenset()
    assert specialised_sizes((8, 9, 512), keys) == frozenset({8, 512})  # only captured sizes
    assert Options().compile_sizes == "none" and Options(compile_sizes=[64, 8, 8]).compile_sizes == (8, 64)
    with pytest.raises(ValueError, match="compile_sizes"):
        Options(compile_sizes="decode")
    with pytest.raises(ValueError, match="positive"):
        Options(compile_sizes=(0, 4))


def test_inductor_pieces_on_the_cpu_equal_eager():
    pytest.importorskip("torch._inductor")
    cfg, step, cache, tables, example = tiny(layers=3)
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes(), compile=True)
    g = graphify(pw, mode="FULL_AND_PIECEWISE", sizes=(2, 4), options=Options(backend="sim", compile_sizes=(2,))).capture(*example, cache)
    shared = {id(p.module.shared): p.module for p in pw.pieces if p.kind == "graph"}
    assert len(shared) == 3 and all(p.static_compiles >= 1 for p in shared.values())
    for q, ctx in (((1, 1), (7, 30)), ((2, 1, 1), (0, 9, 20))):
        batch = tables.batch(cfg, tuple(range(10, 10 + len(q))), q, ctx, device="cpu", seed=len(q))
        ref = cache.clone()
        torch.testing.assert_close(g(*batch, cache), step(*batch, ref), rtol=1e-4, atol=1e-4)
    assert calls_by_mode(g) == counted(full=1, piecewise=1)  # the decode batch FULL, the mixed one in pieces


def test_inductor_pieces_traced_where_tokens_equal_heads_serve_every_size():
    """The dynamic compile keeps the trace's symbols: traced with 4 tokens over 4 heads and 2
    requests over 2 KV heads, the pieces still serve other sizes. (On torch 2.11 a fresh fake
    mode made heads the tokens' symbol, and every other size failed inductor's shape assert:
    the 8B shape at TP=4, 8 heads a GPU, first seen on four H200s.)"""
    pytest.importorskip("torch._inductor")
    cfg = DecoderConfig.tiny(max_seq_len=256, layers=2)
    assert (cfg.heads, cfg.kv_heads) == (4, 2)
    step = varlen_step(cfg, init_params(cfg, seed=0, device="cpu"), "unified")
    cache = new_paged_cache(cfg, 64, 16, device="cpu", seed=1)
    tables = BlockTables(64, 16, 16)
    example = tables.batch(cfg, (0, 1), (3, 1), (3, 5), device="cpu", seed=0)  # 4 tokens, 2 requests
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes(), compile=True)
    for q, ctx in (((1, 1, 1), (7, 30, 2)), ((5, 2, 1), (0, 9, 20)), ((1,) * 8, tuple(range(3, 11)))):
        batch = tables.batch(cfg, tuple(range(10, 10 + len(q))), q, ctx, device="cpu", seed=len(q))
        ref = cache.clone()
        torch.testing.assert_close(pw(*batch, cache), step(*batch, ref), rtol=1e-4, atol=1e-4)
    # what the fix does, seen on any torch: each compiled piece's outputs name the trace's fake
    # mode, where standalone_compile("from_graph") takes the mode it compiles in
    for piece in (p.module.shared.gm for p in pw.pieces if p.kind == "graph"):
        mode = next(n.meta["val"].fake_mode for n in piece.graph.nodes
                    if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor))
        out = next(n for n in piece.graph.nodes if n.op == "output")
        shown = [a.meta["example_value"] for a in torch.utils._pytree.tree_leaves(out.args[0])
                 if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("example_value"), torch.Tensor)]
        assert shown and all(v.fake_mode is mode for v in shown)


def test_a_compiled_piece_that_fails_at_run_time_runs_as_traced_with_one_warning(recorded):
    """A call eager can run does not raise: a compiled piece whose code fails (the shape assert
    torch 2.11 once tripped) runs as traced from then on, warned once, the answer eager's."""
    cfg, step, cache, tables, example = tiny(layers=3)
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes(), compile=True)
    pieces = [p.module for p in pw.pieces if p.kind == "graph"]
    broken = pieces[1].shared

    def fails(*inputs):
        raise AssertionError("expected size 4==6, stride 64==96 at dim=0")

    broken.dynamic = fails
    batch = tables.batch(cfg, (10, 11, 12), (2, 1, 3), (5, 9, 0), device="cpu", seed=3)
    with pytest.warns(UserWarning, match="compiled piece failed at run time.*AssertionError"):
        ref = cache.clone()
        torch.testing.assert_close(pw(*batch, cache), step(*batch, ref))
    assert broken.failed and not any(p.shared.failed for p in pieces if p.shared is not broken)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        ref = cache.clone()
        torch.testing.assert_close(pw(*batch, cache), step(*batch, ref))
