"""What a failed capture raises: a `CaptureError` that names the call, the key that failed
and what was released, or an `UnsupportedOpError` naming the user's line and what to do."""

from __future__ import annotations

import re
import traceback

import torch

from graphify.base.errors import CaptureError, UnsupportedOpError
from graphify.backends.op_guard import library_frame

__all__ = ["as_capture_error"]


def as_capture_error(label: str, exc: Exception, done: int, total: int) -> CaptureError:
    if isinstance(exc, CaptureError) and str(exc).startswith(label):
        return exc  # already names the call (an in-place write, a pool on another device)
    key = getattr(exc, "graphify_key", None)
    where = f" at {key[0].value} graph {key[1]} ({done + 1} of {total})" if key else ""
    released = f"the {done} graph(s) captured before it were released; " if done else ""
    advice = "the callable you captured from is unchanged and still works"
    if isinstance(exc, torch.OutOfMemoryError):
        advice = (
            "out of device memory: capture fewer sizes or a smaller maximum (sizes=...), share one "
            "Pool between functions, or free memory first; " + advice
        )
    refused = _LIBRARY_REFUSED.search(str(exc)) if isinstance(exc, NotImplementedError) else None
    if refused is not None:  # CuPy checks the stream before calling the library: CUDA never saw it
        lib = refused.group(1)
        return UnsupportedOpError(
            f"{label}: capture failed{where}: {_user_frame(exc)} calls {lib}, which CuPy refuses inside a CUDA graph "
            f"capture; keep that call out of the graphified function (run it before or after the graphed part, or "
            f"make it a split op), or use torch's equivalent where it captures (torch.fft, torch.randn, "
            f"torch.linalg.*_ex); {released}{advice}"
        )
    cls = type(exc) if isinstance(exc, CaptureError) else CaptureError
    return cls(f"{label}: capture failed{where}: {type(exc).__name__}: {exc}; {released}{advice}")


_LIBRARY_REFUSED = re.compile(r"calling (cu[A-Za-z]+) API during stream capture is currently unsupported")


def _user_frame(exc: BaseException) -> str:
    """'file:line in function' of the innermost frame outside torch, CuPy and graphify:
    the user's call that raised."""
    found = "the function"
    for frame, line in traceback.walk_tb(exc.__traceback__):
        if not library_frame(frame):
            found = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{line} in {frame.f_code.co_name}"
    return found


