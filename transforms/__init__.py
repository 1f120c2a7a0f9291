"""Composable transforms used with `graphify`: `split(fn, ops, *example)` cuts a function
at graph-unsafe ops so `graphify(split(...), mode="PIECEWISE" | "FULL_AND_PIECEWISE")`
captures the pieces between them."""

from .split import Piece, Piecewise, SplitError, op_name, split

__all__ = ["Piece", "Piecewise", "SplitError", "op_name", "split"]
