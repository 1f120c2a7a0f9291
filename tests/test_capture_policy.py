"""The warm-up policy per key (graphify.capture.capturers): what runs eagerly before each capture.

Start-up speed comes from skipping, at every key after a mode's first, what the batch size
cannot change; these tests pin down exactly what is skipped and what is not, with a fake
backend that records its calls (the GPU and simulation suites check the graphs' outputs).
"""

from __future__ import annotations

import contextlib

import attrs
import pytest

from graphify import BatchDescriptor
from graphify.capture.capturers import CaptureSettings, KeyCapture, mode_capturers
from graphify.base.modes import Mode
from graphify.backends import Captured
from graphify.backends.interface import CompiledCode


class FakeBackend:
    def __init__(self, name="cuda"):
        self.name, self.calls = name, []

    def capture(self, fn, args, *, pool, warmups, weak_outputs, stream=None, guard=True, keeper=None):
        # whether the warm-ups' first run would be recorded again (not while a record covers them)
        recorded = keeper is not None and warmups > 0 and not keeper.covered
        self.calls.append({"fn": fn, "warmups": warmups, "guard": guard, "keeper": keeper, "recorded": recorded,
                           "compiled_code": isinstance(fn, CompiledCode)})
        return Captured(lambda: None, None, None, 0)


class FakeKeeper:
    def __init__(self):
        self.recorded, self.restores, self.covered = [], 0, False

    def record_writes(self, fn, *args):
        if not self.covered:
            self.recorded.append((fn, args))
        return fn(*args)

    @contextlib.contextmanager
    def covering(self):
        self.covered = True
        try:
            yield
        finally:
            self.covered = False

    def restore(self):
        self.restores += 1

    def forget(self):
        pass


@attrs.define
class FakeSplit:
    compiled: bool = False
    pieces_write_outside: bool = False
    calls: list = attrs.field(factory=list)

    def capture_pieces(self, backend, args, **kw):
        self.calls.append(kw)
        return Captured(lambda n, r: None, None, None, 0, sized=True)


class FakeSchedule:
    def __init__(self):
        self.replays = []

    def replay(self, n, r, dispatch=False):
        self.replays.append((n, r, dispatch))


def fn(*args):
    return None


def probe(*args):
    return "probed"


def eager_twin(*args):
    """What `prepare` pairs a compiled split function with: the function as written."""
    return None


KEY = BatchDescriptor(8, 8, True)


def capture(capturer, keeper, first, sibling=None, key=KEY):
    return capturer((), KeyCapture(key, keeper, first, probe, sibling), CaptureSettings(None, 1, False))


def test_an_unsplit_full_function_is_guarded_and_warmed_up_at_every_key():
    backend = FakeBackend()  # Python that may branch on its batch size: no key can vouch for another
    full = mode_capturers(backend, fn, None)[Mode.FULL]
    capture(full, FakeKeeper(), first=True)
    capture(full, FakeKeeper(), first=False)
    assert [(c["guard"], c["warmups"]) for c in backend.calls] == [(True, 1), (True, 1)]


def test_a_split_function_without_a_same_size_schedule_skips_only_the_guard_after_its_first_key():
    backend = FakeBackend()  # traced into fixed ATen graphs: the same ops at every size
    full = mode_capturers(backend, fn, None, FakeSplit())[Mode.FULL]
    capture(full, FakeKeeper(), first=True)
    capture(full, FakeKeeper(), first=False)
    assert [(c["guard"], c["warmups"]) for c in backend.calls] == [(True, 1), (False, 1)]


def sibling_of(key: BatchDescriptor, schedule) -> object:
    """The PIECEWISE entry captured for `key`'s token count (its mixed-batch form)."""
    return type("Entry", (), {"graph": schedule, "key": key.relaxed()})()


def test_full_of_a_split_function_warms_up_through_the_same_size_piecewise_schedule():
    backend, keeper, schedule = FakeBackend(), FakeKeeper(), FakeSchedule()
    key = BatchDescriptor(24, 8, True)  # 3 query tokens per request: 8 request rows, not 24
    sibling = sibling_of(key, schedule)
    full = mode_capturers(backend, fn, None, FakeSplit())[Mode.FULL]
    capture(full, keeper, first=False, sibling=sibling, key=key)
    assert schedule.replays == [(24, 8, True)]  # split ops through the dispatcher: the keeper sees them
    assert keeper.recorded and keeper.restores == 1
    assert backend.calls[-1]["warmups"] == 0 and backend.calls[-1]["guard"] is False
    capture(full, keeper, first=True, sibling=sibling)  # the first FULL key still runs the guarded protocol
    assert backend.calls[-1]["guard"] is True and backend.calls[-1]["warmups"] >= 1


def test_full_of_a_split_function_captures_straight_away_where_the_schedule_ran_its_very_shapes():
    backend, keeper, schedule = FakeBackend(), FakeKeeper(), FakeSchedule()
    key = BatchDescriptor(8, 8, True)  # decode: one token per request, as many request rows as the schedule's
    full = mode_capturers(backend, fn, None, FakeSplit())[Mode.FULL]
    capture(full, keeper, first=False, sibling=sibling_of(key, schedule), key=key)
    assert schedule.replays == [] and keeper.recorded == []
    assert backend.calls[-1]["warmups"] == 0 and backend.calls[-1]["guard"] is False


