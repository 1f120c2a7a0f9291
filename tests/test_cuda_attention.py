"""CUDA-only: the Triton paged-attention kernels against the torch reference."""

import random

import pytest
import torch

from conftest import requires_cuda
from models import BatchLayout, DecoderConfig, init_params, new_paged_cache, varlen_step
from models import attention as attention_module

pytestmark = [pytest.mark.cuda, requires_cuda]

LAYOUTS = (
    lambda rnd, block: BatchLayout((1,) * 7, tuple(rnd.randint(0, 200) for _ in range(7)), block, 64),  # decode
    lambda rnd, block: BatchLayout((37, 1, 5, 1), (0, 90, 12, 150), block, 64),  # mixed
    lambda rnd, block: BatchLayout((130,), (0,), block, 64),  # prefill
)


def run(cfg, params, attention, batch, cache, use_triton, monkeypatch):
    monkeypatch.setattr(attention_module, "USE_TRITON", use_triton)
    return varlen_step(cfg, params, attention)(*batch, cache)


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("attention", ["unified", "split"])
def test_triton_kernels_equal_the_torch_reference_in_float32(monkeypatch, block, attention):
    cfg = DecoderConfig.tiny(max_seq_len=256, hidden=256, heads=8, kv_heads=2, ffn=256)
    params = init_params(cfg, seed=0, device="cuda")
    rnd = random.Random(block)
    for make in LAYOUTS:
        batch = make(rnd, block).build(cfg, device="cuda", seed=3)
        cache = new_paged_cache(cfg, 400, block, device="cuda", seed=1)
        ref_cache = cache.clone()
        out = run(cfg, params, attention, batch, cache, True, monkeypatch)
        ref = run(cfg, params, attention, batch, ref_cache, False, monkeypatch)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache, ref_cache)


@pytest.mark.parametrize("attention", ["unified", "split"])
def test_triton_kernels_in_bfloat16_are_as_close_to_float32_as_the_torch_path(monkeypatch, attention):
    cfg32 = DecoderConfig.tiny(max_seq_len=256, hidden=256, heads=8, kv_heads=2, ffn=256)
    cfg16 = DecoderConfig.tiny(max_seq_len=256, hidden=256, heads=8, kv_heads=2, ffn=256, dtype=torch.bfloat16)
    p16 = init_params(cfg16, seed=0, device="cuda")
    p32 = {k: v.float() for k, v in p16.items()}
    rnd = random.Random(0)
    for make in LAYOUTS:
        batch = make(rnd, 16).build(cfg16, device="cuda", seed=3)
        cache16 = new_paged_cache(cfg16, 400, 16, device="cuda", seed=1)
        truth = run(cfg32, p32, attention, batch, cache16.float(), False, monkeypatch)
        err = {}
        for use_triton in (True, False):
            out = run(cfg16, p16, attention, batch, cache16.clone(), use_triton, monkeypatch).float()
            err[use_triton] = ((out - truth).norm() / truth.norm()).item()
        assert err[True] < 2e-2 and err[True] <= 1.5 * err[False] + 1e-3, err
