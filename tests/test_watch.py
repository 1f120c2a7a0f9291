"""Every replay as right as eager after any change to the Python state a call reads.

Over the changes research code makes between calls (`watch_cases.py`: modules reached
through closures, globals, containers, partials and bound objects; their parameters'
storage, attributes, hooks and registrations; globals of the code that runs; containers it
iterates; arguments' layout), on the plain line and the compiled one:

- first use: the call after the change answers as eager does (it runs eagerly), the
  structure captures again, and calls go back to graphs;
- `capture()`: the next call raises an error that names what changed;
- in-place updates (`copy_`, `load_state_dict` without `assign`, an optimizer step) keep
  replaying and equal eager.

Each case is built twice from one seed, one world graphified and one run eagerly, and
every change is made to both. The simulation replays the memory a capture read (as a GPU
does), so a missed change would show here as a stale answer; the last tests show that it
does, by replaying a graph past the check.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import calls_by_mode
from graphify import CaptureError, Mode, Options, PersistentSwapError, StateChangedError, graphify
from graphify.backends.sim import compiled_compared
from watch_cases import CHANGES, CONTROLS, D, mlp

LINES = {"plain": {}, "compiled": {"compile": {"backend": "eager"}}}
SIZES = (4,)


@pytest.fixture(autouse=True)
def compiled_code_as_a_gpu_runs_it(request):
    """The simulation replays a compiled function's eager original; a GPU replays the compiled
    code. Each capture of compiled code here also compares the two (`compiled_compared`), so
    a compiled entry traced over other state (dynamo's guards missing a change, or an entry
    another world's compile made) fails here as it would on a GPU. Cases that draw random
    numbers are left out (the warm-up draws its own)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    case = params.get("case")
    if params.get("line") != "compiled" or case is None or case.seeded:
        yield
        return
    with compiled_compared() as disagreements:
        yield
    assert not disagreements, disagreements[0]


@contextlib.contextmanager
def worlds(case, device):
    """The case's world built twice from one seed (one to graphify, one to run eagerly),
    cleaned up afterwards."""
    torch.manual_seed(0)
    a = case.build(device)
    torch.manual_seed(0)
    b = case.build(device)
    try:
        yield a, b
    finally:
        a.cleanup()
        b.cleanup()


def change_both(a, b) -> None:
    torch.manual_seed(1)
    a.change()
    torch.manual_seed(1)
    b.change()


def answer(world, f, x, case, seed: int):
    if case.seeded:
        torch.manual_seed(seed)
    return world.call(f, x)


def same(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def full_calls(g) -> int:
    return calls_by_mode(g)[Mode.FULL]


def graphified(world, name: str, line: str):
    return graphify(world.fn, sizes=SIZES, axes=world.axes, options=Options(backend=name, **LINES[line]))


@pytest.mark.parametrize("line", sorted(LINES))
@pytest.mark.parametrize("case", CHANGES, ids=lambda c: c.name)
def test_first_use_answers_as_eager_after_the_change_then_replays_again(backend, case, line):
    name, device = backend
    with worlds(case, device) as (a, b), torch.no_grad():
        g = graphified(a, name, line)
        for i in range(3):  # a warm-up, a capture, a replay
            x = torch.randn(3, D, device=device)
            same(answer(a, g, x, case, i), answer(b, b.fn, x, case, i), f"call {i}")
        before = full_calls(g)
        assert before >= (0 if case.too_large else 1)
        change_both(a, b)
        for i in range(4):
            x = torch.randn(3, D, device=device)
            same(answer(a, g, x, case, 10 + i), answer(b, b.fn, x, case, 10 + i), f"call {i} after the change")
    if case.replays_after:
        assert full_calls(g) > before, "calls went back to graphs"


@pytest.mark.parametrize("line", sorted(LINES))
@pytest.mark.parametrize("case", CHANGES, ids=lambda c: c.name)
def test_a_captured_callable_refuses_to_replay_after_the_change_naming_it(backend, case, line):
    name, device = backend
    with worlds(case, device) as (a, b), torch.no_grad():
        g = graphified(a, name, line)
        x = torch.randn(3, D, device=device)
        if case.too_large:  # what it reads is too large to watch: never captured
            with pytest.raises(CaptureError, match="larger than graphify records"):
                a.call(g.capture, x)
            return
        c = a.call(g.capture, x)
        same(answer(a, c, x, case, 0), answer(b, b.fn, x, case, 0), "before the change")
        change_both(a, b)
        with pytest.raises((StateChangedError, PersistentSwapError), match=case.where):
            answer(a, c, torch.randn(3, D, device=device), case, 1)


@pytest.mark.parametrize("stage", ["first use", "capture()"])
@pytest.mark.parametrize("line", sorted(LINES))
@pytest.mark.parametrize("case", CONTROLS, ids=lambda c: c.name)
def test_in_place_updates_keep_replaying_and_equal_eager(backend, case, line, stage):
    name, device = backend
    with worlds(case, device) as (a, b), torch.no_grad():
        g = graphified(a, name, line)
        if stage == "capture()":
            g = a.call(g.capture, torch.randn(3, D, device=device))
        for i in range(3):
            x = torch.randn(3, D, device=device)
            same(answer(a, g, x, case, i), answer(b, b.fn, x, case, i), f"call {i}")
        before = calls_by_mode(g)
        change_both(a, b)
        for i in range(4):
            x = torch.randn(3, D, device=device)
            same(answer(a, g, x, case, 10 + i), answer(b, b.fn, x, case, 10 + i), f"call {i} after the change")
    after = calls_by_mode(g)
    assert after[Mode.NONE] == before[Mode.NONE] and after[Mode.FULL] == before[Mode.FULL] + 4


@pytest.mark.parametrize("line", sorted(LINES))
def test_the_capturing_call_draws_the_random_numbers_eager_draws(backend, line):
    """Warm-up and capture run the function too; eager draws once a call. Every call, the
    capturing one included, and the generator after them, are eager's."""
    name, device = backend
    model = mlp(device)

    def noisy(x):
        return model(x) + torch.rand_like(x)

    xs = [torch.randn(3, D, device=device) for _ in range(4)]
    g = graphify(noisy, options=Options(backend=name, **LINES[line]))  # unpadded: padding rows draw numbers too
    with torch.no_grad():
        torch.manual_seed(5)
        want = [noisy(x) for x in xs] + [torch.rand(3, device=device)]
        torch.manual_seed(5)
        got = [g(x) for x in xs] + [torch.rand(3, device=device)]
    for i, (a, b) in enumerate(zip(got, want)):
        same(a, b, f"call {i}" if i < len(xs) else "the next draw")
    assert full_calls(g) == 3  # the second call captured, and it and the others replayed


def test_the_simulation_replays_the_memory_captured_as_a_device_does(backend):
    """Past the check, a replay reads what the capture read: the old storage of a weight
    given new storage, not the new one (the old is kept alive here, as a user holding it
    would; on a device a freed one would read garbage). So the check, not the simulation,
    is what makes the answers right."""
    name, device = backend
    model = mlp(device)
    g = graphify(lambda x: model(x), sizes=SIZES, options=Options(backend=name))
    x = torch.randn(4, D, device=device)
    with torch.no_grad():
        c = g.capture(x)
        before = c(x).clone()
        old = model[0].weight.data
        model[0].weight.data = torch.randn(D, D, device=device)
        assert not torch.allclose(model(x), before)
        entry = next(iter(c.table.entries.values()))
        c.table.static.buffers[0].copy_(x)
        entry.replay()
        same(entry.flat_outputs[0], before, "a replay past the check")
    del old


def test_a_change_now_and_then_keeps_graphs_and_a_change_every_call_goes_eager(backend):
    """A research loop that changes a hook between experiments goes back to graphs after
    each change; a function whose state changes before its graphs could replay, three
    times in a row, runs eagerly from then on."""
    name, device = backend
    model = mlp(device)
    g = graphify(model, sizes=SIZES, options=Options(backend=name))
    with torch.no_grad():
        for experiment in range(5):  # more changes than MAX_STALE, each followed by several calls
            model[0].register_forward_hook(lambda m, args, out, k=experiment: out + k)
            before = full_calls(g)
            for _ in range(6):
                x = torch.randn(3, D, device=device)
                same(g(x), model(x), f"experiment {experiment}")
            assert full_calls(g) >= before + 3, f"experiment {experiment} went back to graphs"
        calls = full_calls(g)
        for i in range(8):  # a change before every call
            model[2].bias.data = torch.randn(D, device=device)
            x = torch.randn(3, D, device=device)
            same(g(x), model(x), f"call {i}")
    assert full_calls(g) - calls <= 3 and not g._first_use.structures


def test_an_attribute_no_code_reads_changes_without_a_capture(backend):
    """transformers' generate() sets `_previous_max_cache_length` on the model on every new
    length; nothing the forward runs reads it, so the graphs keep replaying."""
    name, device = backend
    model = mlp(device)
    g = graphify(model, sizes=SIZES, options=Options(backend=name))
    with torch.no_grad():
        for i in range(8):
            model._previous_max_cache_length = 16 + i  # a plain attribute of the graphified module itself
            model[1].experiment_label = f"seen {i}"  # and of a submodule, added after capture
            x = torch.randn(3, D, device=device)
            same(g(x), model(x), f"call {i}")
    assert calls_by_mode(g)[Mode.NONE] == 1 and full_calls(g) == 7
