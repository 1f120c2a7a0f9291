"""Which ops of a traced graph write to state from outside the call (transforms._writes),
and `split`'s summary of it, which lets capture skip an eager recorded run per size."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from models import BatchLayout, DecoderConfig, init_params, new_paged_cache, split_ops, varlen_axes, varlen_step
from transforms import split
from transforms._writes import outside_writes

CFG = DecoderConfig.tiny(max_seq_len=64)


def writers(fn, *args) -> list[str]:
    gm = make_fx(fn, _allow_non_fake_inputs=True)(*args)
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
