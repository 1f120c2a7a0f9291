"""Why, on the shared-pool branch (H200, torch 2.11), a structure met after an invalidated
capture never replays (test_an_invalidated_cuda_capture_answers_as_eager_and_later_captures_work:
3 replays, not 5). Prints every warning (none deduplicated) and each call's mode. Run from the
tree to test: `python3 notes/device/invalidated_then_capture.py` (main has a pool per structure)."""
import logging, warnings, sys, torch
sys.path.insert(0, "tests")
from conftest import calls_by_mode, replayed
from graphify import graphify
warnings.simplefilter("always")
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
on = [False]
def widened(x): return torch.relu(x.repeat(1, 8) - 0.5).sum(-1)
def fn(x):
    if on[0] and x.shape[1] == 2048 and torch.cuda.is_current_stream_capturing():
        x.sum().item()
    return widened(x)
g = graphify(fn)
gen = torch.Generator(device="cuda").manual_seed(12)
a, b, c = (torch.rand(256, w, device="cuda", generator=gen) for w in (4096, 2048, 1024))
for _ in range(3): g(a)
on[0] = True
for _ in range(2): g(b); print("b", dict(calls_by_mode(g)), flush=True)
on[0] = False
g._first_use.warned.clear()  # graphify warns once per kind of failure: let a failure of c's capture warn too
for i in range(3):
    for name, x in (("c", c), ("a", a)):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ok = torch.allclose(g(x), widened(x), rtol=1e-4, atol=1e-2)
        print(name, i, "right" if ok else "WRONG", "replayed", replayed(g), [str(m.message)[:300] for m in w], flush=True)
