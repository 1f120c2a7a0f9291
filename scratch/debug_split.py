import sys, torch
from torch.profiler import ProfilerActivity, profile
from graphify import graphify, persistent, tokens
from models import BatchLayout, DecoderConfig, init_params, new_paged_cache, split_ops, varlen_axes, varlen_step
from transforms import split

def kernels(call):
    call(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call(); torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

if sys.argv[1] == "simple":
    w = torch.randn(64, 64, device="cuda")
    def block(x, w):
        return torch.nn.functional.silu(x @ w) * torch.sigmoid(x) + x
    compiled = torch.compile(block, dynamic=True)
    g = graphify(compiled, mode="FULL", sizes=(8,), axes=(tokens(), persistent()), progress=False).capture(torch.randn(4, 64, device="cuda"), w)
    x = torch.randn(8, 64, device="cuda")
    print("simple kernels", kernels(lambda: g(x, w)), flush=True)
    print("eager compiled kernels", kernels(lambda: compiled(x, w)), flush=True)
else:
    CFG = DecoderConfig.tiny(max_seq_len=256, hidden=256, heads=4, kv_heads=2, ffn=512, layers=2, vocab_size=512)
    step = varlen_step(CFG, init_params(CFG, seed=0, device="cuda"), "unified")
    cache = new_paged_cache(CFG, 600, 16, device="cuda")
    example = BatchLayout((3, 1, 5), (4, 7, 0), 16, 16).build(CFG, device="cuda")
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes(), compile=True)
    mode = sys.argv[1]
    g = graphify(pw, mode=mode, sizes=(8,), axes=varlen_axes(), progress=False).capture(*example, cache)
    batch = BatchLayout((1,) * 8, (5, 3, 9, 40, 2, 7, 11, 1), 16, 16).build(CFG, device="cuda", seed=8)
    out = g(*batch, cache); torch.cuda.synchronize()
    ref = step(*batch, cache.clone())
    print(mode, "err", (out - ref).abs().max().item(), flush=True)
    ks = kernels(lambda: g(*batch, cache))
    print(mode, len(ks), sorted(set(k[:40] for k in ks))[:12], flush=True)
