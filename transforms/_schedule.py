"""PIECEWISE capture of a `Piecewise` at one size, and its replay schedule.

One pass over the stitching program captures each graph piece (its warm-up and capture on
the table's stream, into the shared pool) and runs each split piece eagerly, in program
order. Capture-time references to a piece's outputs are dropped at their last use and the
schedule keeps weak aliases, so the pool reuses memory within a size and across sizes
exactly as liveness allows (SGLang's and vLLM's weak-ref outputs).

Replay walks a flat list of steps: replay a graph piece; or run a split piece eagerly on
inputs cut to the real (unpadded) tokens and requests, using the symbolic shapes the
trace recorded, so an attention op sees the true batch, not the padded one. Values a split
piece returns and a later graph piece reads are copied into buffers the graph was
captured on (an op that writes into an `out` buffer needs no copy).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from graphify.extend import Captured

__all__ = ["capture_pieces", "Schedule"]

_STATIC = object()


def _weak(t, enabled: bool):
    if not enabled or not isinstance(t, torch.Tensor) or not t.is_cuda:
        return t
    from graphify.extend import weak_alias

    return weak_alias(t)


def _sizer_of(placeholder: torch.fx.Node, symbols) -> Callable[[int, int], Any] | None:
    """`_sym_sizer` of a split piece's input, worked out once and kept in the node's meta:
    every captured size asks for the same ones."""
    meta = placeholder.meta
    if "graphify_sizer" not in meta:
        meta["graphify_sizer"] = _sym_sizer(meta.get("val"), symbols)
    return meta["graphify_sizer"]


def _sym_sizer(val, symbols) -> Callable[[int, int], Any] | None:
    """For a traced value with symbolic sizes, a function (tokens, reqs) -> its real shape
    (a tuple for tensors, an int for SymInts); None for values that do not vary."""
    def evaluator(expr):
        free = expr.free_symbols
        if not free:
            return lambda n, r: int(expr)
        if not free <= symbols.keys():
            return None
        return _compiled(expr, tuple(symbols[a] for a in sorted(free, key=str)))

    if isinstance(val, torch.SymInt):
        return evaluator(val.node.expr)
    if isinstance(val, torch.Tensor):
        dims = []
        for d in val.shape:
            ev = evaluator(d.node.expr) if isinstance(d, torch.SymInt) else None
            if ev is not None and d.node.expr.free_symbols:
                dims.append(ev)
            else:
                dims.append(None)  # a dimension that does not grow with the batch: keep it whole
        if all(f is None for f in dims):
            return None
        return lambda n, r: tuple(None if f is None else f(n, r) for f in dims)
    return None


def _compiled(expr, kinds: tuple[str, ...]) -> Callable[[int, int], int]:
    """(tokens, reqs) -> int for a symbolic size. A bare batch symbol (the common case)
    needs no sympy; anything else is lambdified (~0.4 ms, once per input: `_sizer_of`)."""
    import sympy

    args = sorted(expr.free_symbols, key=str)
    if len(args) == 1 and expr == args[0]:
        return (lambda n, r: n) if kinds[0] == "tokens" else (lambda n, r: r)
    f = sympy.lambdify(args, expr, "math")
    return lambda n, r: int(f(*[(n if k == "tokens" else r) for k in kinds]))


def _prefix(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The leading `shape` block of `t` (real tokens come first along every batch dim)."""
    for dim, size in enumerate(shape):
        if size is not None and t.shape[dim] != size:
            t = t.narrow(dim, 0, size)
    return t


@attrs.define(eq=False)
class _GraphStep:
    replay: Callable[[], None]
    copies: tuple  # (dynamic slot, static buffer) pairs: eager results the graph reads


@attrs.define(eq=False)
class _EagerStep:
    fn: Callable
    args: tuple  # per argument: (slot, sizer) for values, or (None, constant)
    out_slot: int
    dispatching: Callable | None = None  # `fn` through torch's dispatcher, where `fn` bypasses it