@pytest.mark.parametrize("rows", [8, 3])
def test_full_of_compiled_pieces_warms_up_twice_even_beside_a_same_size_schedule(rows):
    """The schedule's capture never ran the compiled code eagerly at this key's shapes;
    a FULL graph captured without that run replayed ~10% slower on the H100. One replay
    of the schedule at the key's shapes learns what the warm-ups write, instead of a
    recorded eager run of the whole function."""
    backend, keeper, schedule = FakeBackend(), FakeKeeper(), FakeSchedule()
    key = BatchDescriptor(8, rows, True)
    full = mode_capturers(backend, fn, eager_twin, FakeSplit(compiled=True))[Mode.FULL]  # as prepare() builds it
    capture(full, keeper, first=False, sibling=sibling_of(key, schedule), key=key)
    assert schedule.replays == [(8, rows, True)]  # split ops through the dispatcher, at this key's rows
    assert [f for f, _ in keeper.recorded] == [schedule.replay] and keeper.restores == 1
    last = backend.calls[-1]
    assert last["warmups"] == 2 and last["guard"] is False and last["recorded"] is False


@pytest.mark.parametrize("compiled", [False, True])
def test_a_schedule_stands_in_for_no_warm_up_where_graph_pieces_write_outside_state(compiled):
    """Replaying graph pieces writes for real and unrecorded: where a piece writes an input
    or a closed-over tensor, FULL keys warm up eagerly with their first run recorded."""
    backend, keeper, schedule = FakeBackend(), FakeKeeper(), FakeSchedule()
    key = BatchDescriptor(24, 8, True)
    split = FakeSplit(compiled=compiled, pieces_write_outside=True)
    full = mode_capturers(backend, fn, eager_twin if compiled else None, split)[Mode.FULL]
    capture(full, keeper, first=False, sibling=sibling_of(key, schedule), key=key)
    assert schedule.replays == []
    last = backend.calls[-1]
    assert last["warmups"] == (2 if compiled else 1) and last["recorded"] is True and last["guard"] is False


def test_compiled_full_keeps_two_warm_ups_and_guards_its_eager_twin():
    backend = FakeBackend()
    full = mode_capturers(backend, fn, probe)[Mode.FULL]
    capture(full, FakeKeeper(), first=True)
    capture(full, FakeKeeper(), first=False)
    assert [(c["guard"], c["warmups"]) for c in backend.calls] == [(probe, 2), (probe, 2)]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("pieces_write_outside", [False, True])
def test_piecewise_later_keys_on_cuda_skip_warm_ups_unless_compiled(compiled, pieces_write_outside):
    split = FakeSplit(compiled=compiled, pieces_write_outside=pieces_write_outside)
    pw = mode_capturers(FakeBackend(), fn, None, split)[Mode.PIECEWISE]
    first, later = FakeKeeper(), FakeKeeper()
    capture(pw, first, first=True)
    capture(pw, later, first=False)
    assert split.calls[0]["warmups"] == 1 and split.calls[0]["guard"] is True and split.calls[0]["record"] is False
    assert [f for f, _ in first.recorded] == [probe]  # the whole function's writes, learnt at the first key
    if compiled:  # inductor may compile for a new shape: warm up (unguarded)
        assert split.calls[1]["warmups"] == 1 and split.calls[1]["guard"] is False
    else:  # a capture executes nothing
        assert split.calls[1]["warmups"] == 0 and split.calls[1]["guard"] is False
    if compiled and pieces_write_outside:  # warm-ups of graph pieces may write outside state: probe first
        assert [f for f, _ in later.recorded] == [probe] and split.calls[1]["record"] is False
    else:  # only the split ops' eager runs write outside state, recorded as they run
        assert later.recorded == [] and split.calls[1]["record"] is True and split.calls[1]["keeper"] is later
    assert later.restores >= 1


def test_the_simulation_warms_up_every_piecewise_key_because_its_capture_executes():
    split = FakeSplit()
    pw = mode_capturers(FakeBackend("sim"), fn, None, split)[Mode.PIECEWISE]
    keeper = FakeKeeper()
    capture(pw, keeper, first=False)
    assert split.calls[0]["warmups"] == 1 and [f for f, _ in keeper.recorded] == [probe]


@pytest.mark.parametrize("compiled", ["none", "whole", "pieces"])
def test_compiled_code_is_never_captured_under_the_constant_staging_mode(compiled):
    """Staging constants is a torch function mode around the CUDA capture run; dynamo would
    compile torch.compile'd code again under it, inside the capture. Every FULL key of a
    compiled function (the first key's guard is its eager twin, later ones' is off) and of a
    split function with compiled pieces captures without it."""
    backend = FakeBackend()
    twin = eager_twin if compiled == "whole" else None
    full = mode_capturers(backend, fn, twin, FakeSplit(compiled=compiled == "pieces"))[Mode.FULL]
    capture(full, FakeKeeper(), first=True)
    capture(full, FakeKeeper(), first=False)
    assert [c["compiled_code"] for c in backend.calls] == [compiled != "none"] * 2
