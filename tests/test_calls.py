"""Calls as users write them: modules, keywords, defaults, **kwargs, output pytrees, state
left as found, rebound parameters and grad mode. Every backend; results against eager."""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch

from conftest import calls_by_mode, counted
from graphify import InputMismatchError, Options, StateChangedError, graphify, persistent, tokens


def fresh(rows, cols, device, seed):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(device)


def test_nn_sequential_called_with_a_keyword(backend):
    name, device = backend
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3)).to(device).eval()
    g = graphify(model, mode="FULL", sizes=(2, 4, 8), options=Options(backend=name))
    with torch.no_grad():
        g = g.capture(input=fresh(4, 6, device, 0))
        for i, n in enumerate((1, 3, 8, 11)):
            x = fresh(n, 6, device, i + 1)
            torch.testing.assert_close(g(input=x), model(x))  # keyword
            torch.testing.assert_close(g(x), model(x))  # and positional, same graphs
    assert calls_by_mode(g) == counted(full=6, none=2)  # 11 rows: above the largest size, eager


class Scaled(torch.nn.Module):
    """A module with a keyword-only argument, a default and **kwargs."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, bias=None, *, scale: float = 1.0, **extra):
        y = self.lin(x) * scale
        if bias is not None:
            y = y + bias
        if extra.get("square"):
            y = y * y
        return y


def test_defaults_keyword_only_and_var_keywords_bind_like_python(backend):
    name, device = backend
    m = Scaled().to(device)
    bias = fresh(1, 4, device, 9)
    g = graphify(m, mode="FULL", sizes=(4, 8), axes={"x": tokens(), "bias": persistent()}, options=Options(backend=name))
    with torch.no_grad():
        g = g.capture(fresh(3, 4, device, 0), bias, scale=2.0, square=True)
        for i, n in enumerate((2, 5, 8)):
            x = fresh(n, 4, device, i + 1)
            want = m(x, bias, scale=2.0, square=True)
            torch.testing.assert_close(g(x, bias, scale=2.0, square=True), want)
            torch.testing.assert_close(g(x, bias=bias, square=True, scale=2.0), want)  # any order
            torch.testing.assert_close(g(x=x, bias=bias, scale=2.0, square=True), want)
    assert calls_by_mode(g) == counted(full=9)


@pytest.mark.filterwarnings("ignore:.*no gradient history")
def test_keyword_errors_name_the_argument_and_say_what_to_do():
    m = Scaled()
    bias = torch.randn(1, 4)
    g = graphify(m, mode="FULL", sizes=(4,), axes={"bias": persistent()}, options=Options(backend="sim"))
    g = g.capture(torch.randn(3, 4), bias, scale=2.0, square=True)
    x = torch.randn(2, 4)
    with pytest.raises(InputMismatchError, match=r"keyword 'cube' was not passed at capture.*capture again with cube="):
        g(x, bias, scale=2.0, square=True, cube=True)
    with pytest.raises(InputMismatchError, match=r"missing keyword 'square', which the capture was given"):
        g(x, bias, scale=2.0)
    with pytest.raises(InputMismatchError, match=r"argument 'bias' was passed at capture but left out"):
        g(x, scale=2.0, square=True)
    with pytest.raises(InputMismatchError, match=r"'scale' is 3.0 but was captured as 2.0"):
        g(x, bias, scale=3.0, square=True)
    with pytest.raises(InputMismatchError, match="multiple values for argument 'bias'"):
        g(x, bias, bias=bias, scale=2.0, square=True)
    plain = graphify(lambda x, y: x + y, mode="FULL", sizes=(4,), options=Options(backend="sim")).capture(x, x)
    with pytest.raises(InputMismatchError, match=r"unexpected keyword 'z'; parameters are \['x', 'y'\]"):
        plain(x, y=x, z=1)


def test_var_positional_arguments(backend):
    name, device = backend

    def total(*parts):
        return sum(p * (i + 1) for i, p in enumerate(parts))

    g = graphify(total, mode="FULL", sizes=(4,), options=Options(backend=name)).capture(*[fresh(4, 3, device, i) for i in range(3)])
    parts = [fresh(3, 3, device, 10 + i) for i in range(3)]
    torch.testing.assert_close(g(*parts), total(*parts))
    assert calls_by_mode(g) == counted(full=1)
    with pytest.raises(InputMismatchError, match=r"2 extra positional arguments \(\*args\) but the capture saw 3"):
        g(*parts[:2])


Pair = collections.namedtuple("Pair", "doubled summed")


@dataclasses.dataclass
class Result:
    doubled: torch.Tensor
    meta: str
    nested: dict


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: torch.Tensor


OUTPUTS = {
    "tuple": lambda x: (x * 2, x.sum(-1)),
    "dict": lambda x: {"doubled": x * 2, "summed": x.sum(-1), "none": None},
    "namedtuple": lambda x: Pair(x * 2, x.sum(-1)),
    "dataclass": lambda x: Result(x * 2, "tag", {"inner": Frozen(x + 1), "n": 3}),
    "none": lambda x: None,
}


@pytest.mark.parametrize("kind", sorted(OUTPUTS))
def test_outputs_of_any_pytree_come_back_cut_in_their_own_type(backend, kind):
    name, device = backend
    fn = OUTPUTS[kind]
    g = graphify(fn, mode="FULL", sizes=(4, 8), options=Options(backend=name)).capture(fresh(4, 5, device, 0))
    for i, n in enumerate((3, 8, 6)):
        x = fresh(n, 5, device, i + 1)
        got, want = g(x), fn(x)
        assert type(got) is type(want)
        got_leaves, got_spec = torch.utils._pytree.tree_flatten(got if kind != "dataclass" else dataclasses.asdict(got))
        want_leaves, want_spec = torch.utils._pytree.tree_flatten(want if kind != "dataclass" else dataclasses.asdict(want))
        assert got_spec == want_spec
        for a, b in zip(got_leaves, want_leaves):
            if isinstance(b, torch.Tensor):
                assert a.shape == b.shape  # cut to the real batch, never the padded one
                torch.testing.assert_close(a, b)
            else:
                assert a == b
    if kind == "dataclass":
        assert isinstance(got.nested["inner"], Frozen)
    assert calls_by_mode(g) == counted(full=3)


class Counter(torch.nn.Module):
    """Writes outside state in place on every call: a running sum, a step counter and one
    row of a cache, like a decoder's KV cache and position."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(5))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x, cache):
        self.total.add_(x.sum(0))
        cache.index_copy_(0, self.step.view(1), x[:1])
        self.step.add_(1)
        return x + self.total + cache.sum(0)


