"""Session 41 device diagnostics: pool report over-count, and the compile line's backends on sliding families."""
import gc, sys, time, warnings, os
sys.path.insert(0, "tests")
import torch
from graphify import graphify, Pool, tokens, persistent, Options, Mode
import graphify.backends.torch_cuda as tc

MiB = 1 << 20
what = sys.argv[1]

def segs():
    return {s["address"]: (s["total_size"], tuple(s.get("segment_pool_id", ())), s.get("stream")) for s in torch.cuda.memory._snapshot()["segments"]}

if what == "pool":
    def relu_matmul(x, w):
        return torch.relu(x @ w) * 2
    orig = tc.TorchCudaBackend.capture if hasattr(tc, "TorchCudaBackend") else None
    cls = [c for c in vars(tc).values() if isinstance(c, type) and hasattr(c, "capture") and hasattr(c, "usage")][0]
    orig = cls.capture
    def wrapped(self, fn, args, **kw):
        before = segs()
        out = orig(self, fn, args, **kw)
        after = segs()
        new = {a: v for a, v in after.items() if a not in before}
        gone = {a: v for a, v in before.items() if a not in after}
        print(f"capture nbytes={out.nbytes/MiB:.2f} MiB new segs={[(v[0]/MiB, v[1], v[2]) for v in new.values()]} gone={[(v[0]/MiB, v[1]) for v in gone.values()]} pool={kw.get('pool')}", flush=True)
        return out
    cls.capture = wrapped
    w = torch.randn(256, 4096, device="cuda")
    graphify(relu_matmul, mode="FULL", sizes=(8,), axes=(tokens(), persistent())).capture(torch.randn(4, 256, device="cuda"), w)
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    pool = Pool("torch")
    g = graphify(relu_matmul, mode="FULL", sizes=(64, 128, 256), axes=(tokens(), persistent()), pool=pool).capture(torch.randn(4, 256, device="cuda"), w)
    r = pool.report()
    print(r)
    print("total", r.total_bytes / MiB, "reserved", r.reserved_bytes / MiB, "diff MiB", (r.total_bytes - r.reserved_bytes) / MiB)
    for a, v in segs().items():
        print("  seg", hex(a), v[0] / MiB, v[1], v[2])

if what == "compile":
    import test_hf_zoo as z
    for family in sys.argv[2].split(","):
        for be in sys.argv[3].split(","):
            t = time.time()
            try:
                want = z.generate(z.fresh(family, "cuda"), "static", "cuda", disable_compile=True)
                model = z.fresh(family, "cuda")
                torch._dynamo.reset()
                model.forward = graphify(model.forward, options=Options(compile={"backend": be}))
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    got = z.generate(model, "static", "cuda")
                from conftest import calls_by_mode
                eq = torch.equal(got, want)
                print(f"{family:16} {be:10} equal={eq} calls={dict(calls_by_mode(model.forward))} warns={[str(w.message)[:160] for w in seen if 'eager' in str(w.message)]} {time.time()-t:.1f}s", flush=True)
            except Exception as e:
                print(f"{family:16} {be:10} EXC {type(e).__name__}: {str(e)[:300]}", flush=True)

if what == "pooltrace":
    def relu_matmul(x, w):
        return torch.relu(x @ w) * 2
    marks = []
    orig_reserved = tc._reserved
    def reserved(device):
        torch.cuda.synchronize()
        n = orig_reserved(device)
        marks.append(n)
        return n
    tc._reserved = reserved
    w = torch.randn(256, 4096, device="cuda")
    graphify(relu_matmul, mode="FULL", sizes=(8,), axes=(tokens(), persistent())).capture(torch.randn(4, 256, device="cuda"), w)
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    pool = Pool("torch")
    g = graphify(relu_matmul, mode="FULL", sizes=(64, 128, 256), axes=(tokens(), persistent()), pool=pool).capture(torch.randn(4, 256, device="cuda"), w)
    snap = torch.cuda.memory._snapshot()
    r = pool.report()
    print("diff MiB", (r.total_bytes - r.reserved_bytes) / MiB, "marks", [m / MiB for m in marks])
    for ev in snap["device_traces"][0]:
        if ev["action"] in ("segment_alloc", "segment_free") or (ev["action"] == "alloc" and 1000 <= ev["size"] < 1100):
            frames = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in ev.get("frames", [])][:14]
            print(ev["action"], ev["size"], ev.get("stream"), "\n     ", " | ".join(frames), flush=True)
