"""CuPy backend: structure B's failed first capture trims the SHARED MemoryPool
(session._undo -> Pool.trim -> MemoryPool.free_all_blocks), freeing the working memory of
structure A's live graph; A's next replay writes into memory CuPy hands to someone else."""
import sys, warnings, cupy as cp, torch
import graphify.plan.pool as P
from graphify import graphify
mode = sys.argv[1]
if mode == "own":
    P.PoolsByDevice.for_spec = classmethod(lambda cls, spec: None)
warnings.simplefilter("ignore")
W = cp.ones((32, 32), dtype=cp.float32)

def f(x):
    out = cp.maximum(cp.tile(x, (1, 64)) - 0.5, 0).sum(axis=1) + x[:, 0]
    if x.shape[1] == 32:  # structure B: cuBLAS, which CuPy refuses inside a capture
        out = out + (x @ W).sum(axis=1)
    return out

g = graphify(f)
xa = cp.random.rand(256, 4096, dtype=cp.float32)
xb = cp.random.rand(256, 32, dtype=cp.float32)
want = f(xa)
for _ in range(3):
    got = g(xa)
cp.cuda.Device().synchronize()
pool = g._first_use.structures[0].default.capture.session.pool
before = pool._handle.total_bytes()
ok_before = bool(cp.allclose(g(xa), want, rtol=1e-4, atol=1e-2))
for _ in range(3):
    g(xb)  # B: its capture fails (cuBLAS), runs eagerly
cp.cuda.Device().synchronize()
after = pool._handle.total_bytes()
baits = [cp.full(256 * 4096 * 64, 7.0, dtype=cp.float32) for _ in range(4)]  # eager memory, outside graphify
cp.cuda.Device().synchronize()
got = g(xa)  # A's graph replays
cp.cuda.Device().synchronize()
hit = [bool((b != 7.0).any()) for b in baits]
print(f"[{mode}] A's pool bytes before B's failed capture {before >> 20} MiB, after {after >> 20} MiB; "
      f"A correct before {ok_before}; after: A correct {bool(cp.allclose(got, want, rtol=1e-4, atol=1e-2))}, "
      f"unrelated eager arrays overwritten by A's replay {hit}; A replays={g.stats}", flush=True)
