"""`split(fn, ops, *example)`: cut a function into capturable pieces at graph-unsafe ops.

Tracing uses `make_fx` in symbolic mode. Why make_fx rather than torch.export or a dynamo
backend: it traces plain Python (closures over weights, `functional_call`) to one ATen-level
graph in one call, keeps in-place ops (KV-cache writes, attention writing into an `out`
buffer) as they are instead of functionalising them, and its symbolic shapes tell, for every
intermediate value, which dimensions grow with tokens and which with requests. torch.export
would lift those mutations out of the graph; a dynamo backend traces lazily, on first call,
behind guards.

Only dim 0 of the token- and request-axis arguments is symbolic in the trace (the rest are
constants), so no other dimension is ever taken for a batch dimension.

The result is a frozen `Piecewise`: the stitching program (a `torch.fx.GraphModule` whose
submodules are the pieces) plus, for each piece, whether it is a graph piece (captured per
size) or a split piece (one of `ops`, run eagerly). Calling it runs the stitching program.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.split_module import split_module

from ._writes import outside_writes

__all__ = ["split", "Piecewise", "Piece", "SplitError", "op_name"]


class SplitError(ValueError):
    """`split` could not trace or cut the function; the message says what to change."""


def op_name(op: Any) -> str:
    """'namespace::name' for an op given as an OpOverload, an OpOverloadPacket, a
    `torch.library.custom_op` function or a string."""
    if isinstance(op, str):
        if "::" not in op:
            raise SplitError(f"split: op {op!r} must be written 'namespace::name' (a registered torch.library op)")
        return op.split(".")[0]
    for attr in ("_qualified_op_name", "_qualname", "_name"):  # packets, custom_op objects
        name = getattr(op, attr, None)
        if isinstance(name, str) and "::" in name:
            return name.split(".")[0]
    schema = getattr(op, "_schema", None)
    if schema is not None:
        return schema.name
    raise SplitError(f"split: {op!r} is not a registered op; pass torch.ops.<ns>.<name> or 'ns::name'")


@attrs.frozen
class Piece:
    """One piece of the stitching program."""

    name: str
    kind: str  # "graph" (captured per size) or "split" (run eagerly)
    module: Any = attrs.field(repr=False, eq=False)  # a GraphModule, or a CompiledPiece over one


@attrs.frozen(eq=False)
class Piecewise:
    """A function cut into pieces; see the module docstring. Equal to `fn` in outputs."""

    fn: Callable
    ops: tuple[str, ...]
    program: torch.fx.GraphModule = attrs.field(repr=False)
    pieces: tuple[Piece, ...] = attrs.field(repr=False)
    axes: Any = None
    symbols: Mapping[Any, str] = attrs.field(factory=dict, repr=False)
    compiled: bool = False
    out_axes: tuple = ()
    op_names: frozenset = frozenset()  # every op the trace calls ('aten::mm', 'ns::attention', ...)
    # whether a graph piece may write in place to an input or closed-over tensor (only split
    # ops, run eagerly, do in a model whose attention op writes its KV cache); see `_writes`
    pieces_write_outside: bool = True

    is_split = True

    @property
    def __name__(self) -> str:
        return getattr(self.fn, "__name__", type(self.fn).__name__)

    @property
    def __wrapped__(self) -> Callable:
        return self.fn

    @property
    def num_graph_pieces(self) -> int:
        return sum(p.kind == "graph" for p in self.pieces)

    @property
    def num_split_pieces(self) -> int:
        return sum(p.kind == "split" for p in self.pieces)

    def __call__(self, *args):
        return self.program(*args)

    def specialised(self, num_tokens: int | None):
        """A context in which compiled pieces run their compile for their inputs' exact
        shapes (graphify enters it to capture a size it specialises)."""
        from ._compile import specialised

        return specialised(num_tokens)

    def capture_pieces(self, backend, args: tuple, **settings):
        """Capture every graph piece at the size of `args` (graphify calls this for
        PIECEWISE keys); `settings` are `transforms._schedule.PassSettings`' fields. See
        `transforms._schedule.capture_pieces`."""
        from ._schedule import PassSettings, capture_pieces

        return capture_pieces(self, backend, args, PassSettings(**settings))


def _user_frame(exc: BaseException) -> str:
    """'file:line' of the innermost frame outside torch, where the construct is."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename.replace("\\", "/")]
    return f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""


