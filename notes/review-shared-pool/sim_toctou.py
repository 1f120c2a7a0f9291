"""Sim: the window between GraphPool.for_capture() and the capture's start (torch_cuda.py:
for_capture, usage() snapshot, cuBLAS clear, then capture_begin). Another thread dropping the
structure whose graphs are the shared pool's last live ones lands in it (emulated here by
doing that drop inside the window). The capture then goes into a pool id whose graphs are all
gone: sim raises as torch's allocator asserts (use_count > 0); with a pool per structure
(argv 'own') B's pool never held A's graphs."""
import gc, sys, torch, warnings
import graphify.plan.pool as P
from graphify import graphify, Options
from graphify.backends.graph_pool import GraphPool

if len(sys.argv) > 1 and sys.argv[1] == "own":
    P.PoolsByDevice.for_spec = classmethod(lambda cls, spec: None)

def widened(x):
    return torch.relu(x.repeat(1, 64) - 0.5).sum(-1) + x[:, 0]

g = graphify(widened, options=Options(backend="sim"))
xa, xb = torch.rand(4, 48), torch.rand(4, 32)
for _ in range(3):
    g(xa)
fu = g._first_use
a = fu.structures[0]
orig = GraphPool.for_capture
def window(self):
    pid = orig(self)
    if fu.structures and a in fu.structures and a.graphs:  # "thread 2": A superseded / stale / purged
        fu._drop(a)
        gc.collect()
    return pid
GraphPool.for_capture = window
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import logging; logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
    for _ in range(3):
        out = g(xb)
print("B equal to eager:", torch.allclose(out, widened(xb)),
      "| B graphs:", sum(s.graphs for s in fu.structures if s is not a))
for m in w:
    print("WARN", str(m.message)[:300])
