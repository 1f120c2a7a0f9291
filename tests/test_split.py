"""split(fn, ops) and the piecewise / dual modes on the varlen reference model, on every
backend, against eager execution on random prefill, decode, mixed and spec-decode batches."""

from __future__ import annotations

import logging
import random
import weakref
import zlib

import pytest
import torch

from conftest import calls_by_mode, counted, expected_calls
from graphify import Options, Batching, Mode, Support, graphify, tokens
from graphify.models import BatchLayout, DecoderConfig, init_params, model_support, new_paged_cache, split_ops, varlen_axes, varlen_step
from graphify.transforms import SplitError, split

SIZES = (4, 8, 16, 32)
BLOCK = 4
CFG = DecoderConfig.tiny(max_seq_len=64)


def layout(query_lens, context_lens):
    return BatchLayout(tuple(query_lens), tuple(context_lens), block_size=BLOCK, max_blocks=16)


def random_layout(kind: str, rnd: random.Random, max_tokens: int = 40):
    """A batch of one kind: prefill (no context), decode (1 token each), mixed, spec (1+k each)."""
    r = rnd.randint(1, 6)
    if kind == "decode":
        q = [1] * rnd.randint(1, 20)
    elif kind == "spec":
        q = [2] * rnd.randint(1, 12)
    elif kind == "prefill":
        q = [rnd.randint(2, 9) for _ in range(r)]
    else:
        q = [rnd.choice([1, 1, rnd.randint(2, 9)]) for _ in range(r)] + [3]
    ctx = [0 if kind == "prefill" else rnd.randint(1, 30) for _ in q]
    while sum(q) > max_tokens:
        q.pop(), ctx.pop()
    return layout(q, ctx)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=3)


def model(params, attention, device):
    step = varlen_step(CFG, {k: v.to(device) for k, v in params.items()}, attention)
    cache = new_paged_cache(CFG, 256, BLOCK, device=device, seed=4)
    example = layout((3, 1, 5), (4, 7, 0)).build(CFG, device=device)
    return step, cache, example


def check_against_eager(g, step, cache, batches, device, rtol=1e-4, atol=1e-4) -> list[tuple[int, bool]]:
    """Each batch through `g` and eagerly, outputs and caches compared. Returns each batch's
    (num_tokens, uniform decode), for `expected_calls`."""
    for i, lay in enumerate(batches):
        batch = lay.build(CFG, device=device, seed=100 + i)
        ref_cache = cache.clone()
        ref = step(*batch, ref_cache)
        out = g(*batch, cache)
        assert out.shape == ref.shape == (len(lay.query_lens), CFG.vocab_size)
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
        # block 0 is scratch: padded rows write there, eager runs do not
        torch.testing.assert_close(cache[:, :, 1:], ref_cache[:, :, 1:], rtol=rtol, atol=atol)
    return [(sum(lay.query_lens), all(q == 1 for q in lay.query_lens)) for lay in batches]


# -- split itself ---------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["unified", "split"])
def test_split_equals_fn_and_has_layers_plus_one_graph_pieces(params, attention):
    step, cache, example = model(params, attention, "cpu")
    pw = split(step, split_ops(attention), *example, cache, axes=varlen_axes())
    assert pw.num_graph_pieces == CFG.layers + 1 and pw.num_split_pieces == CFG.layers
    assert [p.kind for p in pw.pieces] == ["graph", "split"] * CFG.layers + ["graph"]
    assert set(pw.symbols.values()) == {"reqs", "tokens"}
    rnd = random.Random(0)
    for kind in ("prefill", "decode", "mixed"):
        batch = random_layout(kind, rnd).build(CFG, seed=1)
        c1, c2 = cache.clone(), cache.clone()
        assert torch.equal(pw(*batch, c1), step(*batch, c2)) and torch.equal(c1, c2)


def test_op_that_does_not_occur_is_named(params):
    step, cache, example = model(params, "unified", "cpu")
    with pytest.raises(SplitError, match=r"\['graphify_models::split_attention'\] do not occur"):
        split(step, split_ops("split"), *example, cache, axes=varlen_axes())
    with pytest.raises(SplitError, match="ops is empty"):
        split(step, [], *example, cache)
    with pytest.raises(SplitError, match="namespace::name"):
        split(step, ["attention"], *example, cache)


def test_data_dependent_control_flow_is_named_with_advice():
    def branchy(x):
        if x.sum() > 0:  # data-dependent
            return x * 2
        return x

    with pytest.raises(SplitError) as info:
        split(branchy, ["graphify_models::unified_attention"], torch.randn(5, 3), axes=(tokens(),))
    msg = str(info.value)
    assert "data-dependent" in msg and "if x.sum() > 0" in msg and "ops" in msg


