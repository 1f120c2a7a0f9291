"""Sim: two threads calling two call structures of ONE graphified callable replay graphs of
ONE shared Pool at the same time: nothing serialises calls across structures (the runtime
lock is per branch). Prints how many replays of the same pool overlapped."""
import sys, threading, time, torch
import graphify.plan.pool as P
from graphify import graphify, Options
from graphify.call import runtime as R

if len(sys.argv) > 1 and sys.argv[1] == "own":  # the behaviour before c9de78d: a pool per structure
    P.PoolsByDevice.for_spec = classmethod(lambda cls, spec: None)

def widened(x):
    return torch.relu(x.repeat(1, 64) - 0.5).sum(-1) + x[:, 0]

active, lock, overlaps = {}, threading.Lock(), [0]
orig = R.Runtime._replay
def spy(self, plan, *a, **k):
    pool = self.table.pool
    with lock:
        if any(p is pool and t != threading.get_ident() for t, p in active.items()):
            overlaps[0] += 1
        active[threading.get_ident()] = pool
    try:
        time.sleep(0.002)  # a replay in flight (on a GPU: kernels still running, clone not yet issued)
        return orig(self, plan, *a, **k)
    finally:
        with lock:
            active.pop(threading.get_ident(), None)
R.Runtime._replay = spy

g = graphify(widened, options=Options(backend="sim"))
xs = {w: torch.rand(4, w) for w in (48, 32)}
for w in xs:
    for _ in range(3):
        g(xs[w])
pools = {id(b.capture.session.pool) for s in g._first_use.structures for b in s.branches.values()}
bad = []
def worker(w):
    for _ in range(50):
        if not torch.allclose(g(xs[w]), widened(xs[w])):
            bad.append(w)
ts = [threading.Thread(target=worker, args=(w,)) for w in xs]
[t.start() for t in ts]; [t.join() for t in ts]
print(f"structures={len(g._first_use.structures)} distinct pools={len(pools)} "
      f"replays overlapping another thread's replay of the SAME pool={overlaps[0]} wrong={len(bad)}")
