"""A capture under a profiler the user runs: graphify records which Python code a capture ran
through `sys.setprofile` (`graphify.reads.code_ran`), where profilers live too. A Python
profiler keeps its events and is set again after; cProfile's C hook (before Python 3.12, where
`sys.getprofile()` shows it as its `Profile` object) is paused and enabled again. Either way
the call replays graphs with eager's answers, and the profiler goes on profiling."""

from __future__ import annotations

import cProfile
import pstats
import sys
import warnings

import attrs
import pytest
import torch

from graphify import Options, graphify
from graphify.reads.code_ran import CodeRan


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def after_the_capture(x):
    return x.sum()


def _replayed(fn) -> int:
    return sum(r.calls for r in fn.stats.by_mode() if r.mode.value != "NONE")


def _graphified(backend):
    name, device = backend
    torch.manual_seed(5)
    model = Net().to(device).eval()
    return model, graphify(model, options=attrs.evolve(Options(), backend=name)), device


def _checked_calls(model, fn, device, calls=4):
    with torch.inference_mode():
        for _ in range(calls):
            x = torch.randn(4, 16, device=device)
            torch.testing.assert_close(fn(x), model(x), rtol=0, atol=0)


def test_a_python_profiler_keeps_its_events_and_is_set_again(backend):
    """End to end: the first calls under a Python profiler capture and replay, and the
    profiler is set again after (what the recorded run passes on: the tests below)."""
    model, fn, device = _graphified(backend)
    seen = []

    def profiler(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)

    sys.setprofile(profiler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a failed capture warns: none may
            _checked_calls(model, fn, device)
        assert sys.getprofile() is profiler
        after_the_capture(torch.ones(2))
    finally:
        sys.setprofile(None)
    assert _replayed(fn) > 0
    assert "forward" in seen  # the capture's recorded run, passed on
    assert "after_the_capture" in seen  # a call after the capture: the profiler is set again


def test_cprofile_running_around_the_first_calls_neither_fails_the_capture_nor_stops(backend):
    model, fn, device = _graphified(backend)
    prof = cProfile.Profile()
    prof.enable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _checked_calls(model, fn, device)
        after_the_capture(torch.ones(2))
    finally:
        prof.disable()
    assert _replayed(fn) > 0
    names = {func[2] for func in pstats.Stats(prof).stats}
    assert "after_the_capture" in names  # profiled after the capture: its hook is back


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="cProfile uses sys.monitoring from Python 3.12, not sys.setprofile")
def test_a_c_profiler_is_enabled_again_with_its_settings():
    prof = cProfile.Profile(builtins=False)
    prof.enable()
    try:
        assert sys.getprofile() is prof
        with CodeRan().recording() as ran:
            after_the_capture(torch.ones(2))
        assert sys.getprofile() is prof
        len([1, 2])  # a builtin: left out, as the profiler was made to
    finally:
        prof.disable()
    assert any(code[0] == "after_the_capture" for code in ran.codes.values())  # (qualified name, names, globals)
    names = {func[2] for func in pstats.Stats(prof).stats}
    assert "<built-in method builtins.len>" not in names


def test_torch_profiler_with_stacks_keeps_its_hook_and_the_call_replays(backend):
    """torch.profiler's Python tracer holds the profile hook from C (`TraceContext`), which
    cannot be set back: the capture's run is seen through the trace hook instead."""
    model, fn, device = _graphified(backend)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, with_stack=True):
        hook = sys.getprofile()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _checked_calls(model, fn, device)
        assert sys.getprofile() is hook and sys.gettrace() is None  # its hook never left
    assert hook is not None and not callable(hook)
    assert _replayed(fn) > 0


