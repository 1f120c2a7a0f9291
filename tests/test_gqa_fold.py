"""`graphify.transforms.gqa_fold`: one-query grouped-query attention compiled without the expanded keys
and values gives the attention as written, and only what the fold can prove is folded."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from conftest import requires_cuda
from graphify import Options
from graphify.compile.compiled import KeptCompiles


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def repeat_kv(x, n_rep):
    """transformers' expansion of key/value heads to query heads."""
    b, kv, length, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, length, d).reshape(b, kv * n_rep, length, d)


def attention(q, k, v, mask):
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask, scale=0.3)


def inputs(batch, heads, groups, queries, length, mask_kind, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads, queries, 16, device=device, dtype=dtype, generator=g)
    k = torch.randn(batch, groups, length, 16, device=device, dtype=dtype, generator=g)
    v = torch.randn(batch, groups, length, 16, device=device, dtype=dtype, generator=g)
    keep = torch.rand(batch, 1, queries, length, device=device, generator=g) > 0.3
    keep[..., 0] = True  # every row attends somewhere
    mask = {"none": None, "bool": keep, "float": torch.zeros_like(keep, dtype=dtype).masked_fill(~keep, -1e4)}[mask_kind]
    return q, k, v, mask


def compiled(fn, backend="aot_eager", fold=True, dynamic=None):
    """`fn` compiled through graphify's backend. Dynamo's default makes a size symbolic once
    it changes: the head counts stay constants, as a model's (from its weights) do."""
    kept = KeptCompiles(backend, rewrites=("fold_gqa",) if fold else ())
    return torch.compile(fn, backend=kept, dynamic=dynamic), kept


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("batch,heads,groups", [(1, 8, 2), (3, 6, 3), (2, 4, 1)])
def test_one_query_attention_folds_and_equals_the_attention_as_written(mask_kind, batch, heads, groups):
    fn, kept = compiled(attention)
    for length in (7, 12, 19):  # a second length compiles it with the length symbolic, a third reuses that
        q, k, v, mask = inputs(batch, heads, groups, 1, length, mask_kind, seed=length)
        torch.testing.assert_close(fn(q, k, v, mask), attention(q, k, v, mask), atol=1e-6, rtol=1e-5)
    assert kept.counts.get("fold_gqa", 0) == (2 if groups < heads else 0)


@pytest.mark.parametrize("case", ["two_queries", "per_head_mask", "causal", "tiled", "keys_only", "symbolic_heads"])
def test_attention_the_fold_cannot_prove_is_left_as_written(case):
    q, k, v, mask = inputs(2, 8, 2, 2 if case == "two_queries" else 1, 9, "bool")
    if case == "per_head_mask":
        mask = torch.rand(2, 8, 1, 9) > 0.3
        mask[..., 0] = True

    def fn(q, k, v, mask):
        if case == "causal":
            return F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), is_causal=True)
        if case == "tiled":  # another head order: head h reads group h % groups, not h // n_rep
            return F.scaled_dot_product_attention(q, k.repeat(1, 4, 1, 1), v.repeat(1, 4, 1, 1), attn_mask=mask)
        if case == "keys_only":
            return F.scaled_dot_product_attention(q, repeat_kv(k, 4), v.repeat(1, 4, 1, 1), attn_mask=mask)
        return attention(q, k, v, mask)

    graphed, kept = compiled(fn, dynamic=True if case == "symbolic_heads" else None)
    torch.testing.assert_close(graphed(q, k, v, mask), fn(q, k, v, mask), atol=1e-6, rtol=1e-5)
    assert kept.counts.get("fold_gqa", 0) == 0


@pytest.mark.parametrize("write", ["source_index_copy", "source_setitem", "copy_mul"])
def test_a_write_between_the_expansion_and_the_attention_keeps_it_as_written(write):
    """The expansion copies the keys where it stands; a fold would read them at the SDPA."""

    def fn(q, k, v, mask):
        keys = repeat_kv(k, 4)
        if write == "source_index_copy":
            k.index_copy_(2, torch.tensor([0]), q[:, :2])
        elif write == "source_setitem":
            k[:, :, 0] = 0.5
        else:
            keys.mul_(2.0)
        return F.scaled_dot_product_attention(q, keys, repeat_kv(v, 4), attn_mask=mask)

    graphed, kept = compiled(fn)
    q, k, v, mask = inputs(2, 8, 2, 1, 9, "bool")
    torch.testing.assert_close(graphed(q, k.clone(), v, mask), fn(q, k.clone(), v, mask), atol=1e-6, rtol=1e-5)
    assert kept.counts.get("fold_gqa", 0) == 0


