"""What graphify rewrites in dynamo's graph before inductor compiles it, in one place for the
in-process compile (`graphify._compiled.KeptCompiles`) and the worker's saved one
(`graphify._aot`): one-query grouped-query attention without the expanded cache
(`graphify._gqa_fold`, on unless `"fold_gqa": False`) and one-row linears through the GEMV
(`graphify._one_row_linear`, with `"gemv": True`)."""

from __future__ import annotations

from typing import NamedTuple

import torch.fx as fx

from ._gqa_fold import fold_grouped_query_decode
from ._one_row_linear import route_one_row_linears

__all__ = ["Rewritten", "rewrite"]


class Rewritten(NamedTuple):
    folded: int  # attentions folded
    routed: int  # linears routed to `graphify::one_row_linear`


def rewrite(gm: fx.GraphModule, fold_gqa: bool = True, gemv: bool = False) -> Rewritten:
    """Apply the rewrites asked for to `gm` in place; returns how many of each."""
    folded = fold_grouped_query_decode(gm) if fold_gqa else 0
    routed = route_one_row_linears(gm) if gemv else 0
    return Rewritten(folded, routed)