def _fake_inputs(example: Sequence[Any], layout) -> tuple:
    """Fake copies of the example in which only dim 0 of token- and request-axis arguments
    is symbolic. Every other dimension stays a constant, so a KV cache whose head count
    happens to equal the example's request count is never mistaken for a batch dimension."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = []
    for arg, axis in zip(example, layout):
        if not isinstance(arg, torch.Tensor):
            fakes.append(arg)
            continue
        dynamic = [
            DimDynamic.DYNAMIC if i == 0 and axis.kind.padded else DimDynamic.STATIC
            for i in range(arg.dim())
        ]
        context = StatelessSymbolicContext(dynamic_sizes=dynamic, constraint_sizes=[None] * arg.dim())
        fakes.append(mode.from_tensor(arg, symbolic_context=context))
    return tuple(fakes)


def _trace(fn: Callable, example: Sequence[Any], layout) -> torch.fx.GraphModule:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*_fake_inputs(example, layout))
    except GuardOnDataDependentSymNode as exc:
        raise SplitError(
            f"split({getattr(fn, '__name__', fn)}): cannot trace data-dependent Python control flow{_user_frame(exc)}: "
            f"{str(exc).splitlines()[0]}; a branch or loop on tensor values (if t.any(), .item(), .tolist()) "
            "cannot be in a graph: move it into a registered op and name that op in `ops`, so it runs eagerly"
        ) from None
    except Exception as exc:
        if "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__:
            raise SplitError(
                f"split({getattr(fn, '__name__', fn)}): cannot trace data-dependent Python control flow{_user_frame(exc)}: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0]}; move it into a registered op and name that op in `ops`"
            ) from None
        raise SplitError(
            f"split({getattr(fn, '__name__', fn)}): tracing failed{_user_frame(exc)}: {type(exc).__name__}: {exc}"
        ) from exc


def _symbols(gm: torch.fx.GraphModule, layout) -> dict:
    """Map the symbol of each batch-axis argument's dim 0 to "tokens" or "reqs"."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    symbols: dict = {}
    for node, axis in zip(placeholders, layout):
        val = node.meta.get("val")
        if not axis.kind.padded or not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        expr = val.shape[0].node.expr if isinstance(val.shape[0], torch.SymInt) else None
        if expr is None or not expr.is_symbol:
            raise SplitError(
                f"split: argument {node.target!r} ({axis.kind}) traced with a fixed dim 0 of {val.shape[0]}; trace "
                "with an example that has at least 2 tokens and 2 requests"
            )
        if symbols.get(expr, axis.kind) != axis.kind:
            raise SplitError(
                "split: the function ties the token count to the request count (it only works when they are "
                "equal), so its pieces cannot be cut to a real batch; give requests and tokens separate axes"
            )
        symbols[expr] = axis.kind
    return symbols


