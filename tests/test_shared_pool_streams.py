"""The shared pool's stream order (`graphify.call.shared_calls`): a call on another stream than
the last hand-out's waits for it, across streams that may be destroyed (per-request CuPy or
external streams) and inside other graphs' captures. CUDA streams are stood in for on the CPU."""

from __future__ import annotations

import pytest
import torch

from conftest import replayed, requires_cuda
from shared_pool_cases import in_thread, shared_pool, two_structures_replaying, widened
from graphify import Options, graphify
from graphify.call import shared_calls


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
