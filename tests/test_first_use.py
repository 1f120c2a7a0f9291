"""First-use capture (graphify.first_use.first_use): a callable never `capture()`d gets its graphs
when calls need them. Counted through `stats` and the structures it keeps; outputs always
compared with eager on fresh random inputs."""

from __future__ import annotations

import logging
import threading
import types
import warnings

import attrs
import pytest
import torch

from graphify import CaptureError, GraphifyError, InputMismatchError, Mode, Options, graphify, persistent, tokens
from graphify.call.paths import runtime_for
from graphify.base.limits import Limits
from graphify.first_use.first_use import FirstUse

MAX_STRUCTURES, MAX_EXACT_GRAPHS = Limits().structures, Limits().graphs_per_structure
from graphify.call.runtime import Miss
from graphify.capture import CallCapture, prepare


def mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def weights(device):
    g = torch.Generator().manual_seed(3)
    return torch.randn(16, 32, generator=g).to(device), torch.randn(32, 16, generator=g).to(device)


def first_use(backend, options=None, **kw):
    name, device = backend
    w1, w2 = weights(device)
    options = attrs.evolve(options or Options(), backend=name)
    return graphify(mlp, axes=(tokens(), persistent(), persistent()), options=options, **kw), w1, w2


def calls_by_mode(g) -> dict:
    return {r.mode: r.calls for r in g.stats.by_mode()}


def test_a_structure_is_captured_on_its_second_consecutive_call(backend):
    g, w1, w2 = first_use(backend)
    device = backend[1]
    for i, n in enumerate([3, 3, 3, 5, 7, 5]):
        x = torch.randn(n, 16, device=device)
        assert torch.equal(g(x, w1, w2), mlp(x, w1, w2))  # unpadded: bit for bit
    assert calls_by_mode(g) == {Mode.NONE: 1, Mode.PIECEWISE: 0, Mode.FULL: 5}  # only the very first ran eagerly
    assert sorted(k.num_tokens for k in g._first_use.current().runtime.table.keys.full) == [3, 5, 7]
    assert {r.padded_to for r in g.stats.rows() if r.mode is Mode.FULL} == {3, 5, 7}  # each size its own graph
    assert "first use: 3 graphs over 1 call structure(s)" in g.summary()
    assert not g.captured  # still the uncaptured value: capture() is the ahead-of-time stage


def test_given_sizes_pad_as_usual(backend):
    g, w1, w2 = first_use(backend, sizes=[4, 8])
    for n in (3, 3, 6, 8):
        x = torch.randn(n, 16, device=backend[1])
        torch.testing.assert_close(g(x, w1, w2), mlp(x, w1, w2), rtol=1e-4, atol=1e-4)
    assert {r.padded_to for r in g.stats.rows() if r.mode is Mode.FULL} == {4, 8}
    x = torch.randn(9, 16, device=backend[1])  # above the largest size: eager, no capture
    torch.testing.assert_close(g(x, w1, w2), mlp(x, w1, w2))
    assert len(g._first_use.current().runtime.table) == 2


def test_a_new_structure_runs_eagerly_until_it_repeats(backend):
    device = backend[1]

    def scaled(x, scale=1.0):
        return x * scale + 1

    g = graphify(scaled, options=Options(backend=backend[0]))
    a, b = torch.randn(4, 8, device=device), torch.randn(4, 6, device=device)
    g(a), g(a)  # captured on the second call
    g(b)  # another trailing shape: a first sighting
    g(a, scale=2.0)  # another static value: a first sighting
    assert calls_by_mode(g)[Mode.NONE] == 3 and len(g._first_use.structures) == 1
    for _ in range(3):  # b's was among the recent first sightings: captured at once
        assert torch.equal(g(b), scaled(b))
    assert len(g._first_use.structures) == 2
    assert torch.equal(g(a), scaled(a))  # the first structure still replays
    assert calls_by_mode(g)[Mode.FULL] == 1 + 3 + 1
    assert calls_by_mode(g)[Mode.NONE] == 3


