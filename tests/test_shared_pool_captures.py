"""The shared pool's calls and captures (`graphify.call.shared_calls`), beyond one thread on
one stream: captures that leave other structures' calls going, and a capture that never
ended, which torch keeps its pool for (the stream order: `test_shared_pool_streams.py`)."""

from __future__ import annotations

import gc
import threading
import time
import warnings
import weakref

import pytest
import torch

from conftest import replayed, requires_cuda
from shared_pool_cases import in_thread, shared_pool, widened
from graphify import Options, graphify


# -- captures that leave other structures' calls going ----------------------------------------
class Gate:
    """Signals between a test and the runs of `function()`: while `on` is set, runs on
    arguments that `match` say so (`entered`) and wait (up to 2 s) for `seen`; `waits` notes
    whether each wait saw it. The function holds it through a weak reference, which
    graphify's walk of what a function reaches never follows: its snapshots, put back
    after each capture run, leave these signals alone."""

    def __init__(self, match):
        self.match, self.waits = match, []
        self.on, self.entered, self.seen = threading.Event(), threading.Event(), threading.Event()

    def function(self):
        ref = weakref.ref(self)

        def fn(x):
            gate = ref()
            if gate.on.is_set() and gate.match(x):
                gate.entered.set()
                gate.waits.append(gate.seen.wait(2))
            return widened(x)

        return fn


def test_another_structures_calls_go_on_while_an_unsplit_function_captures():
    """A first-use capture of an unsplit function (warm-ups, compiles, a capture that runs
    nothing) holds only its own runtime and the pool's captures: another structure's call
    replays meanwhile."""
    gate = Gate(lambda x: x.shape[1] == 32)
    g = graphify(gate.function(), options=Options(backend="sim"))
    a, b = torch.rand(4, 48), torch.rand(4, 32)
    for _ in range(3):
        g(a)
    g(b)  # b's first sighting: its next call captures
    before = replayed(g)
    gate.on.set()
    t, got = in_thread(lambda: g(b))
    assert gate.entered.wait(5)  # b's capture is under way
    out = g(a)
    gate.seen.set()
    t.join(10)
    gate.on.clear()
    assert gate.waits and all(gate.waits)  # a's call returned while b's capture waited
    torch.testing.assert_close(out, widened(a), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[0], widened(b), rtol=1e-5, atol=1e-4)
    assert replayed(g) - before == 2  # a's call, then b's after its capture


def test_the_structure_that_captures_holds_off_its_own_calls():
    """Its static buffers are the capture's: a call of the same structure at a size already
    captured waits until the capture of the new size is done."""
    gate = Gate(lambda x: x.shape[0] == 6)
    g = graphify(gate.function(), options=Options(backend="sim"))
    small, six = torch.rand(4, 32), torch.rand(6, 32)
    for _ in range(3):
        g(small)  # captured at 4 rows
    gate.on.set()
    t, got_six = in_thread(lambda: g(six))  # a new size of the structure: captured, its runs waiting
    assert gate.entered.wait(5)
    caller, got = in_thread(lambda: g(small))
    caller.join(0.3)
    assert caller.is_alive() and got == []  # held off by the capture
    gate.seen.set()
    t.join(10)
    caller.join(10)
    gate.on.clear()
    torch.testing.assert_close(got[0], widened(small), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_six[0], widened(six), rtol=1e-5, atol=1e-4)


def test_a_call_during_a_capture_run_waits_for_its_end():
    """The capture window (on CUDA, torch's generators in capture mode; in the simulation, the
    taped run) holds the pool's call lock: another structure's call waits for its end."""
    from graphify.backends import sim

    gate = Gate(lambda x: x.shape[1] == 32 and sim.taping())
    g = graphify(gate.function(), options=Options(backend="sim"))
    a, b = torch.rand(4, 48), torch.rand(4, 32)
    for _ in range(3):
        g(a)
    g(b)
    gate.seen.clear()
    gate.on.set()
    t, got = in_thread(lambda: g(b))
    assert gate.entered.wait(5)
    out = g(a)
    gate.seen.set()
    t.join(10)
    gate.on.clear()
    assert gate.waits == [False]  # a's call returned after the capture run
    torch.testing.assert_close(out, widened(a), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[0], widened(b), rtol=1e-5, atol=1e-4)


