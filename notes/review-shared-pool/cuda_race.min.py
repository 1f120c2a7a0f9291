import sys, threading, torch
import graphify.plan.pool as P
from graphify import graphify
mode = sys.argv[1]
if mode == 'own':
    P.PoolsByDevice.for_spec = classmethod(lambda cls, spec: None)

def f(x):
    return torch.relu(x.repeat(1, 64) - 0.5).sum(-1) + x[:, 0]
g = graphify(f)
gen = torch.Generator(device='cuda').manual_seed(0)
xs = {w: torch.rand(256, w, device='cuda', generator=gen) for w in (4096, 2048)}
want = {w: f(x) for w, x in xs.items()}
for w in xs:
    for _ in range(3):
        g(xs[w])
torch.cuda.synchronize()
pools = {id(b.capture.session.pool) for s in g._first_use.structures for b in s.branches.values()}
N = 200

def wrong(outs, w):
    return sum((not torch.allclose(o, want[w], rtol=0.0001, atol=0.01) for o in outs))
s1, s2 = (torch.cuda.Stream(), torch.cuda.Stream())
outs = {w: [] for w in xs}
for _ in range(N):
    for w, s in zip(xs, (s1, s2)):
        with torch.cuda.stream(s):
            outs[w].append(g(xs[w]))
torch.cuda.synchronize()
a = {w: wrong(o, w) for w, o in outs.items()}

def threads(own_stream):
    outs = {w: [] for w in xs}

    def work(w):
        s = torch.cuda.Stream() if own_stream else torch.cuda.current_stream()
        with torch.cuda.stream(s):
            for _ in range(N):
                outs[w].append(g(xs[w]))
    ts = [threading.Thread(target=work, args=(w,)) for w in xs]
    [t.start() for t in ts]
    [t.join() for t in ts]
    torch.cuda.synchronize()
    return {w: wrong(o, w) for w, o in outs.items()}
b, c = (threads(False), threads(True))
st = g.stats if hasattr(g, 'stats') else None
print(f'[{mode}] pools={len(pools)} of {N} calls per structure, wrong: one thread two streams {a}; two threads default stream {b}; two threads own streams {c}', flush=True)
