"""Which graphs reach inductor for a timm model at B = 1 (224²): torch.compile's reduce-overhead, or graphify's
compile line; each graph's nodes, inputs, settings and ops, into /tmp/b3/<line>-<model>.json.

    mkdir -p /tmp/b3; python3 notes/cpu/compile_graphs.py ro efficientnet_b3; python3 notes/cpu/compile_graphs.py gf efficientnet_b3

Session 81, efficientnet_b3: both hand inductor the same graph (884 nodes, 497 inputs, the same ops)."""
import sys, collections, json
sys.path[:0] = ["/tmp", "/tmp/timmlib"]
import tvauto  # noqa
import torch, torch._inductor.compile_fx as cfx

which = sys.argv[1]
model_name = sys.argv[2] if len(sys.argv) > 2 else "efficientnet_b3"
seen = []
orig = cfx.compile_fx
def spy(gm, inputs, *a, **k):
    ops = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    shapes = [tuple(getattr(i, "shape", ())) for i in inputs if hasattr(i, "shape")][:3]
    seen.append({"nodes": len(gm.graph.nodes), "ops": dict(ops), "config": {k2: str(v) for k2, v in (k.get("config_patches") or {}).items()},
                 "shapes": [str(s) for s in shapes], "placeholders": sum(n.op == "placeholder" for n in gm.graph.nodes)})
    return orig(gm, inputs, *a, **k)
cfx.compile_fx = spy
import timm
torch.manual_seed(0)
m = timm.create_model(model_name, pretrained=False).eval()
x = torch.randn(1, 3, 224, 224)
with torch.inference_mode():
    if which == "ro":
        f = torch.compile(m, mode="reduce-overhead")
    else:
        from graphify import graphify, Options
        f = graphify(m, options=Options(compile=True))
    for _ in range(3):
        y = f(x)
    print("err", (y - m(x)).abs().max().item())
json.dump(seen, open(f"/tmp/b3/{which}-{model_name}.json", "w"), indent=1)
print(which, [(s["nodes"], s["placeholders"], s["config"]) for s in seen])