def test_a_split_functions_capture_holds_off_every_call_of_the_pool(monkeypatch):
    """Its split ops write into graph pieces' outputs, its piece warm-ups and schedule
    replays run in the pool's blocks: the shared call lock is held throughout its capture."""
    from graphify.call import runtime as runtime_module
    from graphify.models import init_params, new_paged_cache, split_ops, varlen_axes, varlen_step
    from graphify.transforms import split
    from test_split import BLOCK, CFG, check_against_eager, layout

    step = varlen_step(CFG, init_params(CFG, seed=3), "unified")
    cache = new_paged_cache(CFG, 256, BLOCK, seed=4)
    example = layout((3, 1, 5), (4, 7, 0)).build(CFG)
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes())
    held, real = [], runtime_module.Runtime.capturing

    def capturing(self, whole=True):
        class Spy:
            def __enter__(spy):
                spy.inner = real(self, whole)
                spy.inner.__enter__()
                other = []
                t = threading.Thread(target=lambda: other.append(self.shared.lock.acquire(timeout=0.05)))
                t.start()
                t.join()
                if other[0]:
                    self.shared.lock.release()
                held.append((whole, not other[0]))

            def __exit__(spy, *exc):
                return spy.inner.__exit__(*exc)

        return Spy()

    monkeypatch.setattr(runtime_module.Runtime, "capturing", capturing)
    g = graphify(pw, mode="FULL_AND_PIECEWISE", sizes=(4, 8, 16), options=Options(backend="sim"))
    check_against_eager(g, step, cache, [layout([1] * 3, [5] * 3)] * 3 + [layout((4, 1), (0, 6))] * 3, "cpu")
    assert held and all(h == (True, True) for h in held)


def test_a_capture_that_restores_outside_state_holds_off_other_structures_calls():
    """A function writing a tensor held outside the call (a step counter, a KV cache): each
    warm-up's write is undone after it, which would undo the writes of another structure's
    replays meanwhile. Such captures hold the call lock through their warm-ups: the counter
    counts every call (review 4 lost ~4,000 of ~9,000)."""
    from graphify.backends import sim

    counter, slow = torch.zeros(1), threading.Event()

    def fn(x):
        counter.add_(1)  # the call's own state, advanced once a call
        if slow.is_set() and not sim.taping() and x.shape[1] == 32:
            time.sleep(0.2)  # b's warm-up (a compile) after its write
        return widened(x)

    g = graphify(fn, options=Options(backend="sim"))
    a, b = torch.rand(4, 48), torch.rand(4, 32)
    for _ in range(3):
        g(a)
    g(b)  # b's first sighting

    def is_b(structure):
        return structure.default.capture.session.example[0].shape[1] == 32

    assert shared_pool(g).shared.restores is True
    slow.set()
    done, looped = threading.Event(), [0]

    def loop():
        while not done.is_set():
            g(a)
            looped[0] += 1

    t = threading.Thread(target=loop)
    t.start()
    while looped[0] < 20:
        time.sleep(0.01)
    b_calls = 1
    while b_calls < 5 and not any(s.graphs for s in g._first_use.structures if is_b(s)):
        torch.testing.assert_close(g(b), widened(b), rtol=1e-5, atol=1e-4)  # b's capture: its warm-up slow
        b_calls += 1
    done.set()
    t.join(10)
    assert any(s.graphs for s in g._first_use.structures if is_b(s)) and looped[0] > 20
    assert int(counter.item()) == 3 + b_calls + looped[0]


def test_a_callables_first_capture_holds_the_call_lock_until_it_shows_it_restores_nothing():
    """Until a capture has shown that the function puts nothing back, a capture holds the call
    lock through its warm-ups; a pure function's later captures leave it (see the test above
    on calls going on); one drawing random numbers (the generators put back) keeps it."""
    gate = Gate(lambda x: True)
    g = graphify(gate.function(), options=Options(backend="sim"))
    a = torch.rand(4, 48)
    g(a)  # the first sighting, eager
    gate.on.set()
    t, got = in_thread(lambda: g(a))
    assert gate.entered.wait(5)  # the first capture's warm-up
    shared = shared_pool(g).shared
    other = []
    probe = threading.Thread(target=lambda: other.append(shared.lock.acquire(timeout=0.05)))
    probe.start()
    probe.join()
    gate.seen.set()
    t.join(10)
    gate.on.clear()
    assert other == [False] and shared.restores is False
    torch.testing.assert_close(got[0], widened(a), rtol=1e-5, atol=1e-4)

    def draws(x):
        return widened(x) + 0 * torch.rand(x.shape[0])

    h = graphify(draws, options=Options(backend="sim"))
    for _ in range(3):
        h(a)
    assert replayed(h) and shared_pool(h).shared.restores is True