def test_capture_leaves_buffers_and_arguments_as_it_found_them(backend):
    name, device = backend
    m, ref = Counter().to(device), Counter().to(device)
    cache = fresh(16, 5, device, 1)
    ref_cache = cache.clone()
    with torch.no_grad():
        for i in range(2):  # some state before capture
            x = fresh(2, 5, device, 20 + i)
            m(x, cache), ref(x, ref_cache)
        before = (m.total.clone(), m.step.clone(), cache.clone())
        g = graphify(m, mode="FULL", sizes=(2, 4), axes=(tokens(), persistent()), options=Options(backend=name)).capture(
            fresh(4, 5, device, 2), cache
        )
        assert torch.equal(m.total, before[0]) and torch.equal(m.step, before[1]) and torch.equal(cache, before[2])
        assert g.table.state_tensors == 3 and "restored 3 outside tensor(s)" in g.summary()
        for i, n in enumerate((2, 4, 3, 1)):
            x = fresh(n, 5, device, 30 + i)
            torch.testing.assert_close(g(x, cache), ref(x, ref_cache))
        torch.testing.assert_close(cache, ref_cache)
        torch.testing.assert_close(m.total, ref.total)
    assert calls_by_mode(g) == counted(full=4)  # the state written by replays, not by eager runs


def test_restore_keeps_to_the_written_rows():
    cache = torch.randn(4096, 64)
    step = torch.zeros((), dtype=torch.long)

    def write(x, cache):
        cache.index_copy_(0, step.view(1) + torch.arange(x.shape[0]), x)
        return x * 2

    g = graphify(write, mode="FULL", sizes=(8,), axes=(tokens(), persistent()), options=Options(backend="sim")).capture(
        torch.randn(8, 64), cache
    )
    assert 0 < g.table.state_bytes <= 8 * 64 * 4  # the 8 written rows, not the 1 MiB cache


def test_scratch_state_is_left_alone_when_asked():
    buf = torch.zeros(3)

    def fn(x):
        buf.add_(1)
        return x + buf

    graphify(fn, mode="FULL", sizes=(4,), options=Options(backend="sim", restore_state=False)).capture(torch.randn(4, 3))
    assert buf.tolist() == [2.0, 2.0, 2.0]  # warm-up and capture ran for real
    buf.zero_()
    graphify(fn, mode="FULL", sizes=(4,), options=Options(backend="sim")).capture(torch.randn(4, 3))
    assert buf.tolist() == [0.0, 0.0, 0.0]


