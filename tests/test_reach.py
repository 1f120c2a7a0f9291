"""What a graph reads without copying it in (graphify.reads.reach): tensors and numbers held by a
static object or the closure. Replacing one after capture never gives a stale replay: a
captured callable raises, a first-use callable gives eager's answer. The simulation replays
what its capture recorded, so it reads the old memory exactly as a CUDA graph does (shown by
replaying a graph directly, past graphify's check), and capture leaves every object as it
found it."""

from __future__ import annotations

import types

import pytest
import torch

from graphify import Options, Mode, StateChangedError, graphify, static, tokens
from graphify.reads.reach import Reach


class Box:
    """A static object holding a tensor, as a transformers cache holds its keys."""

    def __init__(self, t):
        self.t = t


def box_fn(x, box):
    return x * 2 + box.t


def closure_over(t, scale):
    def fn(x):
        return x * scale + t

    return fn


def full_calls(g) -> int:
    return sum(r.calls for r in g.stats.rows() if r.mode is Mode.FULL)


def replay_directly(g, x):
    """Run the one captured graph for `x` past graphify's checks: what the device would do."""
    runtime = g._runtime if g._runtime is not None else g._first_use.current().runtime
    entry = next(iter(runtime.table.entries.values()))
    static = runtime.table.static.buffers[0]
    static[: x.shape[0]].copy_(x)
    entry.replay()
    return entry.flat_outputs[0][: x.shape[0]].clone()


# -- captured ahead of time: a replacement raises, naming the path ---------------------------
def test_a_tensor_replaced_in_a_static_object_is_refused_by_a_captured_callable(backend):
    name, device = backend
    box = Box(torch.randn(4, 8, device=device))
    g = graphify(box_fn, mode="FULL", sizes=[4], axes=(tokens(), static()), options=Options(backend=name)).capture(
        torch.randn(4, 8, device=device), box)
    x = torch.randn(4, 8, device=device)
    torch.testing.assert_close(g(x, box), box_fn(x, box))
    old = box.t
    box.t = torch.randn(4, 8, device=device)  # a new tensor: the graph still reads the old memory
    with pytest.raises(StateChangedError, match=r"box\.t: tensor\(4, 8\).*since capture.*copy_"):
        g(x, box)
    torch.testing.assert_close(replay_directly(g, x), x * 2 + old)  # what a replay would have given
    box.t = old
    torch.testing.assert_close(g(x, box), box_fn(x, box))  # the captured tensor back: replays again
    box.t.copy_(torch.randn(4, 8, device=device))  # in place: what graphs are for
    torch.testing.assert_close(g(x, box), box_fn(x, box))
    assert full_calls(g) == 3  # every call but the refused one replayed


@pytest.mark.parametrize("what", ["tensor", "number"])
def test_a_rebound_closure_is_refused_by_a_captured_callable(backend, what):
    name, device = backend
    fn = closure_over(torch.randn(4, 8, device=device), 2.0)
    g = graphify(fn, mode="FULL", sizes=[4], options=Options(backend=name)).capture(torch.randn(4, 8, device=device))
    x = torch.randn(4, 8, device=device)
    torch.testing.assert_close(g(x), fn(x))
    cell = dict(zip(fn.__code__.co_freevars, fn.__closure__))["t" if what == "tensor" else "scale"]
    old = cell.cell_contents
    cell.cell_contents = torch.randn(4, 8, device=device) if what == "tensor" else 3.0
    with pytest.raises(StateChangedError, match="closure '(t|scale)'"):
        g(x)
    assert full_calls(g) == 1
    # the graph itself still computes with the captured tensor / number, on every backend
    want = x * 2.0 + (old if what == "tensor" else dict(zip(fn.__code__.co_freevars, fn.__closure__))["t"].cell_contents)
    torch.testing.assert_close(replay_directly(g, x), want)


# -- first use: eager's answer, never a stale replay ----------------------------------------
def test_first_use_gives_eagers_answer_after_every_kind_of_replacement(backend):
    name, device = backend
    box = Box(torch.randn(4, 8, device=device))
    g = graphify(box_fn, options=Options(backend=name))
    for step in range(12):
        if step in (3, 6):
            box.t = torch.randn(4, 8, device=device)  # replaced between calls
        x = torch.randn(4, 8, device=device)
        torch.testing.assert_close(g(x, box), box_fn(x, box))
    assert {r.mode for r in g.stats.rows() if r.calls} >= {Mode.FULL}  # graphs did replay in between

    fn = closure_over(torch.randn(4, 8, device=device), 2.0)
    g = graphify(fn, options=Options(backend=name))
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__))
    for step in range(12):
        if step == 4:
            cells["scale"].cell_contents = 5.0
        if step == 8:
            cells["t"].cell_contents = torch.randn(4, 8, device=device)
        x = torch.randn(4, 8, device=device)
        torch.testing.assert_close(g(x), fn(x))
    assert full_calls(g) >= 6  # graphs replayed between the changes