def test_generators_a_capture_did_not_move_are_not_put_back():
    """`RandomStates.restore` puts back only the states that moved (a pure function's capture
    leaves draws other threads made meanwhile alone), and says whether any had."""
    from graphify.backends.rng import RandomStates

    assert RandomStates.take(None).restore() is False
    taken = RandomStates.take(None)
    first = torch.rand(5)
    assert taken.restore() is True
    torch.testing.assert_close(torch.rand(5), first)  # put back: the same numbers again


# -- a capture that never ended ------------------------------------------------------------
def test_a_capture_that_never_ended_pins_its_pool_id_and_later_captures_take_a_fresh_one():
    """torch before pytorch#190348 gives a pool id's use back only for a capture that ended
    (`CUDAGraph::reset`): an invalidated one pins that pool for the life of the process, as the
    simulation does. torch 2.11 also leaves the id routed, so a later capture into it fails
    (H200: a structure met after the invalidated capture never replayed): later captures take
    a fresh id, and the graphs captured before keep theirs."""
    from graphify.backends import sim

    failing = threading.Event()

    def fn(x):
        if failing.is_set() and sim.taping():  # the capture run (after its warm-ups) fails
            raise RuntimeError("an invalidated capture")
        return widened(x)

    g = graphify(fn, options=Options(backend="sim"))
    fu = g._first_use
    a, b, c, d = (torch.rand(4, w) for w in (48, 32, 40, 24))
    for _ in range(3):
        g(a)
    handle = shared_pool(g)._handle
    first = handle.id
    failing.set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its warning: this call runs eagerly
        for _ in range(2):
            torch.testing.assert_close(g(b), widened(b), rtol=1e-5, atol=1e-4)
    failing.clear()
    for _ in range(2):
        torch.testing.assert_close(g(c), widened(c), rtol=1e-5, atol=1e-4)
    ids = {e.graph.pool_id for s in fu.structures for br in s.branches.values() for e in br.runtime.table.entries.values()}
    second = handle.id
    assert ids == {first, second} and second != first and handle.live == 1  # a's graph in the first id, c's in the next
    for s in tuple(fu.structures):
        fu._drop(s)
    gc.collect()
    for _ in range(3):
        torch.testing.assert_close(g(d), widened(d), rtol=1e-5, atol=1e-4)
    assert handle.id not in (first, second) and handle.live == 1 and replayed(g) == 2 + 1 + 2  # (each first sighting eager)
    assert sim.SimGraph._live.get(first) == 1 and first not in sim.SimGraph._released  # pinned for good


def test_a_pool_counts_only_the_graphs_of_its_current_id():
    """`GraphPool`: where the id is renewed while a graph of the last one is still to be
    finalised (its weak reference gone, its finalizer waiting for the pool's lock in the thread
    that dropped it), `live` counts the new id's graphs only, then and after that finalizer."""
    from graphify.backends.graph_pool import GraphPool

    ids = iter(range(100))
    pool = GraphPool(lambda: next(ids))

    class Graph:
        pass

    held = [Graph()]
    with pool.capturing() as first:
        pool.holds(held[0], first)
    assert first == 0 and pool.live == 1
    with pool._lock:
        dropper = threading.Thread(target=held.clear)  # the last reference, dropped there
        dropper.start()
        while pool._any_graph() is not None:
            time.sleep(0.001)
        new = Graph()
        with pool.capturing() as fresh:  # no live graph of id 0: a fresh id
            pool.holds(new, fresh)
        assert fresh == 1 and pool.live == 1
    dropper.join(10)
    assert pool.live == 1  # id 0's finalizer counted nothing against id 1
    del new
    gc.collect()
    assert pool.live == 0
    with pool.capturing() as after:
        assert after == 2


