"""The process-wide torch settings a call runs under that change what its kernels compute,
taken when graphs are captured and compared before every replay.

Graphs replay the kernels chosen at capture. A call made later under `torch.autocast`, another
default dtype, TF32 matmuls switched on or off, deterministic algorithms, or other attention
backends (`sdpa_kernel`, `torch.backends.cuda.enable_*_sdp`) or cuDNN's switches
(`torch.backends.cudnn.enabled`, `.allow_tf32`, `.deterministic`) would run other kernels eagerly,
so the graphs must not answer it. torch's own record of this state is dynamo's global-state
guard (what `torch.compile` checks before running compiled code: autocast, default dtype,
TF32 and reduced-precision reductions, deterministic algorithms, thread count, torch-function
state, grad mode); the attention backends' and cuDNN's switches are added here. Grad mode is left out:
graphs replay without autograd in either mode, and a call in grad mode is warned about
(`graphify.reads.table_reads`), not refused. So is the CPU thread count: a graph's kernels do not read
it; where it alone moved, the record is taken again. One compare in C++ and four flag reads: about a microsecond.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["GlobalState", "sdp_flags", "set_sdp_flags"]

_SDP = ("flash", "mem_efficient", "math", "cudnn")  # torch.backends.cuda.<name>_sdp_enabled()
_SDP_READS = tuple(getattr(torch.backends.cuda, f"{name}_sdp_enabled", lambda: None) for name in _SDP)
# cuDNN's switches (convolutions: Whisper's encoder, vision towers), which dynamo's guard leaves out
_CUDNN = ("enabled", "allow_tf32", "deterministic")
_CUDNN_READS = tuple(getattr(torch._C, f"_get_cudnn_{name}", lambda: None) for name in _CUDNN)


def _cudnn_flags() -> tuple:
    return tuple([read() for read in _CUDNN_READS])


def sdp_flags() -> tuple:
    """Which attention backends `scaled_dot_product_attention` may pick, in `_SDP`'s order."""
    return tuple([read() for read in _SDP_READS])


def set_sdp_flags(flags: tuple) -> None:
    """Enable the attention backends as `flags` (`sdp_flags()`) says: a compile worker traces
    under its caller's choice (the trace bakes the chosen kernel in)."""
    cuda = torch.backends.cuda
    for name, on in zip(_SDP, flags):
        enable = getattr(cuda, f"enable_{name}_sdp", None)
        if enable is not None and on is not None and getattr(cuda, f"{name}_sdp_enabled")() != on:
            enable(on)


def _guard():
    """Dynamo's global-state guard of the state now (None where this torch has none)."""
    try:
        return torch._C._dynamo.guards.GlobalStateGuard()
    except (AttributeError, RuntimeError):
        return None


def _python_state() -> tuple:
    """The fallback without dynamo's guard: the same settings read from Python."""
    matmul = torch.backends.cuda.matmul
    return (
        tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cuda", "cpu")),
        torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(), matmul.allow_tf32,
        matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction,
    )


def _guards() -> tuple:
    """Dynamo's guard taken with grad mode on and off (or the Python fallback, twice)."""
    with torch.set_grad_enabled(True):
        with_grad = _guard()
    with torch.set_grad_enabled(False):
        without_grad = _guard()
    if with_grad is None or without_grad is None:
        return _python_state(), _python_state()
    return with_grad, without_grad


@attrs.define(eq=False)
class GlobalState:
    """The settings at capture: dynamo's guard taken in each grad mode (so the call's own
    grad mode never fails it), or the Python fallback, and the attention backends' and cuDNN's
    switches."""

    label: str
    with_grad: object
    without_grad: object
    sdp: tuple
    cudnn: tuple

    @classmethod
    def take(cls, label: str) -> "GlobalState":
        return cls(label, *_guards(), sdp_flags(), _cudnn_flags())

    def same(self) -> bool:
        """Whether a call now runs under the settings of the capture."""
        guard = self.with_grad if torch.is_grad_enabled() else self.without_grad
        now = guard == _python_state() if type(guard) is tuple else guard.check()
        if not now and type(guard) is not tuple and guard.reason().split() == ["num_threads"]:
            self.with_grad, self.without_grad = _guards()  # only the thread count moved: not a kernel's input
            now = True
        return now and sdp_flags() == self.sdp and _cudnn_flags() == self.cudnn

    def describe(self) -> str:
        """What differs now, in torch's words where it has them."""
        for what, names, then, now in (("the attention backends enabled", _SDP, self.sdp, sdp_flags()),
                                       ("cuDNN's switches", _CUDNN, self.cudnn, _cudnn_flags())):
            if now != then:
                moved = [f"{name} ({a} -> {b})" for name, a, b in zip(names, then, now) if a != b]
                return f"{what}: " + ", ".join(moved)
        guard = self.with_grad if torch.is_grad_enabled() else self.without_grad
        if isinstance(guard, tuple):
            return "autocast, the default dtype, TF32 or deterministic algorithms"
        reason = guard.reason() if not guard.check() else ""
        return reason.strip() or "dynamo's global state"

    def error_text(self) -> str:
        return (
            f"{self.label}: torch's process-wide setting {self.describe()} differs from the one the graphs were "
            "captured under (autocast, default dtype, TF32, deterministic algorithms, attention backends, cuDNN). "
            "Graphs replay the kernels chosen then, so they cannot answer this call: call under the capture's "
            "settings, or capture again"
        )
