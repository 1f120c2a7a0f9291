"""CUDA-only: the Triton paged-attention kernels against the torch reference."""

import random

import pytest
import torch

from conftest import requires_cuda
from graphify.models import BatchLayout, DecoderConfig, init_params, new_paged_cache, varlen_step
from graphify.models import attention as attention_module

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


def test_direct_launches_share_a_kernel_only_where_triton_would(monkeypatch):
    """The fast launch path reuses a compiled kernel for every call with the same
    `launch_key`: that is only right if calls with one key get one Triton specialisation.
    Over bfloat16 arguments that move q's, k's, v's and out's 16-byte alignment and the
    ints' classes (1, multiples of 16, other; all 32-bit here), equal keys must mean equal
    specialisations, and the direct launches must equal Triton's own."""
    from graphify.models import _triton_attention as tri

    if not tri._FAST:
        pytest.skip(f"the direct launch is off with Triton {tri.triton.__version__} (written for 3.6)")
    monkeypatch.setattr(tri, "SPLIT_KV", False)  # one step: the key below; split launches are tested apart
    cfg = DecoderConfig.tiny(max_seq_len=256, hidden=256, heads=8, kv_heads=2, ffn=256, dtype=torch.bfloat16)
    binder = tri._attention_kernel.device_caches[torch.cuda.current_device()][-1]
    seen = {}
    rnd = random.Random(5)
    for case in range(24):
        reqs = rnd.choice([1, 2, 16, 17])
        layout = BatchLayout(tuple(rnd.randint(1, 9) for _ in range(reqs)),
                             tuple(rnd.randint(0, 60) for _ in range(reqs)), 16, rnd.choice([8, 16, 17]))
        ids, pos, slots, ql, sl, bt = layout.build(cfg, device="cuda", seed=case)
        t, h, kvh, d = ids.shape[0], cfg.heads, cfg.kv_heads, cfg.head_dim
        shift = rnd.choice([0, 1, 8])  # elements: moves q's, k's and v's 16-byte alignment
        qkv = torch.randn(t, (h + 2 * kvh) * d + shift, device="cuda", dtype=cfg.dtype)[:, shift:]
        q, k, v = (x.reshape(t, -1, d) for x in qkv.split((h * d, kvh * d, kvh * d), dim=-1))
        cache = new_paged_cache(cfg, 200, 16, device="cuda", seed=case)
        layer = rnd.randrange(cfg.layers)
        out = torch.empty_like(q)
        kc, vc = cache[layer][0], cache[layer][1]
        ints = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2], bt.stride(0), bt.shape[0])
        consts = (h // kvh, 16, d, 16, kvh, 64, False, 1)
        args = (q, k, v, kc, vc, out, bt, ql, pos, slots, out)  # one split: its scratch is `out`, unused
        key = tri.launch_key(torch.cuda.current_device(), tuple(x.dtype for x in args),
                             tuple(x.data_ptr() for x in args), ints, consts)
        _, spec, _ = binder(*args, *ints, 0.125, *consts)
        results = []
        for fast in (False, True):
            monkeypatch.setattr(tri, "_FAST", fast)
            c, o = cache.clone(), torch.empty_like(q)
            for _ in range(2):  # with the fast path on, the second call (at least) launches directly
                tri.paged_attention(q, k, v, c, layer, slots, pos, ql, bt, o)
            results.append((o, c))
        assert key in tri._COMPILED  # the direct path was taken
        torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)
        assert seen.setdefault(key, str(spec)) == str(spec), "one launch key, two Triton specialisations"
    assert len(seen) >= 3  # the cases moved the specialisation


def test_any_request_count_shares_one_compiled_kernel():
    """The request count is not specialised on: a batch of one request (a lone prefill,
    never seen by a capture) or of 16 runs the kernel the others compiled, instead of
    compiling its own in the middle of serving (0.8-1.2 s on the H100)."""
    from graphify.models import _triton_attention as tri

    cfg = DecoderConfig.tiny(max_seq_len=256, hidden=256, heads=8, kv_heads=2, ffn=256, dtype=torch.bfloat16)
    compiled = tri._attention_kernel.device_caches[torch.cuda.current_device()][0]
    counts, outs = [], []
    for reqs in (3, 1, 16, 2):
        layout = BatchLayout(tuple(range(1, reqs + 1)), tuple(5 * i for i in range(reqs)), 16, 8)
        ids, pos, slots, ql, sl, bt = layout.build(cfg, device="cuda", seed=reqs)
        t, d = ids.shape[0], cfg.head_dim
        q = torch.randn(t, cfg.heads, d, device="cuda", dtype=cfg.dtype)
        k, v = (torch.randn(t, cfg.kv_heads, d, device="cuda", dtype=cfg.dtype) for _ in range(2))
        cache = new_paged_cache(cfg, 200, 16, device="cuda", seed=reqs)
        out = torch.empty_like(q)
        tri.paged_attention(q, k, v, cache, 0, slots, pos, ql, bt, out)
        counts.append(len(compiled))
        outs.append(out)
    assert counts[0] >= 1 and counts == [counts[0]] * len(counts), counts
    assert all(torch.isfinite(o.float()).all() for o in outs)


@pytest.mark.parametrize("fast", [False, True])
def test_layers_index_the_cache_as_python_does_on_both_launch_paths(monkeypatch, fast):
    """A negative layer counts from the end and one out of range raises IndexError, through
    Triton's launch and through the direct one (which computes the layer's address itself)."""
    from graphify.models import _triton_attention as tri

    if fast and not tri._FAST:
        pytest.skip(f"the direct launch is off with Triton {tri.triton.__version__} (written for 3.6)")
    monkeypatch.setattr(tri, "_FAST", fast)
    cfg = DecoderConfig.tiny(max_seq_len=256, hidden=256, heads=8, kv_heads=2, ffn=256, dtype=torch.bfloat16)
    ids, pos, slots, ql, sl, bt = BatchLayout((3, 1), (5, 40), 16, 8).build(cfg, device="cuda", seed=2)
    t, d = ids.shape[0], cfg.head_dim
    q = torch.randn(t, cfg.heads, d, device="cuda", dtype=cfg.dtype)
    k, v = (torch.randn(t, cfg.kv_heads, d, device="cuda", dtype=cfg.dtype) for _ in range(2))
    cache = new_paged_cache(cfg, 200, 16, device="cuda", seed=4)
    results = []
    for layer in (cfg.layers - 1, -1):
        c, o = cache.clone(), torch.empty_like(q)
        for _ in range(2):  # the second call launches directly where the fast path is on
            tri.paged_attention(q, k, v, c, layer, slots, pos, ql, bt, o)
        results.append((o, c))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)
    assert not torch.equal(results[0][1], cache)  # the keys and values were written
    for layer in (cfg.layers, -cfg.layers - 1):
        with pytest.raises(IndexError):
            tri.paged_attention(q, k, v, cache.clone(), layer, slots, pos, ql, bt, torch.empty_like(q))
