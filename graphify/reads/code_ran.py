"""Which Python code a capture's runs executed: the code whose reads a replay relies on.

A graph stands in for the Python that ran when it was captured, so what a replay relies on
is what that Python read: the globals each executed function looked up, the closure cells
and defaults of executed functions, the methods that ran on each object. Names alone are a
poor guide (a model's code names `from_pretrained` and `get_config_dict`, which never run in
a forward); recording the runs is exact, as dynamo's tracing is. `CodeRan.recording()`
notes each Python code object the current thread starts, with the globals it runs against,
through `sys.setprofile` (chained to a Python profiler already set; a C profiler such as
cProfile's before Python 3.12 is paused and re-enabled, `_restore_profiler`). A capture makes its recorder
current (`collecting()`) and the first run of each capture, the one under the op guard,
records (`recording_now()`): it runs the function as written (a compiled function's eager
original), so what it calls is seen, and compiled code never runs under the profiler
(dynamo then kept its compiled graphs alive past `torch._dynamo.reset()`).

Code of torch, graphify and Python's standard library is left out (read by identity, never
walked), and code objects are kept by id with the names they look up, never themselves:
torch.compile hangs its compiled graphs on the code objects it traced, and holding those
would keep them alive past `torch._dynamo.reset()`. (An id reused by new code only makes
the walk read a little more.)
"""

from __future__ import annotations

import contextlib
import sys
import threading

from graphify.reads.code_names import code_names, library_module

__all__ = ["CodeRan", "recording_now"]

_local = threading.local()


class CodeRan:
    """The code seen starting: `codes`, id(code) -> (its qualified name, the names it looks
    up, its globals dict), for code outside torch, graphify and the standard library; and
    `names`, every name any code seen looks up (which attributes of an object a call can read)."""

    def __init__(self):
        self.codes: dict[int, tuple] = {}
        self.names: set[str] = set()  # every name any code that ran (torch's too) looks up
        self.named: set[int] = set()  # ids of the code whose names are in `names`

    def __contains__(self, code) -> bool:
        return id(code) in self.codes

    def __len__(self) -> int:
        return len(self.codes)

    def update(self, other: "CodeRan") -> None:
        self.codes.update(other.codes)
        self.names |= other.names
        self.named |= other.named

    def new_in(self, other: "CodeRan") -> bool:
        """Whether `other` saw code this one did not."""
        return any(key not in self.named for key in other.named)

    def note(self, code, g: dict) -> None:
        if id(code) in self.named:
            return
        self.named.add(id(code))
        names = code_names(code)
        self.names |= names
        if not library_module(g.get("__name__")):
            self.codes[id(code)] = (getattr(code, "co_qualname", code.co_name), names, g)

    @contextlib.contextmanager
    def recording(self):
        """Note the code every Python call on this thread starts, while inside."""
        named, note = self.named, self.note
        previous = sys.getprofile()
        chained = previous if callable(previous) else None  # a C profiler has its events back afterwards

        def profile(frame, event, arg):
            if event == "call":
                code = frame.f_code
                if id(code) not in named:
                    note(code, frame.f_globals)
            if chained is not None:
                chained(frame, event, arg)

        sys.setprofile(profile)
        try:
            yield self
        finally:
            _restore_profiler(previous)

    @contextlib.contextmanager
    def collecting(self):
        """Make this the recorder `recording_now()` records into, on this thread, while inside."""
        before = getattr(_local, "ran", None)
        _local.ran = self
        try:
            yield self
        finally:
            _local.ran = before


def _restore_profiler(previous) -> None:
    """Give the thread back the profiler `sys.getprofile()` returned before recording. A Python
    function goes back through `sys.setprofile`. cProfile's profiler before Python 3.12 is a C
    hook that `sys.getprofile()` shows as its `Profile` object, which `sys.setprofile` would
    install as a Python function and call on every event ("'Profile' object is not callable",
    which failed the capture and every later call's profiling): it re-installs its own hook
    with `enable()`, its settings kept. It saw none of the recorded run's calls."""
    if previous is None or callable(previous):
        sys.setprofile(previous)
        return
    sys.setprofile(None)
    enable = getattr(previous, "enable", None)
    if callable(enable):
        enable()


def recording_now():
    """Record into the current recorder (`CodeRan.collecting`), if any, while inside."""
    ran = getattr(_local, "ran", None)
    return ran.recording() if ran is not None else contextlib.nullcontext()
