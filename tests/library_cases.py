"""One CUDA library family per case, graphified; run as `python tests/library_cases.py NAME`
in a process of its own (a crash must fail one test, not kill the suite).

Prints `CAPTURED` (every size equals eager, or for random draws: fresh values of the
right shape), or `REJECTED <message>` (an UnsupportedOpError before CUDA saw the call),
then `USABLE` once a plain function captures and replays right afterwards."""

from __future__ import annotations

import sys

import torch

SIZES = (2, 4, 8)


def replayed_every_call(g, calls: int) -> None:
    """Every one of `calls` calls of `g` replayed a FULL graph (none ran eagerly)."""
    ran = {r.mode.value: r.calls for r in g.stats.by_mode()}
    assert ran == {"NONE": 0, "PIECEWISE": 0, "FULL": calls}, ran


def cupy_cases():
    import cupy as cp
    import cupyx.scipy.sparse as sp

    A = cp.asarray(torch.randn(16, 16).double().numpy()) + 16 * cp.eye(16)
    S = sp.random(16, 16, density=0.3, format="csr", dtype=cp.float64, random_state=0)
    return {
        "cupy-fft": (lambda x: cp.fft.fft(x, axis=-1).real, ()),
        "cupy-linalg-solve": (lambda x, A: cp.linalg.solve(A, x.T).T, (A,)),
        "cupy-linalg-norm": (lambda x: cp.linalg.norm(x, axis=-1), ()),
        "cupy-random": (lambda x: x + cp.random.standard_normal(x.shape), ()),
        "cupy-sparse": (lambda x, S: (S @ x.T).T, (S,)),
        "cupy-cub-cumsum": (lambda x: cp.cumsum(x, axis=-1), ()),
        "cupy-cub-sort": (lambda x: cp.sort(x, axis=-1), ()),
    }


def torch_cases():
    A = torch.randn(16, 16, dtype=torch.float64, device="cuda") + 16 * torch.eye(16, dtype=torch.float64, device="cuda")
    S = (torch.rand(16, 16, device="cuda", dtype=torch.float64) < 0.3).double().to_sparse_csr()  # reached by closure

    def mixed_fft(x):
        import cupy as cp

        return torch.from_dlpack(cp.fft.fft(cp.from_dlpack(x), axis=-1).real)

    def mixed_random(x):
        import cupy as cp

        return x + torch.from_dlpack(cp.random.standard_normal(tuple(x.shape)))

    return {
        "torch-fft": (lambda x: torch.fft.fft(x, dim=-1).real, ()),
        "torch-linalg-solve": (lambda x, A: torch.linalg.solve(A, x.T).T, (A,)),
        "torch-linalg-norm": (lambda x: torch.linalg.vector_norm(x, dim=-1), ()),
        "torch-random": (lambda x: x + torch.randn_like(x), ()),
        "torch-sparse": (lambda x: (S @ x.T).T, ()),
        "torch-cub-cumsum": (lambda x: torch.cumsum(x, dim=-1), ()),
        "torch-cub-sort": (lambda x: torch.sort(x, dim=-1).values, ()),
        "torch+cupy-fft": (mixed_fft, ()),
        "torch+cupy-random": (mixed_random, ()),
    }


def run(name: str) -> None:
    from graphify import UnsupportedOpError, graphify, persistent, static, tokens

    cupy_case = name.startswith("cupy-")
    fn, extra = (cupy_cases() if cupy_case else torch_cases())[name]
    if cupy_case:
        import cupy as cp

        make = lambda n: cp.asarray(torch.randn(n, 16, dtype=torch.float64).numpy())  # noqa: E731
    else:
        make = lambda n: torch.randn(n, 16, dtype=torch.float64, device="cuda")  # noqa: E731
    axes = (tokens(),) + tuple(persistent() if hasattr(e, "__dlpack__") or isinstance(e, torch.Tensor) else static() for e in extra)
    if name == "cupy-sparse":
        axes = (tokens(), static())  # a cupyx sparse matrix is an object, static by identity
    g = graphify(fn, mode="FULL", sizes=SIZES, axes=axes)
    try:
        g = g.capture(make(3), *extra)
    except UnsupportedOpError as exc:
        print("REJECTED", exc)
    else:
        for n in range(1, 9):
            x = make(n)
            got, want = g(x, *extra), fn(x, *extra)
            got_t, want_t = torch.as_tensor(got, device="cuda"), torch.as_tensor(want, device="cuda")
            assert got_t.shape == want_t.shape, (n, got_t.shape, want_t.shape)
            if "random" in name:
                again = torch.as_tensor(g(x, *extra), device="cuda")
                assert not torch.equal(again, got_t), "a random graph replayed the same draws"
            else:
                torch.testing.assert_close(got_t, want_t, rtol=1e-6, atol=1e-6)
        replayed_every_call(g, 8 * (2 if "random" in name else 1))
        print("CAPTURED")
    plain = graphify(lambda x: x * 2 + 1, mode="FULL", sizes=SIZES)
    x = torch.randn(5, 16, device="cuda")
    plain = plain.capture(x)
    torch.testing.assert_close(plain(x), x * 2 + 1)
    replayed_every_call(plain, 1)
    torch.cuda.synchronize()
    print("USABLE")


if __name__ == "__main__":
    run(sys.argv[1])
