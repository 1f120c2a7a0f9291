"""Seconds every GC collection takes in one line's first three calls (CPU, timm resnet18 fp32):
whether graphify's freeze_gc makes a compile's collections dearer than torch.compile's.
    python3 notes/cpu/gc_cost.py ro|graphify [model]   (offline timm: /tmp/timmlib)"""
import gc, sys, time, json
sys.path[:0] = ["/tmp", "/tmp/timmlib"]
import tvauto  # offline timm
import timm, torch
line = sys.argv[1]
torch.manual_seed(0)
model = timm.create_model(sys.argv[2] if len(sys.argv) > 2 else "resnet18", pretrained=False).eval()
x = torch.randn(1, 3, 96, 96)
stats, t0 = [], [0.0]
def cb(phase, info):
    if phase == "start": t0[0] = time.perf_counter()
    else: stats.append((info["generation"], time.perf_counter() - t0[0], info["collected"]))
if line == "ro":
    fn = torch.compile(model)
else:
    from graphify import graphify, Options
    fn = graphify(model, options=Options(backend="sim", compile=True))
gc.callbacks.append(cb)
start = time.perf_counter()
with torch.inference_mode():
    for _ in range(3): fn(x)
total = time.perf_counter() - start
gc.callbacks.remove(cb)
by = {g: [sum(1 for s in stats if s[0] == g), round(sum(s[1] for s in stats if s[0] == g), 3)] for g in (0, 1, 2)}
print(json.dumps({"line": line, "total_s": round(total, 2), "gc_s": round(sum(s[1] for s in stats), 3), "by_gen": by}))
