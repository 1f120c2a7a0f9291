"""Which ops of a traced graph write to state from outside the call (transforms._writes),
and `split`'s summary of it, which lets capture skip an eager recorded run per size."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphify import Options, Batching, graphify, persistent, tokens
from graphify.backends.tensor_writes import StateKeeper
from graphify.backends import Captured
from graphify.models import BatchLayout, DecoderConfig, init_params, new_paged_cache, split_ops, varlen_axes, varlen_step
from graphify.transforms import split
from graphify.transforms._writes import outside_writes

CFG = DecoderConfig.tiny(max_seq_len=64)


def writers(fn, *args) -> list[str]:
    gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)  # as split traces
    return [n.target._schema.name if hasattr(n.target, "_schema") else str(n.target) for n in outside_writes(gm)]


def test_indexed_writes_into_an_input_are_found():
    def f(x, idx, buf):
        buf.index_copy_(0, idx, x * 2)
        return buf.sum()

    assert writers(f, torch.randn(3, 4), torch.tensor([0, 2, 5]), torch.randn(8, 4)) == ["aten::index_copy_"]


def test_writes_into_tensors_made_in_the_call_are_not():
    def f(x):
        y = x.clone()
        y.add_(1)
        out = torch.empty_like(x)
        torch.mul(x, 3, out=out)
        return y + out

    assert writers(f, torch.randn(3, 4)) == []


def test_writes_through_a_view_and_an_out_argument_reach_the_input():
    def f(x, buf):
        buf[:2].mul_(2)  # a view of the input
        torch.add(x, 1, out=buf[2:5])
        return x

    assert writers(f, torch.randn(3, 4), torch.randn(8, 4)) == ["aten::mul_", "aten::add"]


def test_writes_into_chunks_of_an_input_reach_it():
    def f(x, buf):
        a, b = buf.split(4)  # a list of views: its schema names no alias set at the top
        b.add_(x)
        c = buf.unbind(0)[1]
        c.zero_()
        return a.sum()

    assert writers(f, torch.randn(4, 4), torch.randn(8, 4)) == ["aten::add_", "aten::zero_"]


def test_a_view_whose_schema_does_not_say_so_still_reaches_the_input():
    def f(x, buf):
        torch.ops.aten._unsafe_view(buf, (2, 4)).add_(x)
        return x

    assert writers(f, torch.randn(2, 4), torch.randn(8)) == ["aten::add_"]


def test_a_tensor_set_to_an_inputs_storage_is_outside_state():
    def f(x, buf):
        y = torch.empty(0)
        y.set_(buf)
        y.mul_(2)
        return x + 1

    assert writers(f, torch.randn(3), torch.randn(3)) == ["aten::mul_"]  # set_ itself writes only y


def test_views_and_writes_that_schemas_do_not_declare_are_found():
    def f(x, buf, rm, rv):
        torch.unsafe_split(buf, 4)[1].add_(1)  # a view, though its schema returns plain tensors
        torch.ops.aten.lift(buf).mul_(2)  # returns its argument
        # training batch norm updates the running statistics, undeclared in its schema
        return torch.nn.functional.batch_norm(x, rm, rv, training=True)

    found = writers(f, torch.randn(4, 3), torch.randn(8), torch.zeros(3), torch.ones(3))
    assert found[:2] == ["aten::add_", "aten::mul_"] and len(found) == 3 and "batch_norm" in found[2]


def test_the_write_recorder_restores_what_schemas_do_not_declare():
    x, buf, rm, rv = torch.randn(4, 3), torch.randn(8), torch.randn(3), torch.rand(3) + 0.5
    before = [t.clone() for t in (buf, rm, rv)]

    def f():
        torch.unsafe_split(buf, 4)[1].add_(1)
        return torch.nn.functional.batch_norm(x, rm, rv, training=True)

    keeper = StateKeeper()
    keeper.record_writes(f)
    assert not torch.equal(rm, before[1])  # the run did write
    keeper.restore()
    for t, b in zip((buf, rm, rv), before):
        assert torch.equal(t, b)


def test_covering_records_nothing_and_nests():
    t = torch.zeros(4)
    keeper = StateKeeper()
    keeper.record_writes(lambda: t.add_(1))
    assert len(keeper.undo) == 1
    with keeper.covering():
        with keeper.covering():
            pass
        keeper.record_writes(lambda: t.add_(1))  # still covered after the inner block
        assert len(keeper.undo) == 1
    with pytest.raises(RuntimeError), keeper.covering():
        raise RuntimeError
    u = torch.ones(4)
    keeper.record_writes(lambda: u.add_(1))  # an exception inside resets it
    assert len(keeper.undo) == 2
    keeper.restore()
    assert torch.equal(t, torch.zeros(4)) and torch.equal(u, torch.ones(4))


def test_a_closed_over_tensor_is_outside_state():
    counter = torch.zeros(())

    def f(x):
        counter.add_(1)
        return x * counter

    assert writers(f, torch.randn(3)) == ["aten::add_"]


def model():
    params = init_params(CFG, seed=3)
    step = varlen_step(CFG, params, "unified")
    cache = new_paged_cache(CFG, 64, 4, seed=4)
    example = BatchLayout((3, 1, 5), (4, 7, 0), block_size=4, max_blocks=16).build(CFG)
    return step, cache, example


def test_a_model_whose_attention_op_writes_its_cache_has_pieces_that_write_nothing_outside():
    step, cache, example = model()
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes())
    assert pw.pieces_write_outside is False
    # the attention op itself writes the cache: the analysis sees it, in a split piece
    gm = make_fx(step, _allow_non_fake_inputs=True)(*example, cache)
    assert {n.target._schema.name for n in outside_writes(gm)} == {"graphify_models::unified_attention"}


@pytest.mark.parametrize("where", ["closure", "cache"])
def test_a_graph_piece_that_writes_outside_state_is_flagged(where):
    step, cache, example = model()
    counter = torch.zeros(())

    def counted(*args):
        if where == "closure":
            counter.add_(1)
        else:
            args[-1][0, 0, 0].add_(1)  # a write into the cache outside the attention op
        return step(*args)

    assert split(counted, split_ops("unified"), *example, cache, axes=varlen_axes()).pieces_write_outside is True


@torch.library.custom_op("graphify_tests::write_rows", mutates_args=("buf",))
def write_rows(buf: torch.Tensor, x: torch.Tensor) -> None:
    buf[: x.shape[0]].copy_(x)


@write_rows.register_fake
def _(buf, x):
    return None


class CudaLike:
    """Captures as the CUDA backend does for this purpose: the piece runs, and its outputs
    are the run's own tensors (views of inputs stay views)."""

    name = "cuda"

    def capture(self, fn, args, *, pool, warmups, weak_outputs, stream=None, guard=True, keeper=None):
        return Captured(lambda: None, None, fn(*args), 0)


