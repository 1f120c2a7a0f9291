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

from graphify.extend import Captured, CompiledCode

__all__ = ["capture_pieces", "PassSettings", "Schedule"]



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
    needs no sympy; anything else is lambdified (once per input: `_sizer_of`)."""
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


@attrs.frozen
class PassSettings:
    """How one capture pass captures its graph pieces (`capture_pieces`' keywords)."""

    pool: Any
    warmups: int
    weak_outputs: bool
    stream: Any = None
    guard: bool = True
    keeper: Any = attrs.field(default=None, eq=False)
    record: bool = False


def capture_pieces(pw, backend, args: tuple, settings: PassSettings) -> Captured:
    """Capture `pw`'s graph pieces at the size of `args`; returns a `Captured` whose
    `replay(n, r)` runs the schedule for n real tokens and r real requests. Each graph
    piece gets `settings.warmups` eager runs first (0: capture straight away), the first
    under the op guard when `settings.guard`. `settings.keeper` (a `StateKeeper`) learns
    which storages are graph memory (never to be restored: holding them would also keep
    the pool from reusing them) and, with `settings.record`, records the split ops' writes
    to outside state, which the caller undoes after the pass."""
    capture = _CapturePass(pw, backend, settings)
    try:
        outputs = capture.run(*args, enable_io_processing=False)
    finally:
        capture.env.clear()  # values no later node read (and, after an error, every value)
    schedule = Schedule(capture.steps, len(capture.slot_of), capture.static_values, tuple(capture.final_copies),
                        capture.graphs)
    return Captured(schedule.replay, schedule, outputs, capture.nbytes, sized=True)


class _CapturePass(torch.fx.Interpreter):
    """One pass over the stitching program in program order: each graph piece captured, each
    split piece run eagerly, and the replay schedule written down as the pass goes.
    `torch.fx.Interpreter` drops each capture-time value after its last use
    (`garbage_collect_values`), so the pool reuses a piece's output memory within the size
    exactly as liveness allows; the schedule keeps weak aliases of them.

    Every node gets a slot: static slots hold a value fixed at capture (inputs, constants,
    graph piece outputs), dynamic ones a value each replay computes (split op results)."""

    def __init__(self, pw, backend, settings: PassSettings):
        super().__init__(pw.program, garbage_collect_values=True)
        self.extra_traceback = False  # a capture's error reaches graphify as raised, not reworded
        self.pw, self.backend, self.settings = pw, backend, settings
        self.kinds = {p.name: p.kind for p in pw.pieces}
        self.weak = settings.weak_outputs and backend.name == "cuda"
        self.slot_of: dict = {}
        self.static_values: dict = {}  # slot -> value fixed at capture
        self.steps: list = []
        self.graphs: list = []
        self.final_copies: list = []
        self.nbytes = 0
        self.node: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        # `Interpreter.run_node` less its per-node context manager (fx_traceback's current
        # node meta, which matters only under `preserve_node_meta`) and debug log: host time
        # at every captured size, for nothing here.
        self.node = n  # the handlers below read its arguments' slots
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return getattr(self, n.op)(n.target, args, kwargs)

    def _slot(self) -> int:
        """A dynamic slot for the current node: each replay computes its value."""
        slot = self.slot_of[self.node] = len(self.slot_of)
        return slot

    def _static_slot(self, value) -> int:
        """A static slot for the current node, holding `value` (fixed at capture)."""
        slot = self._slot()
        self.static_values[slot] = value
        return slot

    def _static(self, node) -> bool:
        return self.slot_of[node] in self.static_values

    def placeholder(self, target, args, kwargs):
        value = super().placeholder(target, args, kwargs)
        self._static_slot(value)
        return value

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        self._static_slot(value)
        return value

    def call_function(self, target, args, kwargs):
        value = super().call_function(target, args, kwargs)
        node = self.node
        if all(self._static(src) for src in node.all_input_nodes):
            # an item of a graph piece's outputs: the schedule keeps the (weak) static one
            whole = self.static_values[self.slot_of[node.args[0]]] if target is operator.getitem else None
            self._static_slot(whole[node.args[1]] if whole is not None else value)
        else:
            slot = self._slot()
            self.steps.append(_EagerStep(target, tuple(self._arg(a, None) for a in node.args), slot))
        return value

    def call_module(self, target, args, kwargs):
        if self.kinds[target] == "graph":
            return self._capture_piece(target, list(args))
        return self._run_split_piece(target, args)

    def _capture_piece(self, target: str, inputs: list):
        node, module, settings = self.node, self.fetch_attr(target), self.settings
        copies = []
        for j, src in enumerate(node.args):
            if isinstance(src, torch.fx.Node) and not self._static(src) and isinstance(inputs[j], torch.Tensor):
                inputs[j] = inputs[j].clone()  # a buffer we own, read by the graph
                copies.append((self.slot_of[src], inputs[j]))
        # Inductor-compiled pieces are compiled on their first (warm-up) call: not under the
        # op guard, whose dispatch mode would compile them for fake inputs.
        captured = self.backend.capture(
            CompiledCode(module) if self.pw.compiled else module, tuple(inputs), pool=settings.pool,
            warmups=settings.warmups, weak_outputs=False, stream=settings.stream,
            guard=settings.guard and not self.pw.compiled,
        )
        self.graphs.append(captured.graph if captured.graph is not None else captured)
        if settings.keeper is not None:  # split ops write into these (`out` buffers): graph memory, not outside state
            settings.keeper.exclude.update(_graph_memory(captured.outputs, inputs, module))
        self.nbytes += captured.nbytes
        self._static_slot(pytree.tree_map(lambda t: _weak(t, self.weak), captured.outputs))
        self.steps.append(_GraphStep(captured.replay, tuple(copies)))
        return captured.outputs

    def _run_split_piece(self, target: str, inputs: tuple):
        node, module, settings = self.node, self.fetch_attr(target), self.settings
        value = settings.keeper.record_writes(module, *inputs) if settings.record else module(*inputs)
        placeholders = [p for p in module.graph.nodes if p.op == "placeholder"]
        specs = tuple(self._arg(a, p) for a, p in zip(node.args, placeholders))
        self.steps.append(_EagerStep(_direct_call(module), specs, self._slot(), module))
        return value

    def _arg(self, a, placeholder: torch.fx.Node | None) -> tuple:
        """How an eager step gets one argument: (slot, sizer) for a node's value, the sizer
        cutting a static value to the real batch; (None, a) for a constant."""
        if not isinstance(a, torch.fx.Node):
            return (None, a)
        sizer = _sizer_of(placeholder, self.pw.symbols) if placeholder is not None and self._static(a) else None
        return (self.slot_of[a], sizer)

    def output(self, target, args, kwargs):
        """The pass's outputs: a dynamic value copied into a buffer of its own, which every
        replay refills (`final_copies`); static values as they are."""
        finals = []
        flat, spec = pytree.tree_flatten(self.node.args[0])
        for src in flat:
            if isinstance(src, torch.fx.Node) and not self._static(src):
                buf = self.env[src].clone()
                self.final_copies.append((self.slot_of[src], buf))
                finals.append(buf)
            elif isinstance(src, torch.fx.Node):
                finals.append(self.static_values[self.slot_of[src]])
            else:
                finals.append(src)
        return pytree.tree_unflatten(finals, spec)


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
