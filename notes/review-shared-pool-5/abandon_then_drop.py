"""After an invalidated capture (B), C is captured into the same id as A (one pool), C is
dropped, and D still captures (review 4 found D refused at b9f6ad3: abandon() left the pool
counting the old id's graphs against the new one). PYTHONPATH=<tree>."""
import gc, logging, threading, warnings
import torch
from graphify import Options, graphify
from graphify.backends import sim

logging.basicConfig(level=logging.INFO)
failing = threading.Event()

def widened(x):
    return torch.relu(x.repeat(1, 64) - 0.5).sum(-1) + x[:, 0]

def fn(x):
    if failing.is_set() and sim.taping():
        raise RuntimeError("an invalidated capture")
    return widened(x)

g = graphify(fn, options=Options(backend="sim"))
fu = g._first_use
a, b, c, d = (torch.rand(4, w) for w in (48, 32, 40, 24))
for _ in range(3): g(a)
pool = next(iter(fu.structures)).branches
handle = next(iter(fu.structures)).default.capture.session.pool._handle
print("A captured, id", handle.id, "live", handle.live)
failing.set()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _ in range(2): g(b)
failing.clear()
print("B failed; id", handle.id, "live", handle.live)
for _ in range(3): g(c)
print("C captured into id", handle.id, "live", handle.live, "graphs tracked", len(handle._graphs))
sc = next(s for s in fu.structures if s.default.capture.session.example[0].shape[1] == 40)
fu._drop(sc); del sc; gc.collect()
print("C dropped: id", handle.id, "live", handle.live, "tracked", len(handle._graphs),
      "| sim says id released:", handle.id in sim.SimGraph._released)
for _ in range(3):
    out = g(d)
torch.testing.assert_close(out, widened(d))
sd = [s for s in fu.structures if s.default.capture.session.example[0].shape[1] == 24]
print("D graphs:", sum(s.graphs for s in sd), "(0 = D's capture failed, its calls run eagerly)")
print("stats:", g.stats if hasattr(g, "stats") else "")