def test_a_python_tracer_beside_a_c_profiler_keeps_its_events(backend):
    model, fn, device = _graphified(backend)
    seen = []

    def tracer(frame, event, arg):
        seen.append(frame.f_code.co_name)
        return None  # no line events

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True):
        sys.settrace(tracer)
        try:
            _checked_calls(model, fn, device)
            assert sys.gettrace() is tracer
            after_the_capture(torch.ones(2))
        finally:
            sys.settrace(None)
    assert _replayed(fn) > 0 and "forward" in seen and "after_the_capture" in seen


def test_hooks_set_from_c_in_both_places_run_calls_eagerly_while_they_hold_them(backend, monkeypatch):
    """Neither hook can be chained or set back: the capture is refused, the call runs eagerly
    with one warning naming the fix, both hooks are left alone, and once they let go the next
    calls capture and replay."""
    from graphify.reads import call_hooks

    class FromC:  # what sys.getprofile() and sys.gettrace() show for a hook set from C: not a function
        pass

    monkeypatch.setattr(call_hooks.sys, "getprofile", lambda: FromC())
    monkeypatch.setattr(call_hooks.sys, "gettrace", lambda: FromC())
    model, fn, device = _graphified(backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _checked_calls(model, fn, device, calls=3)
    monkeypatch.undo()
    messages = [str(w.message) for w in caught]
    assert _replayed(fn) == 0
    assert len(messages) == 1 and "capture before starting the profiler or tracer" in messages[0], messages
    assert sys.getprofile() is None and sys.gettrace() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _checked_calls(model, fn, device, calls=3)
    assert _replayed(fn) >= 2  # captured once the hooks were free


def f_recorded():
    return g_recorded() + 1


def g_recorded():
    return 1


def _recorded_under(install, uninstall):
    """What `CodeRan().recording()` and the user's hook (installed by `install`) each saw of
    a call made inside the recording only."""
    from graphify.reads.code_ran import CodeRan

    user = []
    install(user)
    try:
        with CodeRan().recording() as ran:
            f_recorded()
    finally:
        uninstall()
    return {code[0] for code in ran.codes.values()}, user


def test_a_python_profiler_is_chained_through_the_recorded_run():
    def install(user):
        sys.setprofile(lambda frame, event, arg: user.append(frame.f_code.co_name) if event == "call" else None)

    recorded, user = _recorded_under(install, lambda: sys.setprofile(None))
    assert {"f_recorded", "g_recorded"} <= recorded and {"f_recorded", "g_recorded"} <= set(user)


def test_beside_torch_profilers_stacks_frames_are_seen_through_the_trace_hook_chained():
    """A tracer that sets itself again on every call (coverage's does, to run from C) keeps
    its events, and graphify keeps seeing frames after it did."""
    def install(user):
        def tracer(frame, event, arg):
            user.append(frame.f_code.co_name)
            sys.settrace(tracer)  # as coverage's tracer does
            return None
        install.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True)
        install.profile.__enter__()
        sys.settrace(tracer)

    def uninstall():
        sys.settrace(None)
        install.profile.__exit__(None, None, None)

    recorded, user = _recorded_under(install, uninstall)
    assert {"f_recorded", "g_recorded"} <= recorded and {"f_recorded", "g_recorded"} <= set(user)


def test_a_callable_hook_from_c_is_never_called_as_a_tracer(monkeypatch):
    """A line profiler sets the trace hook from C with its object, a decorator and so callable,
    but no trace function: beside another C hook, recording refuses rather than call it."""
    from graphify.base.errors import HooksHeldError
    from graphify.reads import call_hooks

    calls = []

    class Decorator:  # callable, not a function
        def __call__(self, fn):
            calls.append(fn)
            return fn

    class FromC:
        pass

    monkeypatch.setattr(call_hooks.sys, "getprofile", lambda: FromC())
    monkeypatch.setattr(call_hooks.sys, "gettrace", lambda: Decorator())
    with pytest.raises(HooksHeldError, match="both hold hooks set from C"):
        with call_hooks.frames_started(lambda frame: None):
            f_recorded()
    assert calls == []
