"""stall.py (review 2) with the slow runs in the warm-ups only (a compile, an autotune), not
in the capture run (which on CUDA records and runs nothing). Run with PYTHONPATH=<tree>."""
import threading, time, torch, graphify
from graphify.backends.sim import taping
from graphify import Options, graphify as gfy

slow = threading.Event()
def f(x):
    if x.shape[1] == 32 and slow.is_set() and not taping():
        time.sleep(0.25)                      # a slow warm-up/capture run (compile, big prefill)
    return torch.relu(x.repeat(1, 4) - 0.5).sum(-1)

g = gfy(f, options=Options(backend="sim"))
a, b = torch.rand(4, 48), torch.rand(4, 32)
for _ in range(3): g(a)                       # A: seen, captured, replayed
g(b)                                          # B: first sighting (eager)
lat, stop = [], threading.Event()
def caller_a():
    while not stop.is_set():
        t = time.perf_counter(); g(a); lat.append(time.perf_counter() - t)
t2 = threading.Thread(target=caller_a); t2.start(); time.sleep(0.05)
slow.set(); t0 = time.perf_counter(); g(b); cap = time.perf_counter() - t0; slow.clear()   # B captured here
stop.set(); t2.join()
print(f"{graphify.__file__.split('/')[2]}: B's capturing call {cap:.2f} s; A's calls meanwhile: "
      f"{len(lat)}, slowest {max(lat)*1e3:.0f} ms")
