"""The shared pool's calls and captures (`graphify.call.shared_calls`), beyond one thread on
one stream: the stream order across streams that may be destroyed (per-request CuPy or
external streams), captures that leave other structures' calls going, and a capture that
never ended, which torch keeps its pool for. CUDA streams are stood in for on the CPU."""

from __future__ import annotations

import gc
import threading
import time
import warnings
import weakref

import pytest
import torch

from conftest import replayed, requires_cuda
from shared_pool_cases import two_structures_replaying, widened
from graphify import Options, graphify
from graphify.call import shared_calls


def shared_pool(g):
    """The one pool a callable's structures share."""
    pools = {id(b.capture.session.pool): b.capture.session.pool
             for s in tuple(g._first_use.structures) for b in tuple(s.branches.values())}
    assert len(pools) == 1
    return next(iter(pools.values()))


# -- the stream order ------------------------------------------------------------------------
class Streams:
    """CUDA's streams and events as `SharedCalls` uses them: a stream is named by its raw
    pointer and may be destroyed (then any use of it fails, as CUDA's "invalid resource
    handle"); an event recorded on it outlives it. Each record follows a call's work (its
    replay and hand-out): `done[ptr]` counts them; `waited` holds (waiting stream, (stream,
    calls done) it waits for)."""

    def __init__(self):
        self.current, self.destroyed, self.done, self.waited = 1, set(), {}, []
        self.owned = set()  # streams torch owns (never destroyed); the others are external (CuPy's)

    def check(self, ptr):
        if ptr in self.destroyed:
            raise RuntimeError(f"CUDA error: invalid resource handle (stream {ptr} was destroyed)")

    def stream(self, index=None):
        streams = self

        class Stream:
            ptr = self.current
            # c10: an external stream's id is its pointer; torch's own have an encoded id
            stream_id = ptr * 64 + 1 if ptr in self.owned else ptr

            def wait_event(self, event):
                streams.check(self.ptr)
                streams.waited.append((self.ptr, event.at))

            def wait_stream(self, other):  # what the stream order did before events
                streams.check(self.ptr)
                streams.check(other.ptr)
                streams.waited.append((self.ptr, (other.ptr, streams.done.get(other.ptr, 0))))

        return Stream()

    def event(self):
        streams = self

        class Event:
            at = None

            def record(self, stream):
                streams.check(stream.ptr)
                streams.done[stream.ptr] = streams.done.get(stream.ptr, 0) + 1
                self.at = (stream.ptr, streams.done[stream.ptr])

        return Event()


@pytest.fixture
def streams(monkeypatch):
    fake = Streams()
    monkeypatch.setattr(shared_calls, "_raw_stream", lambda index: fake.current)
    monkeypatch.setattr(shared_calls, "_current_stream", fake.stream)
    monkeypatch.setattr(shared_calls, "_new_event", fake.event)
    monkeypatch.setattr(shared_calls, "_capturing", lambda: False)
    return fake


def calls_on_streams():
    """A callable of two structures, captured, whose shared pool keeps its stream order as
    on CUDA (with the `streams` fixture's stand-ins)."""
    g = graphify(widened, options=Options(backend="sim"))
    xs = [torch.rand(4, w, generator=torch.Generator().manual_seed(w)) for w in (48, 32)]
    for x in xs:
        for _ in range(3):
            g(x)
    shared = shared_pool(g).shared
    shared.cuda, shared.index = True, 0
    return g, xs


def test_a_call_on_another_stream_waits_for_the_last_hand_out_even_where_its_stream_is_gone(streams, monkeypatch):
    """Per-request streams (CuPy's, an ExternalStream's), each destroyed after its call: the
    next call waits on graphify's event, recorded after the last hand-out, never on the
    stream it was recorded on."""
    g, xs = calls_on_streams()
    before = replayed(g)
    for i in range(6):
        streams.current = 100 + i  # a new stream per request, destroyed after it
        x = xs[i % 2]
        torch.testing.assert_close(g(x), widened(x), rtol=1e-5, atol=1e-4)
        streams.destroyed.add(streams.current)
    assert replayed(g) - before == 6
    # every call after the first waited for the whole of the last one (its one piece of work)
    assert streams.waited == [(100 + i, (99 + i, 1)) for i in range(1, 6)]


def test_calls_on_one_torch_stream_wait_for_nothing(streams, monkeypatch):
    """The raw pointer's compare: on the torch stream of the last call, no wait and no event."""
    g, xs = calls_on_streams()
    streams.current = 7
    streams.owned.add(7)
    for i in range(6):
        g(xs[i % 2])
    assert streams.waited == [] and streams.done == {}


