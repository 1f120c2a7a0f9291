"""Seeing every Python frame a thread starts, with the user's profiler and tracer left as they were.

`graphify.reads.code_ran` records which code a capture's run executed. Python offers two
per-thread hooks that see each new frame: the profile hook (`sys.setprofile`) and the trace
hook (`sys.settrace`), and the user's tools live there too. What `sys.getprofile()` and
`sys.gettrace()` show is a Python function (or method) for a hook set from Python, or the
object a hook set from C passed along, which is not one: installing it again through
`sys.setprofile` would make Python call it on every event ("'Profile' object is not callable",
which failed the capture and the profiling), and a callable one (a line profiler, a decorator
too) is no profile function either. So:
- a Python function in the profile hook (a hand-written profiler) is chained: it gets every event;
- cProfile before Python 3.12 (its `Profile` object) is paused while recording, then enabled
  again with its settings (`enable()`);
- another hook set from C (torch.profiler's Python tracer, `with_stack=True`, shown as a
  `TraceContext`) keeps the profile hook, and the frames are seen through the trace hook, chained
  to a Python function there (a debugger, coverage's Python tracer);
- where both hooks are held from C, `HooksHeldError`: first use runs the call eagerly this time.
A chained hook that sets itself again (coverage's tracer does, to run from C) is set back to
graphify's for the rest of the run, and becomes the user's again after.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable

from graphify.base.errors import HooksHeldError

__all__ = ["frames_started"]

_PYTHON_HOOKS = (types.FunctionType, types.MethodType)


def _from_python(hook) -> bool:
    """A hook set from Python: a function or method, which chaining can call as Python would."""
    return isinstance(hook, _PYTHON_HOOKS)


def _resumable(hook) -> bool:
    """A C profiler that `enable()` installs again (cProfile's `Profile`)."""
    return not _from_python(hook) and callable(getattr(hook, "enable", None))


@contextlib.contextmanager
def frames_started(seen: Callable):
    """Call `seen(frame)` for each Python frame this thread starts while inside."""
    profiler = sys.getprofile()
    if profiler is None or _from_python(profiler) or _resumable(profiler):
        with _through_profile(seen, profiler):
            yield
        return
    tracer = sys.gettrace()
    if tracer is not None and not _from_python(tracer):
        raise HooksHeldError(
            f"graphify records the Python a capture runs through sys.setprofile or sys.settrace, and both hold "
            f"hooks set from C that it cannot chain or set back ({type(profiler).__name__}, {type(tracer).__name__}); "
            "the call runs eagerly while they do: capture before starting the profiler or tracer, or after it stops")
    with _through_trace(seen, tracer):
        yield


@contextlib.contextmanager
def _through_profile(seen: Callable, profiler):
    chained = profiler if _from_python(profiler) else None

    def profile(frame, event, arg):
        if event == "call":
            seen(frame)
        if chained is not None:
            chained(frame, event, arg)
            if sys.getprofile() is not profile:
                sys.setprofile(profile)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(chained)
        if profiler is not None and chained is None:
            profiler.enable()  # cProfile's C hook, as it was set


@contextlib.contextmanager
def _through_trace(seen: Callable, tracer):
    def trace(frame, event, arg):
        if event == "call":
            seen(frame)
        if tracer is None:
            return None
        local = tracer(frame, event, arg)
        if sys.gettrace() is not trace:
            sys.settrace(trace)
        return local

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(tracer)
