"""CUDA-only: the Triton paged-attention kernels equal the torch reference."""

import random

import pytest
import torch

from conftest import requires_cuda
from models import BatchLayout, DecoderConfig, init_params, new_paged_cache, varlen_step
from models import attention as attention_module

pytestmark = [pytest.mark.cuda, requires_cuda]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("attention", ["unified", "split"])
def test_triton_kernels_equal_the_torch_reference(monkeypatch, dtype, tol, block, attention):
    cfg = DecoderConfig.tiny(max_seq_len=256, hidden=256, heads=8, kv_heads=2, ffn=256, dtype=dtype)
    step = varlen_step(cfg, init_params(cfg, seed=0, device="cuda"), attention)
    rnd = random.Random(block)
    for layout in (
        BatchLayout((1,) * 7, tuple(rnd.randint(0, 200) for _ in range(7)), block, 64),  # decode
        BatchLayout((37, 1, 5, 1), (0, 90, 12, 150), block, 64),  # mixed
        BatchLayout((130,), (0,), block, 64),  # prefill
    ):
        batch = layout.build(cfg, device="cuda", seed=len(layout.query_lens))
        cache = new_paged_cache(cfg, 400, block, device="cuda", seed=1)
        ref_cache = cache.clone()
        out = step(*batch, cache)
        monkeypatch.setattr(attention_module, "USE_TRITON", False)
        ref = step(*batch, ref_cache)
        monkeypatch.setattr(attention_module, "USE_TRITON", True)
        relative = (out.float() - ref.float()).norm() / ref.float().norm()  # METHOD.md's bf16 yardstick
        assert relative < tol, f"relative error {relative:.2e} on {layout}"
        torch.testing.assert_close(cache, ref_cache)
