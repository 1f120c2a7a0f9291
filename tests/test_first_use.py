"""First-use capture (graphify._first_use): a callable never `capture()`d gets its graphs
when calls need them. Counted through `stats` and the structures it keeps; outputs always
compared with eager on fresh random inputs."""

from __future__ import annotations

import logging
import threading

import attrs
import pytest
import torch

from graphify import CaptureError, GraphifyError, InputMismatchError, Mode, Options, graphify, persistent, tokens
from graphify._first_use import MAX_EXACT_GRAPHS, MAX_STRUCTURES


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
    for _ in range(3):
        assert torch.equal(g(b), scaled(b))
    assert len(g._first_use.structures) == 2
    assert torch.equal(g(a), scaled(a))  # the first structure still replays
    assert calls_by_mode(g)[Mode.FULL] == 1 + 2 + 1


def test_structures_are_bounded(backend, caplog):
    device = backend[1]
    g = graphify(lambda x: x + 1, options=Options(backend=backend[0]))
    with caplog.at_level(logging.WARNING, logger="graphify"):
        for width in range(1, MAX_STRUCTURES + 4):
            x = torch.randn(2, width, device=device)
            for _ in range(3):
                assert torch.equal(g(x), x + 1)
    assert len(g._first_use.structures) == MAX_STRUCTURES
    assert sum("call structures already have graphs" in r.message for r in caplog.records) == 1


def test_exact_sizes_are_bounded(backend, caplog):
    g = graphify(lambda x: x * 2, options=Options(backend=backend[0]))
    with caplog.at_level(logging.WARNING, logger="graphify"):
        for n in [1] + list(range(1, MAX_EXACT_GRAPHS + 4)):
            x = torch.randn(n, 4, device=backend[1])
            assert torch.equal(g(x), x * 2)
    assert len(g._first_use.current().runtime.table) == MAX_EXACT_GRAPHS
    assert calls_by_mode(g)[Mode.NONE] == 1 + 3  # the first call, and the sizes past the bound
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


def test_an_uncapturable_call_is_an_error_at_its_first_capture(backend):
    g = graphify(lambda x: x * x.sum().item(), options=Options(backend=backend[0]))
    x = torch.randn(3, 4, device=backend[1])
    g(x)  # its first sighting runs eagerly
    with pytest.raises(CaptureError, match=r"_local_scalar_dense"):
        g(x)


def test_calls_a_graph_cannot_take_run_eagerly(backend, caplog):
    w1, w2 = weights(backend[1])
    g = graphify(mlp, options=Options(backend=backend[0]))  # default axes: the weights taken for token rows
    x = torch.randn(4, 16, device=backend[1])
    with caplog.at_level(logging.WARNING, logger="graphify"):
        for _ in range(4):
            assert torch.equal(g(x, w1, w2), mlp(x, w1, w2))
    assert calls_by_mode(g)[Mode.NONE] == 4
    assert sum("cannot be graphed as they are" in r.message for r in caplog.records) == 1


def test_check_compares_a_first_use_table_with_eager(backend):
    g, w1, w2 = first_use(backend)
    for n in (4, 4, 8):
        g(torch.randn(n, 16, device=backend[1]), w1, w2)
    report = g.check(sizes=[4, 8], rtol=1e-4, atol=1e-4)
    assert report.ok, report


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
    with pytest.raises(InputMismatchError, match="'masks' has another structure than at capture"):
        g(y, {"full": other["full"]})