def one_expansion_for_both(q, k, v, mask):
    keys = repeat_kv(k, 4)  # keys and values the very same node: folded, its chain erased once
    return F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask)


def interleaved(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1),
                                          attn_mask=mask)


@pytest.mark.parametrize("fn", [one_expansion_for_both, interleaved])
def test_other_spellings_of_the_expansion_fold_too(fn):
    graphed, kept = compiled(fn)
    q, k, v, mask = inputs(2, 8, 2, 1, 10, "float")
    torch.testing.assert_close(graphed(q, k, v, mask), fn(q, k, v, mask), atol=1e-6, rtol=1e-5)
    assert kept.counts.get("fold_gqa", 0) == 1


def test_an_expansion_read_elsewhere_stays_for_that_reader():
    def fn(q, k, v, mask):
        keys = repeat_kv(k, 4)
        return attention(q, k, v, mask), keys.sum(dim=(2, 3))

    graphed, kept = compiled(fn)
    q, k, v, mask = inputs(2, 8, 2, 1, 10, "float")
    got, want = graphed(q, k, v, mask), fn(q, k, v, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert kept.counts.get("fold_gqa", 0) == 1


def test_a_graph_the_planner_cannot_read_is_left_as_written(monkeypatch):
    import graphify.transforms.gqa_fold as fold

    def unreadable(node):
        raise AttributeError("a node unlike any the fold knows")

    monkeypatch.setattr(fold, "_expanded_source", unreadable)
    graphed, kept = compiled(attention)
    q, k, v, mask = inputs(2, 8, 2, 1, 10, "bool")
    torch.testing.assert_close(graphed(q, k, v, mask), attention(q, k, v, mask))
    assert kept.counts.get("fold_gqa", 0) == 0


def test_fold_off_compiles_the_model_as_written():
    graphed, kept = compiled(attention, fold=False)
    q, k, v, mask = inputs(2, 8, 2, 1, 10, "bool")
    torch.testing.assert_close(graphed(q, k, v, mask), attention(q, k, v, mask))
    assert kept.counts.get("fold_gqa", 0) == 0


def test_options_name_a_fold_that_is_not_a_bool():
    with pytest.raises(TypeError, match="fold_gqa"):
        Options(compile={"fold_gqa": "yes"})


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a padded row
    return model, dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                       cache_implementation="static", output_logits=True, return_dict_in_generate=True)


def test_a_transformers_decode_step_compiled_with_the_fold_equals_eager():
    """The compiled forward itself (the CPU simulation's graphs replay the function as
    written, so only a direct compile shows the folded graph's numbers)."""
    from graphify.compile.compiled import compile_for_captures

    model, call = tiny_llama()
    want = model.generate(**call, disable_compile=True)
    model.forward = compile_for_captures("llama", model.forward, {"backend": "aot_eager"})
    got = model.generate(**call, disable_compile=True)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-5, rtol=1e-5)
    from graphify.compile.compiled import _BACKENDS

    assert max(b.counts.get("fold_gqa", 0) for b in _BACKENDS.values()) >= 3  # every layer's attention at a decode step


def test_the_one_line_with_the_compile_line_folds_and_equals_eager_generate():
    from graphify import graphify

    model, call = tiny_llama()
    want = model.generate(**call, disable_compile=True)
    model.forward = graphify(model.forward, options=Options(compile={"backend": "aot_eager"}))
    got = model.generate(**call)
    assert torch.equal(got.sequences, want.sequences)
    from graphify.compile.compiled import _BACKENDS

    assert max(b.counts.get("fold_gqa", 0) for b in _BACKENDS.values()) >= 3


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_inductor_on_cuda_folds_and_equals_the_attention_as_written(mask_kind):
    fn, kept = compiled(attention, backend="inductor")
    for batch, length in ((1, 64), (8, 200)):
        q, k, v, mask = inputs(batch, 32, 8, 1, length, mask_kind, device="cuda", dtype=torch.bfloat16, seed=length)
        got, want = fn(q, k, v, mask), attention(q, k, v, mask)
        exact = attention(q.float(), k.float(), v.float(), None if mask is None else mask if mask.dtype == torch.bool else mask.float())
        assert (got.float() - exact).abs().max() <= (want.float() - exact).abs().max() * 2 + 1e-2
    assert kept.counts.get("fold_gqa", 0) >= 1
