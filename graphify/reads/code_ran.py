"""Which Python code a capture's runs executed: the code whose reads a replay relies on.

A graph stands in for the Python that ran when it was captured, so what a replay relies on
is what that Python read: the globals each executed function looked up, the closure cells
and defaults of executed functions, the methods that ran on each object. Names alone are a
poor guide (a model's code names `from_pretrained` and `get_config_dict`, which never run in
a forward); recording the runs is exact, as dynamo's tracing is. `CodeRan.recording()`
notes each Python code object the current thread starts, with the globals it runs against,
through the thread's profile or trace hook (`graphify.reads.call_hooks`: a profiler or
tracer the user runs keeps running). A capture makes its recorder
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
import threading

from graphify.reads.call_hooks import frames_started
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
        """Note the code every Python call on this thread starts, while inside
        (`graphify.reads.call_hooks`: the user's profiler and tracer left as they were)."""
        named, note = self.named, self.note

        def seen(frame):
            code = frame.f_code
            if id(code) not in named:
                note(code, frame.f_globals)

        with frames_started(seen):
            yield self

    @contextlib.contextmanager
    def collecting(self):
        """Make this the recorder `recording_now()` records into, on this thread, while inside."""
        before = getattr(_local, "ran", None)
        _local.ran = self
        try:
            yield self
        finally:
            _local.ran = before


def recording_now():
    """Record into the current recorder (`CodeRan.collecting`), if any, while inside."""
    ran = getattr(_local, "ran", None)
    return ran.recording() if ran is not None else contextlib.nullcontext()
