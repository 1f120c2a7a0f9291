"""Host cost of a graphified call on CUDA: the shared pool's stream order (an event recorded
per call, a wait where the stream changed). Run with PYTHONPATH=<graphify tree>."""
import sys, time, torch, graphify
from graphify import graphify as gfy

def f(x):
    return torch.relu(x * 2 - 0.5).sum(-1)

g = gfy(f)
xs = [torch.rand(8, w, device="cuda") for w in (64, 32)]
for x in xs:
    for _ in range(3):
        g(x)
torch.cuda.synchronize()
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
def timed(label, n, body):
    for _ in range(200):
        body(0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        body(i)
    host = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    print(f"{graphify.__file__.split('/')[-3]:>8} {label:<34} {host * 1e6:7.1f} us/call")
timed("one structure, one stream", 5000, lambda i: g(xs[0]))
timed("two structures, one stream", 5000, lambda i: g(xs[i % 2]))
def two_streams(i):
    with torch.cuda.stream(s1 if i % 2 else s2):
        g(xs[0])
timed("one structure, two streams by turns", 5000, two_streams)