def test_a_split_op_writing_a_view_a_graph_piece_hands_it_is_recorded():
    """The piece hands the op `cache[0]`: its storage is the cache's, outside state, not
    graph memory, so the op's writes are recorded as it runs and undone after the pass."""

    def f(x, cache):
        y = x * 2
        write_rows(cache[0], y)
        return y + 1

    cache, example = torch.randn(2, 64, 8), torch.randn(8, 8)
    pw = split(f, [torch.ops.graphify_tests.write_rows], example, cache, axes=(tokens(), persistent()))
    assert pw.pieces_write_outside is False and [p.kind for p in pw.pieces] == ["graph", "split", "graph"]
    keeper, before = StateKeeper(exclude=set()), cache.clone()
    captured = pw.capture_pieces(CudaLike(), (example, cache), pool=None, warmups=0, weak_outputs=False, keeper=keeper,
                                 record=True)
    assert cache.untyped_storage().data_ptr() not in keeper.exclude
    keeper.restore()
    keeper.forget()
    assert torch.equal(cache, before)
    keeper.record_writes(captured.graph.replay, 8, 8, True)  # what a FULL key's warm-up learns from
    keeper.restore()
    assert len(keeper.undo) == 1 and torch.equal(cache, before)


@pytest.mark.parametrize("compile", [False, True], ids=["plain", "inductor"])
@pytest.mark.parametrize("piece_writes", [False, True], ids=["attention-writes", "piece-writes-too"])
def test_capture_leaves_state_as_found_and_takes_the_schedule_path_only_where_it_may(monkeypatch, compile, piece_writes):
    """The simulation runs what it captures, so unrecorded writes would show here; compiled
    FULL keys after the first learn their warm-ups' writes from the schedule (covered) only
    where no graph piece writes outside state."""
    step, cache, example = model()
    counter = torch.zeros(())
    covered = []
    real = StateKeeper.covering
    monkeypatch.setattr(StateKeeper, "covering", lambda self: (covered.append(1), real(self))[1])

    def fn(*args):
        if piece_writes:
            counter.add_(1)
        return step(*args)

    pw = split(fn, split_ops("unified"), *example, cache, axes=varlen_axes(), compile=compile)
    is_uniform = lambda *args: bool((args[3] == 2).all())  # noqa: E731
    before, count = cache.clone(), counter.clone()
    graphify(pw, mode="FULL_AND_PIECEWISE", sizes=(8, 16, 32), batching=Batching(uniform_query_len=2, uniform=is_uniform), options=Options(backend="sim")).capture(*example, cache)
    assert torch.equal(cache, before) and torch.equal(counter, count)
    assert len(covered) == (2 if compile and not piece_writes else 0)  # FULL keys of 16 and 8 tokens
