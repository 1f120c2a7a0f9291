"""Seeing every Python frame a thread starts, with the user's profiler and tracer left as they were.

`graphify.reads.code_ran` records which code a capture's run executed. Python offers two
per-thread hooks that see each new frame: the profile hook (`sys.setprofile`) and the trace
hook (`sys.settrace`), and the user's tools live there too:
- a Python function in the profile hook (a hand-written profiler) is chained: it gets every event;
- cProfile before Python 3.12 holds the profile hook from C, shown by `sys.getprofile()` as its
  `Profile` object: paused while recording, then enabled again with its settings (`enable()`).
  `sys.setprofile(profile_object)` would install the object as a Python function, called on
  every event: "'Profile' object is not callable", which failed the capture and the profiling;
- a C hook that cannot be enabled again (torch.profiler's Python tracer, `with_stack=True`,
  shown as a `TraceContext`) keeps the profile hook: the frames are seen through the trace hook,
  chained to a Python tracer there (a debugger, coverage's tracer);
- where both hooks hold C hooks neither can be set back: `CaptureError`, and the call runs eagerly.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

from graphify.base.errors import CaptureError

__all__ = ["frames_started"]


def _resumable(hook) -> bool:
    """A C profiler that `enable()` installs again (cProfile's `Profile`)."""
    return callable(getattr(hook, "enable", None))


@contextlib.contextmanager
def frames_started(seen: Callable):
    """Call `seen(frame)` for each Python frame this thread starts while inside."""
    profiler = sys.getprofile()
    if profiler is None or callable(profiler) or _resumable(profiler):
        with _through_profile(seen, profiler):
            yield
        return
    tracer = sys.gettrace()
    if tracer is not None and not callable(tracer):
        raise CaptureError(
            f"graphify records the Python a capture runs through sys.setprofile or sys.settrace, and both hold "
            f"hooks set from C that cannot be set back ({type(profiler).__name__}, {type(tracer).__name__}); "
            "capture outside the profiler or tracer (graphify(...).capture(...) before it starts)")
    with _through_trace(seen, tracer):
        yield


@contextlib.contextmanager
def _through_profile(seen: Callable, profiler):
    chained = profiler if callable(profiler) else None

    def profile(frame, event, arg):
        if event == "call":
            seen(frame)
        if chained is not None:
            chained(frame, event, arg)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(chained)
        if chained is None and profiler is not None:
            profiler.enable()  # cProfile's C hook, as it was set


@contextlib.contextmanager
def _through_trace(seen: Callable, tracer):
    def trace(frame, event, arg):
        if event == "call":
            seen(frame)
        return tracer(frame, event, arg) if tracer is not None else None

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(tracer)