def test_a_structure_whose_objects_keep_changing_runs_eagerly(backend, caplog):
    name, device = backend
    box = Box(torch.randn(4, 8, device=device))
    g = graphify(box_fn, options=Options(backend=name))
    for _ in range(12):
        for _ in range(3):  # each replacement costs a capture on the next repeat; then the kind runs eagerly
            x = torch.randn(4, 8, device=device)
            torch.testing.assert_close(g(x, box), box_fn(x, box))
        box.t = torch.randn(4, 8, device=device)
    assert "3 times in a row" in caplog.text
    assert g._first_use.structures == []
    # each of the three structures: a warm-up, then the capturing call and the next replay; then eager
    assert full_calls(g) == 6


# -- capture replaces state: refused, and left as found --------------------------------------
class Growing:
    """Grows by making a new tensor each call, as transformers' DynamicCache does."""

    def __init__(self, t):
        self.keys = t

    def update(self, x):
        self.keys = torch.cat([self.keys, x[:1]])
        return self.keys


def growing_fn(x, cache):
    return x + cache.update(x).sum(0)


def test_a_function_that_replaces_state_each_call_runs_eagerly_with_one_warning(backend):
    name, device = backend
    cache = Growing(torch.randn(2, 8, device=device))
    twin = Growing(cache.keys.clone())
    g = graphify(growing_fn, options=Options(backend=name))
    with pytest.warns(UserWarning, match="replaces a tensor.*cache.keys.*cache_implementation=\"static\"") as record:
        for _ in range(6):
            x = torch.randn(4, 8, device=device)
            torch.testing.assert_close(g(x, cache), growing_fn(x, twin))
    assert len([w for w in record if "replaces a tensor" in str(w.message)]) == 1
    assert torch.equal(cache.keys, twin.keys)  # 8 rows, as eager leaves it: the capture's runs were undone
    assert all(r.mode is Mode.NONE for r in g.stats.rows() if r.calls)


def test_capture_refuses_state_it_cannot_follow_and_leaves_the_object_as_it_was(backend):
    from graphify import CaptureError

    name, device = backend
    cache = Growing(torch.randn(2, 8, device=device))
    before, before_values = cache.keys, cache.keys.clone()
    with pytest.raises(CaptureError, match="replaces a tensor.*cache.keys"):
        graphify(growing_fn, mode="FULL", sizes=[4], axes=(tokens(), static()), options=Options(backend=name)).capture(
            torch.randn(4, 8, device=device), cache)
    assert cache.keys is before and torch.equal(cache.keys, before_values)  # same object, same contents


# -- the record itself -----------------------------------------------------------------------
class Slotted:
    __slots__ = ("w", "n")

    def __init__(self, w, n):
        self.w, self.n = w, n


def test_reach_names_the_first_change_through_lists_dicts_slots_and_cells():
    inner = Slotted(torch.randn(3), 4)
    root = types.SimpleNamespace(layers=[Box(torch.randn(2)), Box(torch.randn(2))], meta={"n": 1, "inner": inner})
    reach = Reach.walk({"cache": root})
    assert not reach.changed() and reach.describe() is None
    cases = [
        (lambda: setattr(root.layers[1], "t", torch.randn(2)), r"cache\.layers\[1\]\.t: tensor"),
        (lambda: root.layers.append(Box(torch.randn(2))), r"cache\.layers: 2 entries -> 3"),
        (lambda: root.meta.__setitem__("n", 2), r"cache\.meta\['n'\]: 1 -> 2"),
        (lambda: setattr(inner, "w", torch.randn(3)), r"cache\.meta\['inner'\]\.w: tensor"),
        (lambda: setattr(inner, "n", 5), r"cache\.meta\['inner'\]\.n: 4 -> 5"),
        (lambda: inner.w.resize_(6), r"(in place \(\(3,\) -> \(6,\)\)|new storage)"),
    ]
    for change, pattern in cases:
        reach = Reach.walk({"cache": root})
        change()
        assert reach.changed()
        assert pytest.importorskip("re").search(pattern, reach.describe()), reach.describe()


def test_a_deep_walk_follows_closures_partials_bound_objects_modules_and_globals():
    import functools

    t = torch.randn(2)
    fn = closure_over(t, 3.0)
    paths = {path for edges in Reach.walk({"f": functools.partial(fn)}, deep=True).all_edges() for path in edges.paths}
    assert {"f.func closure 't'", "f.func closure 'scale'"} <= paths
    holder = Box(t)
    bound = types.MethodType(lambda self, x: x + self.t, holder)
    paths = {path for edges in Reach.walk({"m": bound}, deep=True).all_edges() for path in edges.paths}
    assert "m.__self__.t" in paths
    module = torch.nn.Linear(2, 2)
    reach = Reach.walk({"lin": module.forward}, deep=True)
    assert any(t is module.weight for t in reach.tensors)  # a module's parameters are read through its dict
    assert any(p.endswith("._parameters['weight']") for edges in reach.all_edges() for p in edges.paths)
    shallow = Reach.walk({"lin": module.forward})
    assert not shallow.tensors and shallow.handoff == [("lin", module.forward)]  # left to the deep walk