def test_shapes_that_come_back_but_not_in_a_row_get_graphs(backend):
    """Images at two sizes, alternating: no two calls in a row share a structure, but each
    comes back among the recent first sightings, so both get graphs; a shape met once stays eager."""
    device = backend[1]
    g = graphify(lambda x: x.sin() + 1, options=Options(backend=backend[0]))
    small, large = torch.randn(2, 3, 8, 8, device=device), torch.randn(2, 3, 12, 12, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # shapes that move back and forth are no drift to warn of
        for x in (small, large, small, large, large, small, small, large):
            torch.testing.assert_close(g(x), x.sin() + 1)
    assert calls_by_mode(g)[Mode.NONE] == 2 and calls_by_mode(g)[Mode.FULL] == 6
    once = torch.randn(2, 3, 5, 5, device=device)
    torch.testing.assert_close(g(once), once.sin() + 1)
    assert calls_by_mode(g)[Mode.NONE] == 3 and len(g._first_use.structures) == 2


def test_structures_are_bounded(backend, caplog):
    device = backend[1]
    g = graphify(lambda x: x + 1, options=Options(backend=backend[0]))
    with caplog.at_level(logging.WARNING, logger="graphify"):
        for width in range(1, MAX_STRUCTURES + 4):
            x = torch.randn(2, width, device=device)
            for _ in range(3):
                assert torch.equal(g(x), x + 1)
    assert len(g._first_use.structures) == MAX_STRUCTURES
    assert calls_by_mode(g)[Mode.FULL] == MAX_STRUCTURES * 2  # each structure's second and third call replayed
    assert sum("call structures already have graphs" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("bound", [2, 3])
def test_a_users_limits_bound_structures_and_graphs(backend, bound):
    """`Options(limits=Limits(...))` sets the bounds: `bound` structures, `bound` graphs each."""
    device = backend[1]
    g = graphify(lambda x: x + 1, options=Options(backend=backend[0], limits=Limits(structures=bound,
                                                                                   graphs_per_structure=bound)))
    for width in range(1, bound + 3):
        for rows in (1, 1, 2, 3, 4, 5):
            x = torch.randn(rows, width, device=device)
            assert torch.equal(g(x), x + 1)
    assert len(g._first_use.structures) == bound
    assert all(len(s.runtime.table) == bound for s in g._first_use.structures)


def test_limits_are_validated():
    with pytest.raises(ValueError, match="structures must be a positive int"):
        Limits(structures=0)
    with pytest.raises(TypeError):
        Options(limits={"structures": 2})


def test_exact_sizes_are_bounded(backend, caplog):
    g = graphify(lambda x: x * 2, options=Options(backend=backend[0]))
    with caplog.at_level(logging.WARNING, logger="graphify"):
        for n in [1] + list(range(1, MAX_EXACT_GRAPHS + 4)):
            x = torch.randn(n, 4, device=backend[1])
            assert torch.equal(g(x), x * 2)
    assert len(g._first_use.current().runtime.table) == MAX_EXACT_GRAPHS
    assert calls_by_mode(g)[Mode.NONE] == 1 + 3  # the first call, and the sizes past the bound
    assert calls_by_mode(g)[Mode.FULL] == MAX_EXACT_GRAPHS
    assert any("graphs captured on first use for one call structure" in r.message for r in caplog.records)


def test_outside_state_is_written_exactly_once_per_call(backend):
    device = backend[1]
    counter = torch.zeros(1, device=device)

    def step(x, count):
        count.add_(1)  # a position counter, as a cache keeps one
        return x + count

    g = graphify(step, axes=(tokens(), persistent()), options=Options(backend=backend[0]))
    expected = torch.zeros(1, device=device)
    for n in (2, 2, 5, 2, 5, 3):
        x = torch.randn(n, 4, device=device)
        expected += 1
        assert torch.equal(g(x, counter), x + expected)
    assert counter.item() == 6  # warm-ups and captures wrote nothing that stayed
    assert calls_by_mode(g) == {Mode.NONE: 1, Mode.PIECEWISE: 0, Mode.FULL: 5}


def test_without_first_use_calls_stay_eager(backend):
    g, w1, w2 = first_use(backend, options=Options(first_use=False))
    for _ in range(3):
        x = torch.randn(4, 16, device=backend[1])
        assert torch.equal(g(x, w1, w2), mlp(x, w1, w2))
    assert calls_by_mode(g)[Mode.NONE] == 3 and g._first_use is None


def test_release_frees_the_graphs_and_later_calls_raise(backend):
    g, w1, w2 = first_use(backend)
    x = torch.randn(4, 16, device=backend[1])
    g(x, w1, w2), g(x, w1, w2)
    fresh = g.release()
    assert not g._first_use.structures
    with pytest.raises(GraphifyError, match="released"):
        g(x, w1, w2)
    assert torch.equal(fresh(x, w1, w2), mlp(x, w1, w2))  # the callable release() returned starts over


def test_calls_from_several_threads(backend):
    g, w1, w2 = first_use(backend)
    errors = []

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        try:
            for _ in range(30):
                n = int(torch.randint(1, 9, (1,), generator=gen))
                x = torch.randn(n, 16, generator=gen).to(backend[1])
                out = g(x, w1, w2)
                if not torch.equal(out, mlp(x, w1, w2)):
                    errors.append((seed, n))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(g._first_use.structures) == 1
    assert calls_by_mode(g)[Mode.FULL] >= 4 * 30 - 8  # at most the very first call of each thread ran eagerly


def test_weights_passed_with_default_axes_keep_their_shape_and_are_read_each_call(backend, caplog):
    """Default axes: x's first dimension is the batch's; the weights', another, so they are
    `fixed()` (copied in on every call): changed in place between calls, replays see them."""
    w1, w2 = weights(backend[1])
    g = graphify(mlp, options=Options(backend=backend[0]))
    with caplog.at_level(logging.WARNING, logger="graphify"):
        for i in range(6):
            x = torch.randn(4, 16, device=backend[1])
            if i == 4:
                w1.mul_(-2.0)
            torch.testing.assert_close(g(x, w1, w2), mlp(x, w1, w2))
    assert calls_by_mode(g)[Mode.FULL] >= 4
    assert not [r.message for r in caplog.records if "cannot be graphed" in r.message]


def test_check_compares_a_first_use_table_with_eager(backend):
    g, w1, w2 = first_use(backend)
    for n in (4, 4, 8):
        g(torch.randn(n, 16, device=backend[1]), w1, w2)
    report = g.check(sizes=[4, 8], rtol=1e-4, atol=1e-4)
    assert report.ok, report
    assert {row.mode for row in report.rows} == {"FULL"}  # the graphs were compared, not eager with eager


def test_mode_none_with_no_sizes_is_valid(backend):
    g = graphify(lambda x: x + 1, mode="NONE", sizes=[], options=Options(backend=backend[0]))
    x = torch.randn(3, 2, device=backend[1])
    assert torch.equal(g(x), x + 1) and torch.equal(g.capture(x)(x), x + 1)
    with pytest.raises(ValueError, match="sizes is empty"):
        graphify(lambda x: x, mode="FULL", sizes=[])


def test_a_dict_argument_stands_for_its_tensors_and_its_keys_are_checked(backend):
    device = backend[1]

    def masked(x, masks):
        return x * masks["full"] + masks["window"]

    x = torch.randn(4, 3, device=device)
    masks = {"full": torch.randn(4, 3, device=device), "window": torch.randn(4, 3, device=device)}
    g = graphify(masked, sizes=[4, 8], options=Options(backend=backend[0])).capture(x, masks)
    y = torch.randn(6, 3, device=device)
    other = {"full": torch.randn(6, 3, device=device), "window": torch.randn(6, 3, device=device)}
    torch.testing.assert_close(g(y, other), masked(y, other))  # the dict's tensors are padded like arguments
    assert calls_by_mode(g)[Mode.FULL] == 1
    with pytest.raises(InputMismatchError, match="'masks' has another structure than at capture"):
        g(y, {"full": other["full"]})
    with pytest.raises(InputMismatchError, match="'masks' has another structure than at capture"):
        g(y, {"window": other["window"], "full": other["full"]})  # its keys in another order
    with pytest.raises(InputMismatchError, match="'masks' has another structure than at capture"):
        g(y, {"full": other["full"], "window": [other["window"]]})  # a leaf that is a container


# -- the layers: the runtime hands back a miss, first use captures and installs ----------------
class RecordingCapture(CallCapture):
    """A `CallCapture` that writes down every capture the first-use policy asks for, and can
    make the ones without warm-up fail."""

    log: list = []
    quick_fails = False

    def capture(self, pair, args, loaded, *, quick=False, collect=True, plain=False):
        type(self).log.append((pair[1].num_tokens, quick))
        if quick and type(self).quick_fails:
            raise CaptureError("a capture without warm-up failed (made to)")
        return super().capture(pair, args, loaded, quick=quick, collect=collect, plain=plain)


def recorded_first_use(backend, log, quick_fails=False):
    g, w1, w2 = first_use(backend)
    capture = type("Recording", (RecordingCapture,), {"log": log, "quick_fails": quick_fails})
    return FirstUse(g.spec, g.stats, open_capture=capture), g, w1, w2


def test_the_policy_asks_for_each_graph_once_in_the_order_calls_need_them(backend):
    log = []
    fu, g, w1, w2 = recorded_first_use(backend, log)
    for n in (3, 3, 3, 5, 3, 5, 7):
        x = torch.randn(n, 16, device=backend[1])
        assert torch.equal(fu.run((x, w1, w2), {}), mlp(x, w1, w2))
    assert log == [(3, False), (5, False), (7, False)]  # the first call was the warm-up; every size once
    assert calls_by_mode(g) == {Mode.NONE: 1, Mode.PIECEWISE: 0, Mode.FULL: 6}


def test_kin_capture_without_warm_up_and_fall_back_to_the_whole_protocol(backend):
    device = backend[1]

    def scale(x, box):
        return x * box.factor

    for quick_fails, want in ((False, [(2, False), (2, True)]), (True, [(2, False), (2, True), (2, False)])):
        log = []
        g = graphify(scale, options=Options(backend=backend[0]))
        fu = FirstUse(g.spec, g.stats, open_capture=type("R", (RecordingCapture,), {"log": log, "quick_fails": quick_fails}))
        first, second = types.SimpleNamespace(factor=torch.randn(4, device=device)), types.SimpleNamespace(
            factor=torch.randn(4, device=device))
        x = torch.randn(2, 4, device=device)
        for box in (first, first, second, second):  # a new object of a known kind: kin, captured at once
            assert torch.equal(fu.run((x, box), {}), scale(x, box))
        assert log == want, quick_fails
        assert calls_by_mode(g)[Mode.FULL] == 3


class Box:
    """A static object (held weakly, as a transformers cache is)."""

    def __init__(self, device):
        self.factor = torch.randn(4, device=device)


def test_objects_kept_past_the_bound_make_room_and_cycling_over_them_stops_that(backend, caplog):
    """New objects of a kind with graphs, all kept alive (generate() outputs holding their
    caches): past MAX_STRUCTURES the least recently used structure of the kind makes room,
    so each new object is captured and replays. Calls that come back to objects whose graphs
    went so would capture every time: after MAX_RETURNS of them the bound holds, the rest
    run eagerly (logged once), and captures stop."""
    from graphify.first_use.room import MAX_RETURNS

    device, log = backend[1], []

    def scale(x, box):
        return x * box.factor

    g = graphify(scale, options=Options(backend=backend[0]))
    fu = FirstUse(g.spec, g.stats, open_capture=type("R", (RecordingCapture,), {"log": log}))
    boxes = [Box(device) for _ in range(MAX_STRUCTURES + 2)]
    with caplog.at_level(logging.WARNING, logger="graphify"):
        for box in boxes:
            for _ in range(2):
                x = torch.randn(2, 4, device=device)
                assert torch.equal(fu.run((x, box), {}), scale(x, box))
        # the first object's first call its warm-up; every other call replayed
        assert calls_by_mode(g)[Mode.NONE] == 1 and calls_by_mode(g)[Mode.FULL] == 2 * len(boxes) - 1
        assert len(log) == len(boxes) and len(fu.structures) == MAX_STRUCTURES
        captured = []
        for _ in range(3):  # round and round over more objects than the bound
            before = len(log)
            for box in boxes:
                x = torch.randn(2, 4, device=device)
                assert torch.equal(fu.run((x, box), {}), scale(x, box))
            captured.append(len(log) - before)
    assert captured == [MAX_RETURNS, 0, 0] and len(fu.structures) == MAX_STRUCTURES
    assert sum("call structures already have graphs" in r.message for r in caplog.records) == 1


def test_a_runtime_hands_back_what_it_lacks_and_replays_once_it_is_installed(backend):
    g, w1, w2 = first_use(backend)
    spec = g.spec
    x = torch.randn(5, 16, device=backend[1])
    prepared = prepare(spec, (x, w1, w2), {})
    capture = CallCapture(spec, prepared, spec.keys)
    runtime = runtime_for(spec, capture.session.table(), spec.keys)
    miss = runtime.run(prepared.args, g.stats)
    assert isinstance(miss, Miss) and miss.tokens == 5 and miss.decision.key.num_tokens == 8  # padded to the schedule
    assert len(runtime.table) == 0 and calls_by_mode(g)[Mode.FULL] == 0  # nothing captured, nothing replayed
    pair = (miss.decision.mode, miss.decision.key)
    with runtime.exclusive():
        loaded, written = capture.load(pair, miss.args)
        runtime.wrote(written)
        runtime.install(capture.capture(pair, miss.args, loaded))
    assert torch.allclose(runtime.run(prepared.args, g.stats), mlp(x, w1, w2), rtol=1e-4, atol=1e-4)
    assert calls_by_mode(g)[Mode.FULL] == 1


# -- what cannot be graphed runs eagerly, with one warning ------------------------------------
def reads_on_host_at(rows: int):
    """A function that reads a device value on the host (uncapturable) for batches of `rows`."""
    def fn(x, w1, w2):
        if x.shape[0] == rows and x.sum().item() > 1e30:
            return x
        return mlp(x, w1, w2)
    return fn


def test_an_uncapturable_call_runs_eagerly_with_one_warning_and_other_sizes_keep_their_graphs(backend):
    device = backend[1]
    fn = reads_on_host_at(3)
    w1, w2 = weights(device)
    g = graphify(fn, axes=(tokens(), persistent(), persistent()), options=Options(backend=backend[0]))
    with pytest.warns(UserWarning, match=r"(?s)reads a device value on the host.*run eagerly.*first_use='strict'") as seen:
        for n in (5, 5, 3, 3, 5, 3, 5, 3):
            x = torch.randn(n, 16, device=device)
            assert torch.equal(g(x, w1, w2), fn(x, w1, w2))
    assert sum("cannot" in str(w.message) or "device value" in str(w.message) for w in seen) == 1
    # 5: a warm-up, then graphs; 3: its capture fails once, then it runs eagerly without trying again
    assert calls_by_mode(g) == {Mode.NONE: 5, Mode.PIECEWISE: 0, Mode.FULL: 3}
    assert sorted(k.num_tokens for k in g._first_use.current().runtime.table.keys.full) == [5]


def test_strict_first_use_raises_what_cannot_be_captured(backend):
    device = backend[1]
    fn = reads_on_host_at(3)
    w1, w2 = weights(device)
    g = graphify(fn, axes=(tokens(), persistent(), persistent()), options=Options(backend=backend[0], first_use="strict"))
    x = torch.randn(3, 16, device=device)
    g(x, w1, w2)  # the warm-up, eagerly
    with pytest.raises(CaptureError, match="reads a device value on the host"):
        g(x, w1, w2)
    with pytest.raises(ValueError, match="first_use must be True, False or 'strict'"):
        Options(first_use="yes")


def test_python_state_that_changes_every_call_runs_eagerly_with_one_warning(backend):
    """A closure counter is Python state a replay would not advance: the capture is refused,
    and every call runs eagerly (the counter counts each once), with one warning."""
    device = backend[1]
    calls = 0
    w1, w2 = weights(device)

    def counted(x):
        nonlocal calls
        calls += 1
        return mlp(x, w1, w2) * calls

    g = graphify(counted, options=Options(backend=backend[0]))
    with pytest.warns(UserWarning, match="changes Python state") as seen:
        for i in range(1, 7):
            x = torch.randn(4, 16, device=device)
            torch.testing.assert_close(g(x), mlp(x, w1, w2) * i)
    assert calls == 6  # the refused capture's warm-up was put back
    assert len([w for w in seen if "changes Python state" in str(w.message)]) == 1
    assert calls_by_mode(g) == {Mode.NONE: 6, Mode.PIECEWISE: 0, Mode.FULL: 0}


def test_side_effects_at_capture_graphs_a_function_that_counts_its_calls(backend, caplog):
    """Opt-in: a closure counter changes only when a capture runs (its warm-up and capture),
    never on replays, and the log says so; the default refuses (the test above)."""
    device = backend[1]
    calls = 0
    w1, w2 = weights(device)

    def counted(x):
        nonlocal calls
        calls += 1  # instrumentation: the result does not depend on it
        return mlp(x, w1, w2)

    g = graphify(counted, options=Options(backend=backend[0], side_effects="at_capture"))
    with caplog.at_level(logging.WARNING, logger="graphify"):
        for _ in range(6):
            x = torch.randn(4, 16, device=device)
            torch.testing.assert_close(g(x), mlp(x, w1, w2))
    assert calls_by_mode(g) == {Mode.NONE: 1, Mode.PIECEWISE: 0, Mode.FULL: 5}
    assert calls == 1 + 2  # the eager warm-up call, then the capture's warm-up and capture runs
    said = [r.getMessage() for r in caplog.records if "side_effects='at_capture'" in r.getMessage()]
    assert len(said) == 1 and "closure 'calls': 1 -> 3 during capture" in said[0]
    with pytest.raises(ValueError):
        Options(side_effects="sometimes")


class LazyLayer:
    """A cache layer made on its first use, as transformers' StaticLayer is: its buffers come
    then, and its counter moves to the call's device (`.to(device)`, a new tensor on a GPU;
    a clone here, so the CPU sees what a GPU sees)."""

    def __init__(self):
        self.count = torch.zeros(())
        self.keys = None

    def step(self, x):
        if self.keys is None:
            self.keys = torch.zeros(x.shape[1], device=x.device)
            self.count = self.count.to(x.device).clone()
        self.keys.add_(x.sum(0))
        self.count.add_(1)
        return x * self.count + self.keys


def test_a_new_object_made_on_its_first_use_gets_graphs_from_its_second_call(backend):
    """A second generate()'s cache is kin of the first's and captured at once; its capture's
    run makes the layer (a tensor replaced), so that call runs eagerly and the next captures.
    An object that replaces its tensor on every call still runs eagerly, with one warning."""
    device = backend[1]
    g = graphify(lambda x, layer: layer.step(x), options=Options(backend=backend[0]))
    for generation in range(3):
        layer, twin = LazyLayer(), LazyLayer()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(4):
                x = torch.randn(2, 8, device=device)
                torch.testing.assert_close(g(x, layer), twin.step(x), rtol=0, atol=0)
        assert not seen, [str(w.message) for w in seen]
    # first object: a warm-up, then 3 replays; each later one: its making call eagerly, then 3 replays
    assert calls_by_mode(g) == {Mode.NONE: 3, Mode.PIECEWISE: 0, Mode.FULL: 9}

    class Regrows(LazyLayer):
        def step(self, x):
            self.keys = None  # every call makes its buffers anew (a DynamicCache's torch.cat)
            return super().step(x)

    h = graphify(lambda x, layer: layer.step(x), options=Options(backend=backend[0]))
    with pytest.warns(UserWarning, match="replaces a tensor") as seen:
        for _ in range(3):
            layer, twin = Regrows(), Regrows()
            for _ in range(3):
                x = torch.randn(2, 8, device=device)
                torch.testing.assert_close(h(x, layer), twin.step(x), rtol=0, atol=0)
    assert len([w for w in seen if "replaces a tensor" in str(w.message)]) == 1
    assert calls_by_mode(h)[Mode.FULL] == 0


def test_objects_each_called_once_do_not_cost_a_failed_capture_apiece(backend):
    """The retry above is bounded for a kind of call: objects that make their layers on first
    use and are each called once fail `MAX_RETRIES` captures in a row, then their kind runs
    eagerly with one warning."""
    from graphify.first_use.failures import MAX_RETRIES

    device, log = backend[1], []
    g = graphify(lambda x, layer: layer.step(x), options=Options(backend=backend[0]))
    fu = FirstUse(g.spec, g.stats, open_capture=type("R", (RecordingCapture,), {"log": log}))
    first = LazyLayer()
    for _ in range(2):  # a warm-up, then a capture: the kind has graphs, so new objects are kin
        fu.run((torch.randn(2, 8, device=device), first), {})
    tried = []  # captures each new object cost: on a GPU a kin capture without warm-up fails on the
    # layer's host-to-device copy first and is made again with one, which fails as the CPU's does
    with pytest.warns(UserWarning, match="replaces a tensor") as seen:
        for _ in range(10):
            layer, twin = LazyLayer(), LazyLayer()
            x = torch.randn(2, 8, device=device)
            before = len(log)
            torch.testing.assert_close(fu.run((x, layer), {}), twin.step(x), rtol=0, atol=0)
            tried.append(len(log) - before)
    # one retried apiece, the next refuses the kind; then no capture at all
    assert [n > 0 for n in tried] == [True] * (MAX_RETRIES + 1) + [False] * (10 - MAX_RETRIES - 1), tried
    assert max(tried) <= 2, tried
    assert len([w for w in seen if "replaces a tensor" in str(w.message)]) == 1


def test_a_first_sighting_runs_eagerly_without_walking_its_objects(backend, monkeypatch):
    """A prompt's prefill over a new cache is a first sighting in every generate(): it runs
    eagerly as its structure's warm-up, so the walk of its objects (a cache's every layer),
    which only a capture or a take-over needs, is not made for it. A call that may go further
    (its structure seen just before, or a kind with graphs: kin) still walks, and every
    answer is eager's."""
    import graphify.first_use.first_use as fu_module

    walks = []
    real = fu_module.stateful_in
    monkeypatch.setattr(fu_module, "stateful_in", lambda objects: walks.append(len(objects)) or real(objects))
    device = backend[1]
    g = graphify(lambda x, layer: layer.step(x), options=Options(backend=backend[0]))
    walked = []
    for generation in range(3):
        layer, twin = LazyLayer(), LazyLayer()
        for _ in range(3):
            x = torch.randn(2, 8, device=device)
            before = len(walks)
            torch.testing.assert_close(g(x, layer), twin.step(x), rtol=0, atol=0)
            walked.append(len(walks) - before)
    # first object: a first sighting (no walk), its second call walks and captures, then a
    # replay; later objects are kin of a kind with graphs: walked at once (taken in), then replays
    assert walked[:3] == [0, 1, 0], walked
    assert all(n <= 1 for n in walked[3:]) and walked[3] == 1 and walked[6] == 1, walked
    assert calls_by_mode(g)[Mode.FULL] > 0


def test_a_call_of_another_structure_is_not_watched_by_one_it_does_not_fit(backend, monkeypatch):
    """First use tries its structures in turn: each checks the call's arguments before what
    the function reads, so a call another structure serves costs no watch of this one's
    state (a replay is still watched first: `tests/test_watch.py`)."""
    from graphify.reads.table_reads import Reads

    watched = []
    real = Reads.guard
    monkeypatch.setattr(Reads, "guard", lambda self, args: watched.append(self) or real(self, args))
    g, w1, w2 = first_use(backend)
    device = backend[1]
    wide = (w1.double(), w2.double())
    for a, b in ((w1, w2), wide):  # two structures (fp32 and fp64 calls), each captured
        for _ in range(3):
            x = torch.randn(4, 16, device=device, dtype=a.dtype)
            torch.testing.assert_close(g(x, a, b), mlp(x, a, b))
    assert calls_by_mode(g)[Mode.FULL] >= 2

    def watches_of_a_wide_call() -> int:
        watched.clear()
        x = torch.randn(4, 16, device=device, dtype=torch.float64)
        torch.testing.assert_close(g(x, *wide), mlp(x, *wide))
        return len(watched)

    alone = watches_of_a_wide_call()  # its own structure first in line
    x = torch.randn(4, 16, device=device)
    g(x, w1, w2)  # now the fp32 structure is first: the wide call tries it before its own
    assert watches_of_a_wide_call() == alone > 0


@pytest.mark.parametrize("widths, warned", [((5, 6, 7, 8, 9), True), ((5, 9, 6, 11, 7), False)],
                         ids=["grows-by-one", "moves-back-and-forth"])
def test_the_drift_warning_is_for_a_shape_that_grows_by_one_step_every_call(backend, widths, warned):
    """A mask growing with a cache moves by the same step every call and never repeats: one
    warning says why it runs eagerly. Shapes that move by other steps each time (requests of
    many sizes) may repeat later, and are not warned of."""
    g = graphify(lambda x: x * 2, options=Options(backend=backend[0]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for w in widths:
            x = torch.randn(2, w, device=backend[1])
            torch.testing.assert_close(g(x), x * 2)
    said = [str(c.message) for c in caught if "changes on every call" in str(c.message)]
    assert len(said) == (1 if warned else 0), said
