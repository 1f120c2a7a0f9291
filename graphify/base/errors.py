"""Errors graphify raises. Messages name the call and the argument and say what to do."""

from __future__ import annotations

__all__ = [
    "REPLACED_ADVICE",
    "GraphifyError", "CaptureError", "InputMismatchError", "PersistentSwapError", "UnsupportedOpError",
    "DispatchMismatchError", "StateChangedError", "HooksHeldError",
]


class GraphifyError(RuntimeError):
    """Base class of graphify's own errors."""


class CaptureError(GraphifyError):
    """A capture failed; the callable you captured from is unchanged and still usable."""


class UnsupportedOpError(CaptureError):
    """The function runs an op that cannot be captured in a CUDA graph."""


class InputMismatchError(TypeError):
    """An argument does not match what was captured (dtype, device, trailing shape, count)."""


class PersistentSwapError(GraphifyError):
    """A persistent argument (weights, KV cache) was replaced by another tensor."""


class DispatchMismatchError(GraphifyError):
    """Ranks of a tensor-parallel group chose different graphs for one call."""


class StateChangedError(GraphifyError):
    """A parameter or buffer the graphs read was rebound after capture."""


class StateReplacedError(CaptureError):
    """Each call changes what a static object or the closure holds: a Python value (a
    counter) or, with `replaced` set, a tensor replaced by a new one (transformers'
    DynamicCache grows with torch.cat). No graph can follow it; first-use capture runs calls
    that replace tensors eagerly, with one warning."""

    def __init__(self, message: str, replaced: bool = False):
        super().__init__(message)
        self.replaced = replaced


class HooksHeldError(CaptureError):
    """The thread's profile and trace hooks are both held by tools graphify cannot chain or set
    back (hooks set from C: torch.profiler's stack tracer beside a C tracer), so it cannot
    record the Python a capture runs. For now: first use runs such calls eagerly, with one
    warning, and captures once the tools have let go."""


class StaleReachError(StateChangedError):
    """A tensor or value a graph reads through a static object or the closure was replaced
    after capture (graphify.reads.reach); the graph would read the old one."""


# what to do where calls replace tensors a graph would read (transformers' DynamicCache grows so)
REPLACED_ADVICE = (
    "transformers' DynamicCache (generate()'s default) grows this way: pass cache_implementation=\"static\" "
    "to generate() (or a StaticCache as its cache), whose tensors are updated in place. Otherwise keep "
    "such state in tensors written in place, or leave this function ungraphified"
)
