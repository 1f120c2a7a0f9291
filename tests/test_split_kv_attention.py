"""Split-KV (flash-decoding) in the Triton paged attention: a token's keys walked by several
programs, their partial softmaxes joined by a second kernel, against the torch reference.
Runs on a GPU, and on the CPU through Triton's interpreter (TRITON_INTERPRET=1, where Triton
is installed)."""

from __future__ import annotations

import os
import random

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (the GPU machines have it)")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter is off (TRITON_INTERPRET=1)", allow_module_level=True)

from graphify.models import BatchLayout, DecoderConfig, init_params, new_paged_cache  # noqa: E402
from graphify.models import _triton_attention as kernels  # noqa: E402
from graphify.models import attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _interpreter_takes_one_element_scalars(monkeypatch):
    """Triton 3.6's interpreter reads a scalar argument's index as `int(array)`, which NumPy 2
    refuses for its 1-element arrays: read the element instead (the interpreter only)."""
    if DEVICE == "cuda":
        return
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


def layouts(rnd):
    yield BatchLayout((1,) * 3, tuple(rnd.randint(0, 150) for _ in range(3)), 16, 16)  # decode, ragged lengths
    yield BatchLayout((1,), (0,), 16, 16)  # the first token: one key
    yield BatchLayout((5, 1), (20, 90), 16, 16)  # mixed: a request's new tokens read each other from K and V


def attend(cfg, batch, cache, layer: int, use_triton: bool, seed: int):
    t = batch[0].shape[0]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, cfg.head_dim, generator=gen).to(DEVICE, cfg.dtype)
               for h in (cfg.heads, cfg.kv_heads, cfg.kv_heads))
    out = torch.empty_like(q)
    _, positions, slots, query_lens, seq_lens, tables = batch
    if use_triton:
        kernels.paged_attention(q, k, v, cache, layer, slots, positions, query_lens, tables, out)
    else:
        attention.unified_attention.__wrapped__(q, k, v, cache, layer, slots, positions, query_lens, seq_lens,
                                                tables, out) if hasattr(attention.unified_attention, "__wrapped__") \
            else attention.unified_attention(q, k, v, cache, layer, slots, positions, query_lens, seq_lens, tables,
                                             out)
    return out


@pytest.mark.parametrize("split_kv", [False, True], ids=["one-step", "split-kv"])
def test_split_kv_attention_equals_the_torch_reference(monkeypatch, split_kv):
    monkeypatch.setattr(kernels, "SPLIT_KV", split_kv)
    monkeypatch.setattr(kernels, "_FAST", kernels._FAST and DEVICE == "cuda")
    monkeypatch.setattr(attention, "USE_TRITON", False)  # the reference: torch ops
    cfg = DecoderConfig.tiny(max_seq_len=256, hidden=64, heads=4, kv_heads=2, ffn=64)
    rnd = random.Random(0)
    for i, layout in enumerate(layouts(rnd)):
        batch = layout.build(cfg, device=DEVICE, seed=i)
        if split_kv:  # a split per BLOCK_N positions of the 256 a request may hold
            assert kernels.splits_for(batch[0].shape[0], cfg.kv_heads, 256, 64) > 1
        cache = new_paged_cache(cfg, 64, 16, device=DEVICE, seed=1)
        ref_cache = cache.clone()
        got = attend(cfg, batch, cache, 1, True, seed=i)
        again = attend(cfg, batch, cache, 1, True, seed=i)  # on a GPU the second launches directly (`_FAST`)
        want = attend(cfg, batch, ref_cache, 1, False, seed=i)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(again, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache, ref_cache)  # the new keys and values written once, where they go


def test_splits_are_chosen_from_shapes_and_only_for_small_grids(monkeypatch):
    monkeypatch.setattr(kernels, "SPLIT_KV", True)
    assert kernels.splits_for(1, 8, 272, 64) == 5  # 8B at B=1: one program per kv head, 5 BLOCK_Ns of keys
    assert kernels.splits_for(64, 8, 272, 64) == 1  # enough programs already
    assert kernels.splits_for(8, 8, 272, 64) == 1  # B=8 over 8 kv heads: splitting gained nothing on an H200
    assert kernels.splits_for(8, 4, 272, 64) == 2  # B=8 at TP=2: 32 programs, two splits
    assert kernels.splits_for(1, 2, 64, 64) == 1  # one BLOCK_N of keys: nothing to split
    monkeypatch.setattr(kernels, "SPLIT_KV", False)
    assert kernels.splits_for(1, 8, 272, 64) == 1
