import sys, traceback, torch
from graphify import graphify, persistent, tokens
variant = sys.argv[1]
w = torch.randn(64, 64, device="cuda")
def block(x, w):
    return torch.nn.functional.silu(x @ w) * torch.sigmoid(x) + x
compiled = torch.compile(block, dynamic=True)
weak = variant != "strong"
sizes = (8,) if variant == "one" else (4, 8)
g = graphify(compiled, mode="FULL", sizes=sizes, axes=(tokens(), persistent()), progress=False, weak_outputs=weak)
g = g.capture(torch.randn(4, 64, device="cuda"), w)
for n in (8, 6, 3):
    x = torch.randn(n, 64, device="cuda")
    out = g(x, w)
    torch.cuda.synchronize()
    print(variant, n, (out - block(x, w)).abs().max().item(), flush=True)
