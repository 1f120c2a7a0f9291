"""A function that writes a closure tensor in place on every call (a KV cache or step counter
held by the module, not passed in). Thread T2 calls structure A (graphs) in a loop while T1 opens
structure B, whose warm-up runs slowly after its write. The state keeper undoes the warm-up's
write by putting back what the tensor held before it: every write A's replays made meanwhile
is undone too. Each call adds exactly 1, so the counter must equal the number of calls.
With the argument `view` (review 5's variant): outputs="view", so structures keep pools of their
own, each runtime has its own call lock and a restoring capture holds off none of the other
structures' calls: the race is still there (as on main). PYTHONPATH=<tree>."""
import sys, threading, time, warnings
import torch
import graphify
from graphify import Options, graphify as gfy
from graphify.backends import sim

counter = torch.zeros(1)
slow = threading.Event()

def widened(x):
    return torch.relu(x.repeat(1, 64) - 0.5).sum(-1) + x[:, 0]

def fn(x):
    counter.add_(1)                      # the call's own state, advanced once per call
    if slow.is_set() and not sim.taping() and x.shape[1] == 32:
        time.sleep(0.4)                  # B's warm-up (a compile, an autotune) after its write
    return widened(x)

g = gfy(fn, options=Options(backend="sim", outputs="view" if sys.argv[1:] == ["view"] else "copy"))
a, b = torch.rand(4, 48), torch.rand(4, 32)
calls = 0
for _ in range(4):
    g(a); calls += 1
slow.set()
done = threading.Event()
t2_calls = [0]
def loop():
    while not done.is_set():
        g(a); t2_calls[0] += 1
t = threading.Thread(target=loop); t.start()
time.sleep(0.05)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _ in range(3):
        g(b); calls += 1
done.set(); t.join()
calls += t2_calls[0]
graphs = sum(s.graphs for s in g._first_use.structures)
print(f"{graphify.__file__.split('/')[-3]}: calls={calls} counter={int(counter.item())} lost={calls - int(counter.item())} graphs={graphs}")