def split(
    fn: Callable,
    ops: Iterable[Any],
    *example: Any,
    axes: "Sequence | Mapping | None" = None,
    compile: "bool | dict" = False,
) -> Piecewise:
    """Trace `fn` on `example` and cut it at every call of `ops`.

    **Arguments:**
    - `fn`: the function (weights may be closed over).
    - `ops`: registered ops (torch.library) to split at, such as attention; they run
      eagerly between captured pieces.
    - `example`: one call's arguments; batch axes need at least 2 tokens and 2 requests.
      Only dim 0 of token- and request-axis arguments is traced symbolically.
    - `axes`: as in `graphify` (graphify reuses them when given none itself).
    - `compile`: compile the graph pieces with inductor (True, or a dict of inductor
      options such as `{"max_autotune": True}`): one compile per distinct piece (repeated
      layers share it), dynamic in the batch, and per capture size a static one where
      graphify specialises (`Options(compile_sizes=...)`); see `transforms._compile`.

    **Returns:** a `Piecewise`. Raises `SplitError` for an op that `fn` never calls and for
    code that cannot be traced (data-dependent control flow).

    !!! example
        >>> # graphify(split(step, [torch.ops.graphify_models.unified_attention], *batch), mode="FULL_AND_PIECEWISE")
    """
    names = tuple(dict.fromkeys(op_name(op) for op in ops))
    if not names:
        raise SplitError("split: ops is empty; name at least one op to split at (for no split, graphify fn directly)")
    from graphify.extend import layout_for, param_names

    layout = layout_for("split", param_names(fn, len(example)), axes, example)
    gm = _trace(fn, example, layout)
    found = _ops_called(fn, gm, names)
    symbols = _symbols(gm, layout)
    part, split_ids = _partition(gm, names)
    pieces_write_outside = any(part[n] not in split_ids for n in outside_writes(gm))
    program = split_module(gm, None, lambda node: part[node], keep_original_order=True)
    pieces = []
    for node in program.graph.nodes:
        if node.op == "call_module":
            index = int(node.target.rsplit("_", 1)[-1])
            kind = "split" if index in split_ids else "graph"
            pieces.append(Piece(node.target, kind, getattr(program, node.target)))
    if compile:
        pieces = _compile_graph_pieces(program, pieces, compile if isinstance(compile, dict) else None)
    return Piecewise(
        fn, names, program, tuple(pieces), axes, symbols, bool(compile), _out_axes(gm, symbols), frozenset(found),
        pieces_write_outside,
    )


def _ops_called(fn: Callable, gm: torch.fx.GraphModule, names: tuple[str, ...]) -> set[str]:
    """Every op the trace calls ('aten::mm', ...); `SplitError` if one of `names` is not among them."""
    found = {n.target._schema.name for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "_schema")}
    missing = [n for n in names if n not in found]
    if missing:
        raise SplitError(
            f"split({getattr(fn, '__name__', fn)}): op(s) {missing} do not occur in the traced function; "
            f"ops it calls include {sorted(o for o in found if not o.startswith('aten::'))[:10] or 'only aten ops'}"
        )
    return found


def _partition(gm: torch.fx.GraphModule, names: tuple[str, ...]) -> tuple[dict, set[int]]:
    """Each node's piece number for `split_module`: every call of one of `names` gets a piece
    of its own (a split piece), and the nodes between two such calls share one (a graph
    piece). Returns (piece of each node, the split pieces' numbers)."""
    part: dict = {}
    current = 0
    split_ids = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and getattr(node.target, "_schema", None) is not None and node.target._schema.name in names:
            current += 1
            part[node] = current
            split_ids.add(current)
            current += 1
        else:
            part[node] = current
    return part, split_ids


def _compile_graph_pieces(program: torch.fx.GraphModule, pieces: list, options: dict | None) -> list:
    """The graph pieces compiled with inductor (`transforms._compile`), each set on the
    stitching program in its piece's place; split pieces as they are."""
    from ._compile import compile_pieces

    graph = [p for p in pieces if p.kind == "graph"]
    compiled = dict(zip((p.name for p in graph), compile_pieces([p.module for p in graph], options)))
    for name, piece in compiled.items():
        object.__setattr__(program, name, piece)  # the stitching program calls it in the piece's place
    return [Piece(p.name, p.kind, compiled.get(p.name, p.module)) for p in pieces]


def _out_axes(gm: torch.fx.GraphModule, symbols: Mapping) -> tuple:
    """Per flat output, the batch axis its dim 0 follows ("tokens", "reqs" or None), read
    from the trace's symbolic shapes: graphify cuts outputs by it."""
    from torch.utils import _pytree as pytree

    output = next(n for n in gm.graph.nodes if n.op == "output")
    axes = []
    for value in pytree.tree_leaves(output.args[0]):
        val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        lead = val.shape[0] if isinstance(val, torch.Tensor) and val.dim() else None
        expr = lead.node.expr if isinstance(lead, torch.SymInt) else None
        axes.append(symbols.get(expr))
    return tuple(axes)
