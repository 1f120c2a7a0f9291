"""Default axes (`axes=None`): tensors whose first dimension is the batch's grow with it
(`tokens()`), other tensors keep their shape (`fixed()`), other values are `static()`.
The batch's rows are the first dimension most tensor arguments share, the first tensor's
where counts tie. Property-based over random argument lists."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from graphify.base.axes import Kind, batch_rows, default_axis, layout_for

shapes = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)
arguments = st.lists(st.one_of(shapes.map(torch.zeros), st.none(), st.integers(), st.sampled_from(["a", 2.5])),
                     max_size=7)


@given(arguments)
def test_the_batch_is_the_first_dimension_most_tensors_share(args):
    firsts = [a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
    rows = batch_rows(args)
    if not firsts:
        assert rows is None
        return
    most = max(firsts.count(f) for f in firsts)
    assert firsts.count(rows) == most
    assert firsts.index(rows) == min(firsts.index(f) for f in firsts if firsts.count(f) == most)


@given(arguments)
def test_default_axes_pad_only_tensors_of_the_batchs_rows(args):
    rows = batch_rows(args)
    axes = layout_for("f", [f"a{i}" for i in range(len(args))], None, args)
    for arg, axis in zip(args, axes):
        if not isinstance(arg, torch.Tensor):
            assert axis.kind is Kind.STATIC
        elif arg.dim() > 0 and arg.shape[0] == rows:
            assert axis.kind is Kind.TOKENS
        else:
            assert axis.kind is Kind.FIXED
    assert axes == tuple(default_axis(a, rows) for a in args)


def test_a_mapping_names_some_axes_and_the_rest_take_the_default():
    from graphify import persistent

    ids, mask, pos = torch.zeros(2, 1), torch.zeros(2, 8), torch.zeros(3, 2, 1)
    kinds = [a.kind for a in layout_for("f", ["ids", "mask", "pos"], {"mask": persistent()}, [ids, mask, pos])]
    assert kinds == [Kind.TOKENS, Kind.PERSISTENT, Kind.FIXED]
