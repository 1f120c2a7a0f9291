"""Every read of a device tensor's values by the host is refused as CUDA refuses it, on the
simulation too.

On a GPU such a read is a copy to the host, which a capture cannot hold: a graph would keep
the values read at capture. On the CPU simulation the tensors already live on the host and
most such reads (`.tolist()`, `.numpy()`, `np.asarray(t)`, `.cpu()`) dispatch no op, so
the simulation refuses the Tensor methods themselves (`graphify.backends.op_guard.HostReadGuard`).
Each kind below picks its answer from a value it reads on the host; fresh inputs move that
value, so a replay that kept the captured one would answer wrongly. First use runs such calls
eagerly with one warning naming the line; `capture()` refuses them.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from conftest import calls_by_mode, replayed
from graphify import CaptureError, Mode, Options, graphify

D = 8


def _rows(t: torch.Tensor) -> int:
    """How many of the first rows to keep: 1 + (how many entries of the first row are positive) % 3."""
    return 1 + int((t[0] > 0).sum()) % 3


READS = {  # kind -> fn(x) whose answer depends on a value read on the host
    "tolist": lambda x: x * sum(x[0, :2].tolist()),
    "numpy": lambda x: x * float(np.sum(x[0, :2].numpy(force=True))),
    "np.asarray": lambda x: x * float(np.asarray(x[0, :2]).sum()),
    "cpu": lambda x: x * x[0, 0].cpu().tolist(),
    "to('cpu')": lambda x: x + x[0, 0].to("cpu").tolist(),
    "bool": lambda x: x * 2 if x[0, 0] > 0 else x * 3,
    "int": lambda x: x * int(x[0, 0] > 0),
    "float": lambda x: x * float(x[0, 0]),
    "index": lambda x: x[: _rows(x)].sum(0, keepdim=True) * torch.ones_like(x),
    "format": lambda x: x * len(f"{x[0, 0]:.3f}"),
    "repr": lambda x: x * len(repr(x[0, 0])),
    "iterate, then use as numbers": lambda x: x * sum(v for v in x[0, :3].tolist() if v > 0),
    "iterate the tensor": lambda x: x * sum(int(v > 0) for v in x[0]),
}


def no_array_on(device: str, kind: str) -> None:
    if device == "cuda" and kind == "np.asarray":
        pytest.skip("np.asarray of a CUDA tensor raises in eager too (no __array__ on the device)")


def calls_of(fn, device: str):
    g = graphify(fn, options=Options(backend="sim" if device == "cpu" else "cuda"))
    got, want = [], []
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        for i in range(6):  # fresh inputs: the value read on the host moves between calls
            torch.manual_seed(100 + i)
            x = torch.randn(4, D, device=device)
            got.append(g(x))
            want.append(fn(x))
    return g, got, want, seen


@pytest.mark.parametrize("kind", sorted(READS))
def test_first_use_runs_a_host_read_eagerly_with_one_warning_naming_the_line(backend, kind):
    _, device = backend
    no_array_on(device, kind)
    g, got, want, seen = calls_of(READS[kind], device)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, msg=lambda m: f"call {i}: {m}")
    assert replayed(g) == 0, calls_by_mode(g)
    named = [w for w in seen if "test_host_reads.py" in str(w.message) and "host" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in seen]


@pytest.mark.parametrize("kind", sorted(READS))
def test_capture_refuses_a_host_read_naming_it(backend, kind):
    _, device = backend
    no_array_on(device, kind)
    g = graphify(READS[kind], sizes=(4,), options=Options(backend="sim" if device == "cpu" else "cuda"))
    with pytest.raises(CaptureError, match=r"host.*test_host_reads\.py"), torch.no_grad():
        g.capture(torch.randn(4, D, device=device))


def test_the_same_code_without_a_host_read_replays_graphs(backend):
    """The control: reading shapes, moving a tensor to its own device and iterating rows
    without reading values are no host reads; such calls replay and equal eager."""
    _, device = backend

    def fn(x):
        y = x.to(x.device) * x.shape[1]
        return torch.stack([row * 2 for row in y])

    g, got, want, seen = calls_of(fn, device)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert calls_by_mode(g)[Mode.FULL] >= 4
    assert not [w for w in seen if "host" in str(w.message)]


def test_a_host_tensor_made_in_the_function_is_refused_on_the_simulation_only_if_read():
    """The simulation cannot tell a host tensor from a device one (both live on the CPU), so it
    refuses the read either way: the call runs eagerly, which is slower than a GPU would be but
    never wrong. Tensors it only makes and uses on the device are not refused."""
    def reads(x):
        return x * torch.tensor([1.0, 2.0]).tolist()[1]

    g, got, want, _ = calls_of(reads, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert replayed(g) == 0