@attrs.define(eq=False)
class Schedule:
    """Replay of one size: see the module docstring."""

    steps: list
    num_slots: int
    static_values: dict  # slot -> value fixed at capture (graph outputs, inputs, constants)
    final_copies: tuple  # (dynamic slot, static output buffer)
    graphs: list  # keeps the captured graphs alive
    _trimmed: dict = attrs.field(factory=dict)

    def _args_for(self, n: int, r: int) -> list:
        """Per eager step, its arguments with static values cut to (n, r); dynamic
        positions are left None and filled at replay."""
        out = []
        for step in self.steps:
            if isinstance(step, _GraphStep):
                out.append(None)
                continue
            args = []
            for slot, extra in step.args:
                if slot is None:
                    args.append(extra)
                elif slot in self.static_values:
                    value = self.static_values[slot]
                    if extra is not None:
                        real = extra(n, r)
                        value = _prefix(value, real) if isinstance(value, torch.Tensor) else real
                    args.append(value)
                else:
                    args.append(None)
            out.append(args)
        self._trimmed[n, r] = out
        return out

    def replay(self, n: int, r: int, dispatch: bool = False) -> None:
        """Run the schedule for n real tokens and r real requests. `dispatch` calls split
        ops through torch's dispatcher (slower), so a dispatch mode sees them: capture
        records their writes to outside state that way."""
        trimmed = self._trimmed.get((n, r)) or self._args_for(n, r)
        env = [None] * self.num_slots
        statics = self.static_values
        for step, static_args in zip(self.steps, trimmed):
            if static_args is None:
                for slot, dst in step.copies:
                    src = env[slot]
                    _prefix(dst, tuple(src.shape)).copy_(src)
                step.replay()
                continue
            args = list(static_args)
            for i, (slot, _) in enumerate(step.args):
                if slot is not None and slot not in statics:
                    args[i] = env[slot]
            env[step.out_slot] = (step.dispatching or step.fn)(*args) if dispatch else step.fn(*args)
        for slot, dst in self.final_copies:
            src = env[slot]
            _prefix(dst, tuple(src.shape)).copy_(src)


def capture_pieces(
    pw, backend, args: tuple, *, pool, warmups: int, weak_outputs: bool, stream=None, guard: bool = True, keeper=None,
    record: bool = False,
) -> Captured:
    """Capture `pw`'s graph pieces at the size of `args`; returns a `Captured` whose
    `replay(n, r)` runs the schedule for n real tokens and r real requests. Each graph
    piece gets `warmups` eager runs first (0: capture straight away), the first under the
    op guard when `guard`. `keeper` (a `StateKeeper`) learns which storages are graph
    memory (never to be restored: holding them would also keep the pool from reusing
    them) and, with `record`, records the split ops' writes to outside state, which the
    caller undoes after the pass."""
    program = pw.program
    nodes = list(program.graph.nodes)
    last_use: dict = {}
    for i, node in enumerate(nodes):
        for src in node.all_input_nodes:
            last_use[src] = i
    kinds = {p.name: p.kind for p in pw.pieces}
    symbols = pw.symbols
    weak = weak_outputs and backend.name == "cuda"

    slot_of: dict = {}
    static_values: dict = {}
    env: dict = {}  # strong capture-time values, dropped at their last use
    steps: list = []
    graphs: list = []
    nbytes = 0
    final_copies: list = []
    outputs = None

    def new_slot(node, value, static: bool):
        slot = slot_of[node] = len(slot_of)
        if static:
            static_values[slot] = value
        return slot

    def is_static(node) -> bool:
        return slot_of[node] in static_values

    def resolve(a):
        return torch.fx.node.map_arg(a, env.__getitem__)  # C++; pytree's map costs ~70 us a node

    placeholder_i = 0
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            env[node] = args[placeholder_i]
            placeholder_i += 1
            new_slot(node, env[node], True)
        elif node.op == "get_attr":
            env[node] = getattr(program, node.target)
            new_slot(node, env[node], True)
        elif node.op == "call_function":
            value = node.target(*resolve(node.args), **resolve(node.kwargs))
            env[node] = value
            if all(is_static(src) for src in node.all_input_nodes):
                src_static = static_values[slot_of[node.args[0]]] if node.target is operator.getitem else None
                new_slot(node, src_static[node.args[1]] if src_static is not None else value, True)
            else:
                slot = new_slot(node, None, False)
                steps.append(_EagerStep(node.target, tuple(_arg_spec(a, slot_of) for a in node.args), slot))
        elif node.op == "call_module":
            module = getattr(program, node.target)
            inputs = list(resolve(node.args))
            if kinds[node.target] == "graph":
                copies = []
                for j, src in enumerate(node.args):
                    if isinstance(src, torch.fx.Node) and not is_static(src) and isinstance(inputs[j], torch.Tensor):
                        inputs[j] = inputs[j].clone()  # a buffer we own, read by the graph
                        copies.append((slot_of[src], inputs[j]))
                # Inductor-compiled pieces are compiled on their first (warm-up) call: not
                # under the op guard, whose dispatch mode would compile them for fake inputs.
                captured = backend.capture(module, tuple(inputs), pool=pool, warmups=warmups,
                                           weak_outputs=False, stream=stream, guard=guard and not pw.compiled)
                graphs.append(captured.graph if captured.graph is not None else captured)
                if keeper is not None:  # split ops write into these (`out` buffers): graph memory, not outside state
                    keeper.exclude.update(_graph_memory(captured.outputs, inputs, module))
                nbytes += captured.nbytes
                env[node] = captured.outputs
                new_slot(node, pytree.tree_map(lambda t: _weak(t, weak), captured.outputs), True)
                steps.append(_GraphStep(captured.replay, tuple(copies)))
            else:
                env[node] = keeper.record_writes(module, *inputs) if record else module(*inputs)
                direct = _direct_call(module)
                placeholders = [p for p in getattr(program, node.target).graph.nodes if p.op == "placeholder"]
                specs = []
                for a, p in zip(node.args, placeholders):
                    if isinstance(a, torch.fx.Node):
                        specs.append((slot_of[a], _sizer_of(p, symbols) if is_static(a) else None))
                    else:
                        specs.append((None, a))
                steps.append(_EagerStep(direct, tuple(specs), new_slot(node, None, False), module))
        elif node.op == "output":
            flat, spec = pytree.tree_flatten(node.args[0])
            finals = []
            for src in flat:
                if isinstance(src, torch.fx.Node) and not is_static(src):
                    buf = env[src].clone()
                    final_copies.append((slot_of[src], buf))
                    finals.append(buf)
                elif isinstance(src, torch.fx.Node):
                    finals.append(static_values[slot_of[src]])
                else:
                    finals.append(src)
            outputs = pytree.tree_unflatten(finals, spec)
        for src in node.all_input_nodes:  # drop capture-time references at their last use
            if last_use.get(src) == i:
                env.pop(src, None)
    env.clear()
    schedule = Schedule(steps, len(slot_of), static_values, tuple(final_copies), graphs)
    return Captured(schedule.replay, schedule, outputs, nbytes, sized=True)