def test_any_example_traces_only_the_batch_dims(params):
    """One token per request, and as many requests as KV heads: still two batch symbols,
    and the KV cache keeps its shape when split ops are cut to the real batch."""
    step, cache, _ = model(params, "unified", "cpu")
    square = layout((1, 1), (4, 7)).build(CFG)  # 2 tokens, 2 requests, 2 KV heads
    pw = split(step, split_ops("unified"), *square, cache, axes=varlen_axes())
    assert set(pw.symbols.values()) == {"reqs", "tokens"}
    g = graphify(pw, mode="PIECEWISE", sizes=SIZES, options=Options(backend="sim")).capture(*square, cache)
    check_against_eager(g, step, cache, [layout((5, 1, 1), (0, 3, 9)), layout((1,), (12,))], "cpu")
    assert calls_by_mode(g) == counted(piecewise=2)
    with pytest.raises(SplitError, match="at least 2 tokens and 2 requests"):
        split(step, split_ops("unified"), *layout((1,), (4,)).build(CFG), cache, axes=varlen_axes())


# -- every mode against eager ---------------------------------------------------------------

@pytest.mark.parametrize("attention", ["unified", "split"])
@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_every_mode_equals_eager_on_random_batches(backend, params, attention, mode):
    name, device = backend
    step, cache, example = model(params, attention, device)
    pw = split(step, split_ops(attention), *example, cache, axes=varlen_axes())
    g = graphify(pw, mode=mode, sizes=SIZES, support=model_support(attention), options=Options(backend=name))
    g = g.capture(*example, cache)
    rnd = random.Random(zlib.crc32(f"{attention}/{mode}".encode()))  # the same batches in every process
    batches = [random_layout(kind, rnd) for kind in ("prefill", "decode", "mixed", "spec") for _ in range(2)]
    batches.append(layout([6] * 9, [1] * 9))  # 54 tokens: above the largest size, eager
    seen = check_against_eager(g, step, cache, batches, device)
    # what each batch ran as, as vLLM would dispatch it: an always-eager graphify fails here
    assert calls_by_mode(g) == expected_calls(g.resolution.mode, seen, max(SIZES))
    if g.resolution.mode is not Mode.NONE:
        assert len(g.table) == len(g.keys) > 0


def test_full_and_piecewise_dispatches_decode_to_full_and_mixed_to_piecewise(backend, params):
    name, device = backend
    step, cache, example = model(params, "split", device)
    pw = split(step, split_ops("split"), *example, cache, axes=varlen_axes())
    g = graphify(pw, mode="FULL_AND_PIECEWISE", sizes=SIZES, support=model_support("split"), options=Options(backend=name))
    g = g.capture(*example, cache)
    check_against_eager(g, step, cache, [layout([1] * 5, [3, 9, 2, 20, 7]), layout([4, 1, 1], [0, 5, 6])], device)
    rows = g.stats.rows()
    assert [(r.mode, r.padded_to, r.calls) for r in rows] == [(Mode.PIECEWISE, 8, 1), (Mode.FULL, 8, 1)]
    full_keys = {e.key for e in g.table if e.mode is Mode.FULL}
    assert all(k.uniform and k.num_reqs == k.num_tokens for k in full_keys)


def test_spec_decode_batches_count_as_uniform(backend, params):
    name, device = backend
    step, cache, example = model(params, "unified", device)
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes())
    # With 1+k query tokens, tokens == k * requests does not prove every request has k
    # tokens ([1, 3, 2] has 6 = 3 * 2), so a spec-decode engine says which batches are uniform.
    is_uniform = lambda *args: bool((args[3] == 2).all())  # noqa: E731
    g = graphify(pw, mode="FULL_AND_PIECEWISE", sizes=SIZES, batching=Batching(uniform_query_len=2, uniform=is_uniform), options=Options(backend=name))
    g = g.capture(*example, cache)
    check_against_eager(g, step, cache, [layout([2] * 3, [5, 8, 1]), layout([1, 3, 2], [5, 8, 1])], device)
    assert [(r.mode, r.padded_to) for r in g.stats.rows()] == [(Mode.PIECEWISE, 8), (Mode.FULL, 8)]
    assert any(e.key.uniform and e.key.num_reqs == 4 for e in g.table)  # 8 tokens = 4 requests of 2


# -- mode resolution against the backends ----------------------------------------------------

def test_backend_support_downgrades_with_a_logged_reason(params, caplog):
    step, cache, example = model(params, "split", "cpu")
    pw = split(step, split_ops("split"), *example, cache, axes=varlen_axes())
    with caplog.at_level(logging.WARNING, logger="graphify"):
        g = graphify(pw, mode="FULL", support=model_support("split"))
    assert g.resolution.mode is Mode.FULL_AND_PIECEWISE
    assert "UNIFORM_SINGLE_TOKEN_DECODE" in caplog.text and "FULL_AND_PIECEWISE" in caplog.text
    spec = graphify(pw, mode="FULL_AND_PIECEWISE", support=model_support("split"), batching=Batching(uniform_query_len=3))
    assert spec.resolution.mode is Mode.PIECEWISE and "spec decode" in spec.resolution.reasons[-1]
    hybrid = model_support(["unified", "split"])
    assert hybrid is Support.UNIFORM_SINGLE_TOKEN_DECODE