def test_python_state_that_graphs_cannot_follow_is_an_error():
    class Cache:
        def __init__(self):
            self.length = 0
            self.data = torch.zeros(8, 3)

    cache = Cache()

    def fn(x, cache):
        cache.length += 1
        return x + cache.data[: x.shape[0]]

    from graphify import CaptureError

    with pytest.raises(CaptureError, match=r"cache.length: 0 -> \d.*leave this function ungraphified"):
        graphify(fn, mode="FULL", sizes=(4,), options=Options(backend="sim")).capture(torch.randn(4, 3), cache)
    assert cache.length == 0  # put back


def test_a_different_object_than_the_captured_one_is_an_error():
    class Box:
        def __init__(self):
            self.t = torch.randn(3)

    box = Box()
    g = graphify(lambda x, box: x + box.t, mode="FULL", sizes=(4,), options=Options(backend="sim")).capture(torch.randn(4, 3), box)
    torch.testing.assert_close(g(torch.ones(2, 3), box), torch.ones(2, 3) + box.t)
    with pytest.raises(InputMismatchError, match=r"'box' is a different Box object.*pass the same object"):
        g(torch.ones(2, 3), Box())
    assert calls_by_mode(g) == counted(full=1)


REBINDS = {
    "replaced Parameter": lambda m: setattr(m[0], "weight", torch.nn.Parameter(m[0].weight.detach().clone())),
    "load_state_dict(assign=True)": lambda m: m.load_state_dict(
        {k: v.clone() for k, v in m.state_dict().items()}, assign=True
    ),
    ".double()": lambda m: m.double(),
    "new buffer": lambda m: m[0].register_buffer("extra", torch.zeros(1)),
}


@pytest.mark.parametrize("how", sorted(REBINDS))
def test_parameters_rebound_after_capture_are_an_error(how):
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        g = graphify(m, mode="FULL", sizes=(4,), options=Options(backend="sim")).capture(torch.randn(4, 4))
        x = torch.randn(2, 4)
        torch.testing.assert_close(g(x), m(x))  # right before the rebind
        assert calls_by_mode(g) == counted(full=1)
        REBINDS[how](m)
        with pytest.raises(StateChangedError, match="since capture.*capture again"):
            g(torch.randn(2, 4))


def test_updates_in_place_and_unrelated_modules_keep_working():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with torch.no_grad():
        g = graphify(m, mode="FULL", sizes=(4,), options=Options(backend="sim")).capture(torch.randn(4, 4))
        torch.nn.Linear(3, 3)  # registers parameters elsewhere: not ours
        m[0].weight.copy_(torch.randn(4, 4))  # in place: the graphs see it
        x = torch.randn(3, 4)
        torch.testing.assert_close(g(x), m(x))
    assert calls_by_mode(g) == counted(full=1)  # the replay, not an eager run, saw the new weights


def test_every_call_catches_a_single_data_swap_in_the_middle():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with torch.no_grad():
        g = graphify(m, mode="FULL", sizes=(4,), options=Options(backend="sim")).capture(torch.randn(4, 4))
        g(torch.randn(2, 4))
        m[1].weight.data = torch.randn(4, 4)  # neither the first nor the last parameter
        with pytest.raises(StateChangedError, match=r"_modules\['1'\]\._parameters\['weight'\]: new storage"):
            g(torch.randn(2, 4))
    assert calls_by_mode(g) == counted(full=1)


def test_grad_mode_warns_once_that_graphs_give_no_gradients():
    m = torch.nn.Linear(4, 4)
    g = graphify(m, mode="FULL", sizes=(4,), options=Options(backend="sim")).capture(torch.randn(4, 4))
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="outputs carry no gradient history"):
        got = g(x)
    torch.testing.assert_close(got, m(x).detach())  # the values are right; only the history is missing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(g(x), m(x).detach())  # once
        with torch.no_grad():
            torch.testing.assert_close(g(x), m(x))
    assert calls_by_mode(g) == counted(full=3)  # grad mode or not, the graph replays


def test_a_capture_that_fails_part_way_leaves_the_objects_it_changed_as_they_were():
    class Cache:  # grows by a new tensor each call, as a DynamicCache does
        def __init__(self):
            self.keys = torch.zeros(0, 4)

    def step(x, cache):
        cache.keys = torch.cat([cache.keys, x])
        return x * cache.keys.sum().item()  # a host read: the capture stops here, after the append

    g = graphify(step, options=Options(backend="sim"))
    mine, theirs = Cache(), Cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(4):  # the second call tries a capture
            x = torch.full((1, 4), float(i + 1))
            torch.testing.assert_close(g(x, mine), step(x, theirs))
            assert torch.equal(mine.keys, theirs.keys), i
    assert calls_by_mode(g) == counted(none=4)