def _graph_memory(outputs, inputs, module) -> set[int]:
    """Storages of a captured piece's outputs that the piece made: not those of its inputs or
    constants, which a piece may hand on as views (`cache[0]` passed to a split op that
    writes it): writes there are outside state, to be recorded and undone."""
    gm = getattr(module, "original", module)  # a CompiledPiece's traced piece
    held = [*pytree.tree_leaves(inputs)]
    if isinstance(gm, torch.fx.GraphModule):
        held += [functools.reduce(getattr, n.target.split("."), gm) for n in gm.graph.nodes if n.op == "get_attr"]
    theirs = {t.untyped_storage().data_ptr() for t in held if isinstance(t, torch.Tensor)}
    made = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)}
    return made - theirs


def _direct_call(module: torch.fx.GraphModule) -> Callable:
    """For a split piece that is one call of a `torch.library.custom_op` whose result it
    returns (or not at all), that op's Python implementation called directly: at replay the
    dispatcher and the GraphModule wrapper cost more host time than the op itself. Any
    other piece is called as the module."""
    from torch._library.custom_ops import OPDEFS

    nodes = list(module.graph.nodes)
    calls = [n for n in nodes if n.op == "call_function"]
    output = nodes[-1]
    if len(calls) != 1 or len(nodes) != len(calls) + 1 + sum(n.op == "placeholder" for n in nodes):
        return module
    call = calls[0]
    schema = getattr(call.target, "_schema", None)
    opdef = OPDEFS.get(schema.name) if schema is not None else None
    impl = getattr(opdef, "_init_fn", None)
    returns = output.args[0]
    if impl is None or call.kwargs or returns not in ((), None, call, (call,)):
        return module
    placeholders = {n: i for i, n in enumerate(n for n in nodes if n.op == "placeholder")}
    mapping = tuple((placeholders[a], None) if isinstance(a, torch.fx.Node) else (None, a) for a in call.args)

    def direct(*inputs):
        result = impl(*[inputs[i] if i is not None else const for i, const in mapping])
        return (result,) if isinstance(returns, tuple) and returns else result

    return direct


def _arg_spec(a, slot_of):
    if isinstance(a, torch.fx.Node):
        return (slot_of[a], None)
    return (None, a)