@pytest.mark.cuda
@requires_cuda
def test_an_invalidated_cuda_capture_answers_as_eager_and_later_captures_work():
    """A host sync inside the capture (not in its warm-ups) invalidates it. What holds on any
    torch: that call answers as eager with a warning, nothing raises, and later captures and
    replays work. (Whether torch gives the failed capture's pool back depends on its version:
    pytorch#190348, #180395.)"""
    gate = Gate(lambda x: x.shape[1] == 2048)
    ref = weakref.ref(gate)

    def fn(x):
        g_ = ref()
        if g_.on.is_set() and g_.match(x) and torch.cuda.is_current_stream_capturing():
            x.sum().item()  # a host sync: the capture is invalidated
        return widened(x)

    where = f"torch {torch.__version__}"
    g = graphify(fn)
    gen = torch.Generator(device="cuda").manual_seed(12)
    a, b, c = (torch.rand(256, w, device="cuda", generator=gen) for w in (4096, 2048, 1024))
    for _ in range(3):
        g(a)
    before = replayed(g)
    gate.on.set()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.testing.assert_close(g(b), widened(b), rtol=1e-4, atol=1e-2, msg=lambda m: f"{where}: {m}")
    gate.on.clear()
    assert warned, f"{where}: no warning for the invalidated capture"
    for _ in range(3):
        for x in (c, a):
            torch.testing.assert_close(g(x), widened(x), rtol=1e-4, atol=1e-2, msg=lambda m: f"{where}: {m}")
    torch.cuda.synchronize()
    assert replayed(g) - before >= 5, f"{where}: {replayed(g) - before} replays after the failed capture"


@pytest.mark.cuda
@requires_cuda
def test_calls_on_another_stream_during_a_capture_answer_as_eager():
    """One thread's call captures a new structure (its warm-ups waiting) while another calls
    a captured structure on its own stream."""
    gate = Gate(lambda x: x.shape[1] == 2048)
    g = graphify(gate.function())
    gen = torch.Generator(device="cuda").manual_seed(13)
    a, b = (torch.rand(256, w, device="cuda", generator=gen) for w in (4096, 2048))
    want_a, want_b = widened(a), widened(b)
    for _ in range(3):
        g(a)
    g(b)  # b's first sighting
    torch.cuda.synchronize()
    gate.on.set()
    t, got = in_thread(lambda: g(b))
    assert gate.entered.wait(10)
    s, outs = torch.cuda.Stream(), []
    with torch.cuda.stream(s):
        for _ in range(20):
            outs.append(g(a))
    gate.seen.set()
    t.join(30)
    gate.on.clear()
    for _ in range(10):
        with torch.cuda.stream(s):
            outs.append(g(a))
        got.append(g(b))
    torch.cuda.synchronize()
    assert all(torch.allclose(o, want_a, rtol=1e-4, atol=1e-2) for o in outs)
    assert all(torch.allclose(o, want_b, rtol=1e-4, atol=1e-2) for o in got)


@pytest.mark.cuda
@requires_cuda
def test_a_call_during_a_captures_window_waits_for_its_end_and_answers_as_eager():
    """From capture_begin to capture_end torch's random generators are in capture mode: a
    replay on another thread would raise or read the seed and offset the capture's start
    rewrote. The window holds the pool's call lock: such a call waits for it."""
    gate = Gate(lambda x: x.shape[1] == 2048)
    ref = weakref.ref(gate)

    def fn(x):
        g_ = ref()
        if g_.on.is_set() and g_.match(x) and torch.cuda.is_current_stream_capturing():
            g_.entered.set()
            g_.waits.append(g_.seen.wait(1))
        return widened(x) + 0 * torch.rand(x.shape[0], device=x.device)  # draws random numbers

    g = graphify(fn)
    gen = torch.Generator(device="cuda").manual_seed(14)
    a, b = (torch.rand(256, w, device="cuda", generator=gen) for w in (4096, 2048))
    for _ in range(3):
        g(a)
    g(b)
    torch.cuda.synchronize()
    gate.on.set()
    t, got = in_thread(lambda: g(b))
    assert gate.entered.wait(10)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = g(a)  # held off until the capture ends
    gate.seen.set()
    t.join(30)
    gate.on.clear()
    torch.cuda.synchronize()
    assert gate.waits == [False]  # the call returned only after the window
    torch.testing.assert_close(out, widened(a), rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(got[0], widened(b), rtol=1e-4, atol=1e-2)