def test_a_new_external_stream_given_a_destroyed_ones_pointer_waits_for_its_calls(streams, monkeypatch):
    """CUDA gives a new stream the pointer of one destroyed: a request's CuPy stream, made after
    the last request's stream was dropped with its replay still running (H200: wrong answers
    from the same-pointer shortcut). Every call on an external stream waits for the event."""
    g, xs = calls_on_streams()
    before = replayed(g)
    for i in range(6):
        streams.current = 100  # each request's new stream, at the last one's address
        streams.destroyed.discard(100)
        x = xs[i % 2]
        torch.testing.assert_close(g(x), widened(x), rtol=1e-5, atol=1e-4)
        streams.destroyed.add(100)
    assert replayed(g) - before == 6
    assert streams.waited == [(100, (100, i)) for i in range(1, 6)]  # each after the last one's hand-out


def test_no_event_is_recorded_inside_another_graphs_capture(streams, monkeypatch):
    """A call made while the current stream captures (inside a capture of another callable)
    leaves the event as it was: a stream outside that capture could not wait on it."""
    g, xs = calls_on_streams()
    g(xs[0])
    monkeypatch.setattr(shared_calls, "_capturing", lambda: True)
    g(xs[1])
    assert streams.done == {1: 1}


def test_calls_on_the_per_thread_default_stream_wait_every_time(streams, monkeypatch):
    """`cp.cuda.Stream.ptds` (handle 2, cudaStreamPerThread) is another stream on each thread
    under one handle: the same-stream shortcut does not apply, every call waits for the last
    hand-out's event (two threads, one after the other)."""
    g, xs = calls_on_streams()
    streams.current = 2
    for i in range(6):
        t, got = in_thread(lambda: g(xs[i % 2]))
        t.join(10)
        torch.testing.assert_close(got[0], widened(xs[i % 2]), rtol=1e-5, atol=1e-4)
    assert streams.waited == [(2, (2, i)) for i in range(1, 6)]


def test_calls_on_torch_streams_wait_for_the_last_stream_and_record_no_event(streams, monkeypatch):
    """torch's own streams are never destroyed: a call on another one waits for the last one
    itself (`wait_stream`), and no event is recorded per call. A CuPy stream in between is
    followed by the event (recorded where it starts following, after what it waited for)."""
    g, xs = calls_on_streams()
    streams.owned |= {10, 11}
    for i in range(4):
        streams.current = 10 + i % 2
        g(xs[i % 2])
    assert streams.done == {}
    assert streams.waited == [(11, (10, 0)), (10, (11, 0)), (11, (10, 0))]
    streams.current = 100  # a CuPy stream, destroyed after its call
    g(xs[0])
    streams.destroyed.add(100)
    streams.current = 10
    torch.testing.assert_close(g(xs[1]), widened(xs[1]), rtol=1e-5, atol=1e-4)
    assert streams.waited[3:] == [(100, (11, 0)), (10, (100, 2))] and streams.done == {100: 2}


def test_a_call_inside_a_capture_on_another_stream_neither_waits_nor_moves_the_order(streams, monkeypatch):
    """A call made while its stream captures (another graph's capture) on a stream other than
    the last: a wait on an event recorded outside that capture would invalidate it, and what it
    records runs only when that graph does. The next call waits for the last real one."""
    g, xs = calls_on_streams()
    g(xs[0])
    shared = shared_pool(g).shared
    monkeypatch.setattr(shared_calls, "_capturing", lambda: True)
    streams.current = 5
    g(xs[1])
    assert streams.waited == [] and shared._raw == 1
    monkeypatch.setattr(shared_calls, "_capturing", lambda: False)
    streams.current = 6
    g(xs[1])
    assert streams.waited == [(6, (1, 1))]


@pytest.mark.cuda
@requires_cuda
def test_calls_on_short_lived_streams_answer_as_eager():
    """A CuPy stream per request, destroyed after its call while its work may still run."""
    cp = pytest.importorskip("cupy")
    g, xs, want = two_structures_replaying(11)
    outs = []
    for i in range(60):
        s = cp.cuda.Stream(non_blocking=True)
        with torch.cuda.stream(torch.cuda.ExternalStream(s.ptr)):
            outs.append((i % 2, g(xs[i % 2])))
        del s  # destroyed: its replay and copy may still run
    torch.cuda.synchronize()
    assert all(torch.allclose(o, want[i], rtol=1e-4, atol=1e-2) for i, o in outs)


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


def in_thread(call) -> tuple:
    """(thread, its results) of `call()` started in a thread."""
    got = []
    t = threading.Thread(target=lambda: got.append(call()))
    t.start()
    return t, got


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
