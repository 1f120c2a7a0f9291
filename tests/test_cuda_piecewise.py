"""CUDA-only piecewise behaviour: pool memory across sizes, and inductor-compiled pieces."""

import pytest
import torch

from conftest import calls_by_mode, counted, requires_cuda
from graphify import Batching, Options, Pool, graphify, sglang_piecewise_sizes
from graphify.models import BatchLayout, DecoderConfig, init_params, new_paged_cache, split_ops, varlen_axes, varlen_step
from graphify.transforms import split

pytestmark = [pytest.mark.cuda, requires_cuda]
CFG = DecoderConfig.tiny(max_seq_len=256, hidden=256, heads=4, kv_heads=2, ffn=512, layers=4, vocab_size=512)


def build(compile=False):
    step = varlen_step(CFG, init_params(CFG, seed=0, device="cuda"), "unified")
    cache = new_paged_cache(CFG, 600, 16, device="cuda")
    example = BatchLayout((3, 1, 5), (4, 7, 0), 16, 16).build(CFG, device="cuda")
    return step, cache, example, split(step, split_ops("unified"), *example, cache, axes=varlen_axes(), compile=compile)


def test_all_sizes_share_the_largest_sizes_memory():
    step, cache, example, pw = build()
    sizes = sglang_piecewise_sizes(256)
    alone = graphify(pw, mode="PIECEWISE", sizes=sizes[-1:], pool=Pool("alone")).capture(*example, cache)
    every = graphify(pw, mode="PIECEWISE", sizes=sizes, pool=Pool("every")).capture(*example, cache)
    assert len(every.table) == len(sizes)
    assert every.table.nbytes <= 1.05 * alone.table.nbytes
    lay = BatchLayout((40, 1, 1, 7), (0, 30, 9, 2), 16, 16)
    batch = lay.build(CFG, device="cuda", seed=5)
    ref_cache = cache.clone()
    torch.testing.assert_close(every(*batch, cache), step(*batch, ref_cache), rtol=1e-4, atol=1e-4)
    assert calls_by_mode(every) == counted(piecewise=1)


def test_inductor_compiled_pieces_match_eager():
    step, cache, example, pw = build(compile=True)
    assert pw.compiled
    shared = {id(p.module.shared): p.module for p in pw.pieces if p.kind == "graph"}
    assert len(shared) == 3  # 4 layers, 5 graph pieces: the three middle ones share one compile
    g = graphify(pw, mode="FULL_AND_PIECEWISE", sizes=(8, 16, 32),
                 options=Options(compile_sizes=(8,))).capture(*example, cache)
    assert all(p.static_compiles == 1 for p in shared.values())  # size 8 only, shared by the layers
    for lay in (BatchLayout((1,) * 6, (20, 3, 9, 40, 2, 7), 16, 16), BatchLayout((9, 1, 12), (0, 30, 4), 16, 16)):
        batch = lay.build(CFG, device="cuda", seed=len(lay.query_lens))
        ref_cache = cache.clone()
        torch.testing.assert_close(g(*batch, cache), step(*batch, ref_cache), rtol=2e-3, atol=2e-3)
    assert calls_by_mode(g) == counted(full=1, piecewise=1)  # the decode batch FULL, the mixed one in pieces


@pytest.mark.parametrize("compile", [False, True], ids=["plain", "inductor"])
@pytest.mark.parametrize("piece_writes", [False, True], ids=["attention-writes", "piece-writes-too"])
def test_capture_leaves_the_cache_and_closed_over_state_as_it_found_them(compile, piece_writes):
    """Later keys learn their writes from the split ops as they run, or from one schedule
    replay, only where no graph piece writes outside state; a counter bumped in a graph
    piece must send them back to recorded eager warm-ups (spec-decode FULL keys: the
    schedule's request rows differ from theirs)."""
    step, cache, example, _ = build()
    counter = torch.zeros((), device="cuda")

    def fn(*args):
        if piece_writes:
            counter.add_(1)
        return step(*args)

    pw = split(fn, split_ops("unified"), *example, cache, axes=varlen_axes(), compile=compile)
    assert pw.pieces_write_outside is piece_writes
    is_uniform = lambda *args: bool((args[3] == 2).all())  # noqa: E731
    before, count = cache.clone(), counter.clone()
    g = graphify(pw, mode="FULL_AND_PIECEWISE", sizes=(8, 16, 32), batching=Batching(uniform_query_len=2, uniform=is_uniform),
                 options=Options(compile_sizes=(16,) if compile else ())).capture(*example, cache)
    torch.cuda.synchronize()
    assert torch.equal(cache, before) and torch.equal(counter, count)
    for lay in (BatchLayout((2,) * 7, (5, 3, 9, 40, 2, 7, 11), 16, 16), BatchLayout((9, 1, 12), (0, 30, 4), 16, 16)):
        batch = lay.build(CFG, device="cuda", seed=len(lay.query_lens))
        ref_cache = cache.clone()
        torch.testing.assert_close(g(*batch, cache), step(*batch, ref_cache), rtol=2e-3, atol=2e-3)
        # block 0 is scratch: padded rows write there, eager writes nothing
        torch.testing.assert_close(cache[:, :, 1:], ref_cache[:, :, 1:], rtol=2e-3, atol=2e-3)
    assert calls_by_mode(g) == counted(full=1, piecewise=1)  # the uniform spec batch FULL, the mixed one in pieces


def replayed_kernels(call) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("compile_sizes", ["none", (8,)])
def test_full_graphs_of_compiled_pieces_hold_inductor_kernels(compile_sizes, caplog):
    """Also with the size specialised: with no PIECEWISE schedule before them, FULL keys
    once compiled under the capture's write recorder, which failed and kept eager kernels."""
    step, cache, example, pw = build(compile=True)
    with caplog.at_level("WARNING", logger="graphify"):
        g = graphify(pw, mode="FULL", sizes=(8,), options=Options(compile_sizes=compile_sizes)).capture(*example, cache)
    assert "compile failed" not in caplog.text
    plain = graphify(build()[3], mode="FULL", sizes=(8,)).capture(*example, cache)
    batch = BatchLayout((1,) * 8, (5, 3, 9, 40, 2, 7, 11, 1), 16, 16).build(CFG, device="cuda", seed=8)
    compiled_kernels = replayed_kernels(lambda: g(*batch, cache))
    assert any(name.startswith("triton_") for name in compiled_kernels)  # inductor's, not eager aten kernels
    assert len(compiled_kernels) < len(replayed_kernels(lambda: plain(*batch, cache)))
    ref_cache = cache.clone()
    torch.testing.assert_close(g(*batch, cache), step(*batch, ref_cache), rtol=2e-3, atol=2e-3)
    assert calls_by_mode(g) == counted(full=3) and calls_by_mode(plain) == counted(full=2)


def test_full_graph_of_a_torch_compiled_function_matches_eager():
    w = torch.randn(64, 64, device="cuda")

    def block(x, w):
        return torch.nn.functional.silu(x @ w) * torch.sigmoid(x) + x

    from graphify import persistent, tokens

    g = graphify(torch.compile(block, dynamic=True), mode="FULL", sizes=(4, 8), axes=(tokens(), persistent()))
    g = g.capture(torch.randn(4, 64, device="cuda"), w)
    for n in (3, 6, 8):
        x = torch.randn(n, 64, device="cuda")
        torch.testing.assert_close(g(x, w), block(x, w), rtol=1e-4, atol=1e-4)
    assert calls_by_mode(g) == counted(full=3)