def test_mode_impossible_even_after_downgrade_is_an_error(params):
    step, cache, example = model(params, "unified", "cpu")
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes())
    with pytest.raises(ValueError, match="PIECEWISE"):
        graphify(pw, mode="FULL", support=Support.NEVER)
    assert graphify(pw, mode="FULL_AND_PIECEWISE", support=Support.NEVER).resolution.mode is Mode.PIECEWISE


@torch.library.custom_op("graphify_tests::mix_rows", mutates_args=())
def mix_rows(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """A split op that returns a new tensor and reads the real request count."""
    return x * (1.0 + lens.float().sum()) - x.mean(0, keepdim=True)


@mix_rows.register_fake
def _(x, lens):
    return torch.empty_like(x)


def test_split_ops_that_return_new_tensors_feed_later_pieces_and_the_output(backend):
    name, device = backend
    w = torch.randn(6, 6, generator=torch.Generator().manual_seed(0)).to(device)

    def fn(x, lens):
        h = mix_rows(torch.tanh(x @ w), lens)  # eager result read by the next graph piece
        return mix_rows(h @ w + 1.0, lens)  # and an eager result as the function's output

    example = (torch.randn(7, 6, device=device), torch.ones(3, dtype=torch.long, device=device))
    pw = split(fn, [mix_rows], *example, axes=(tokens(), "reqs"))
    assert [p.kind for p in pw.pieces] == ["graph", "split", "graph", "split"]
    g = graphify(pw, mode="PIECEWISE", sizes=(4, 8, 16), options=Options(backend=name)).capture(*example)
    for n, r in ((3, 2), (8, 5), (11, 4), (16, 1)):
        x, lens = torch.randn(n, 6, device=device), torch.randint(1, 5, (r,), device=device)
        torch.testing.assert_close(g(x, lens), fn(x, lens), rtol=1e-5, atol=1e-5)
    assert calls_by_mode(g) == counted(piecewise=4)


def test_a_capture_pass_lets_go_of_each_eager_result_after_its_last_use():
    """The pass (a `torch.fx.Interpreter`) frees capture-time values at their last use: a
    split op's result, read by the next graph piece only, is gone when the piece after that
    captures, so the pool can reuse its memory within the size."""
    from graphify.extend import Captured

    w = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))

    def fn(x, lens):
        h = mix_rows(x @ w, lens)
        h = mix_rows(h @ w, lens)
        return h @ w

    example = (torch.randn(7, 6), torch.ones(3, dtype=torch.long))
    pw = split(fn, [mix_rows], *example, axes=(tokens(), "reqs"))
    assert [p.kind for p in pw.pieces] == ["graph", "split", "graph", "split", "graph"]
    results, alive = [], []

    class Keeper:  # the pass records split ops' writes through it: here, it watches their results
        exclude: set = set()

        def record_writes(self, fn, *args):
            out = fn(*args)
            results.append(weakref.ref(out))
            return out

    class Backend:
        name = "cuda"

        def capture(self, fn, args, **kw):
            alive.append([r() is not None for r in results])
            return Captured(lambda: None, None, fn(*args), 0)

    pw.capture_pieces(Backend(), example, pool=None, warmups=0, weak_outputs=False, keeper=Keeper(), record=True)
    assert alive == [[], [True], [False, True]]


def test_a_serving_trace_under_full_and_piecewise_equals_eager(backend, params):
    """Chunked prefills continuing from cached context, decodes and spec steps, with KV
    blocks kept per request across steps: the graphified step equals eager step by step."""
    from benchmarks.trace import schedule, synthetic_requests
    from graphify.models import BlockTables

    name, device = backend
    step, cache, example = model(params, "unified", device)
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes())
    g = graphify(pw, mode="FULL_AND_PIECEWISE", sizes=SIZES, options=Options(backend=name)).capture(*example, cache)
    requests = synthetic_requests(5, 8, prompt_range=(3, 20), output_range=(2, 6))
    steps = schedule(requests, max_tokens=24, chunk=8, spec_tokens=1, spec_every=2)
    tables = BlockTables(256, BLOCK, 16)
    ref_cache = cache.clone()
    finished = {r.id: r.prompt_len + r.output_len for r in requests}
    done = {r.id: 0 for r in requests}
    for i, s in enumerate(steps):
        batch = tables.batch(CFG, s.request_ids, s.query_lens, s.context_lens, device=device, seed=i)
        torch.testing.assert_close(g(*batch, cache), step(*batch, ref_cache), rtol=1e-4, atol=1e-4)
        for rid, q in zip(s.request_ids, s.query_lens):
            done[rid] += q
            if done[rid] == finished[rid]:
                tables.release(rid)
    torch.testing.assert_close(cache[:, :, 1:], ref_cache[:, :, 1:], rtol=1e-4, atol=1e-4)  # block 0: scratch
    kinds = {s.kind for s in steps}
    assert {"decode", "mixed"} <= kinds
    seen = [(s.num_tokens, all(q == 1 for q in s.query_lens)) for s in steps]
    assert calls_by_mode(g) == expected_calls("FULL_AND_PIECEWISE", seen, max(SIZES))  # decodes FULL, the rest in pieces
