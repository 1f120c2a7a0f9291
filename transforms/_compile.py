"""Compiled graph pieces: one inductor compile per distinct piece, plus per-size static ones.

`split(..., compile=True)` compiles each graph piece with inductor. Pieces with the same
code (the repeated layers of a model: their weights are inputs of the piece, so layer 7's
piece is layer 3's with other tensors) share one compile, so a 24-layer model compiles
three pieces, not twenty-five (SGLang's stage 2 and vLLM's piecewise backend do the same
through inductor's graph cache).

Each distinct piece has:
- a dynamic-shape compile (dynamic in the batch dimensions the split trace made symbolic),
  the fallback for every size and for eager calls;
- static-shape compiles, made lazily when a capture of a chosen size first runs the piece
  (SGLang's stage 3, vLLM's `compile_sizes`): inside `specialised(n)` (graphify's capture
  of a key of n tokens, for n in `Options(compile_sizes=...)`) a piece runs the compile
  specialised to its inputs' exact shapes, and the captured graph records those kernels.
  Size 1 is always specialised: the dynamic compile assumes batch dimensions of at least 2
  (the split trace's), as torch.compile's 0/1 specialisation does.

Compiles go through `torch._inductor.standalone_compile` (no dynamo: the pieces are already
ATen graphs), so torch's inductor caches (FX graph, AOTAutograd, Triton, autotuning) serve
a second process on the same machine, and `torch.compiler.save_cache_artifacts()` ships
them as one file. Where standalone compilation fails, `torch.compile` does the same job.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from graphify.extend import taping

__all__ = ["CompiledPiece", "piece_key", "compile_pieces", "specialised"]

log = logging.getLogger("graphify")
_local = threading.local()


@contextlib.contextmanager
def specialised(num_tokens: int | None):
    """Within: compiled pieces run their static compile for their inputs' exact shapes
    (None: the dynamic one). graphify's capture enters it for the sizes it specialises."""
    previous = getattr(_local, "tokens", None)
    _local.tokens = num_tokens
    try:
        yield
    finally:
        _local.tokens = previous


def piece_key(gm: torch.fx.GraphModule) -> str:
    """The piece's code with its placeholders named by position, plus each placeholder's
    shape, stride and dtype as traced: equal keys mean one compile serves both pieces."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    code = gm.code
    for i, name in enumerate(names):
        code = re.sub(rf"(?<![.\w]){re.escape(name)}\b", f"__in{i}", code)  # not `aten.empty_like`
    metas = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("val")
            metas.append((str(tuple(v.shape)), str(v.stride()), str(v.dtype)) if isinstance(v, torch.Tensor) else str(v))
    return code + repr(metas)


class _Shared:
    """One distinct piece's compiles: dynamic (made on first call) and static per input
    signature (made on first call inside `specialised`)."""

    def __init__(self, gm: torch.fx.GraphModule, options: dict):
        self.gm, self.options = gm, options
        self.traced = tuple(n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder")
        self.dynamic: Callable | None = None
        self.static: dict = {}
        self.lock = threading.Lock()
        self.failed: str | None = None  # why inductor's code for this piece failed at run time, once it has

    def run(self, inputs: Sequence[Any]):
        tokens = getattr(_local, "tokens", None)
        if tokens is not None or _has_unit_batch(self.traced, inputs):
            return self._static(inputs)(*inputs)
        fn = self.dynamic
        if fn is None:
            with self.lock:
                if self.dynamic is None:
                    self.dynamic = _compile(self.gm, self.traced, "from_graph", self.options)
                fn = self.dynamic
        return fn(*inputs)

    def _static(self, inputs: Sequence[Any]) -> Callable:
        key = tuple((tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t for t in inputs)
        fn = self.static.get(key)
        if fn is None:
            with self.lock:
                fn = self.static.get(key)
                if fn is None:
                    fn = self.static[key] = _compile(self.gm, inputs, "from_example_inputs", self.options)
        return fn


class CompiledPiece:
    """What the stitching program calls in place of one graph piece (see the module
    docstring); `original` is the uncompiled piece."""

    def __init__(self, shared: _Shared, original: torch.fx.GraphModule):
        self.shared, self.original = shared, original

    def __call__(self, *inputs):
        # The piece as traced runs instead where inductor's code must not: while the CPU
        # simulation records ATen ops (inductor's kernels hide them), and under a dispatch
        # mode (capture's op guard, its write recorder): a compile made there fails or
        # falls back to eager for good, and that fallback would be kept for the size.
        if taping() or _get_current_dispatch_mode() is not None or self.shared.failed:
            return self.original(*inputs)
        try:
            return self.shared.run(inputs)
        except torch.OutOfMemoryError:
            raise  # the piece as traced needs the memory too
        except Exception as exc:  # noqa: BLE001 - a call eager can run does not raise (inductor's shape asserts, say)
            self.shared.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn(f"graphify: an inductor-compiled piece failed at run time ({self.shared.failed}); this "
                          "piece runs as traced from now on, and the others stay compiled. Report it with the "
                          "shapes of the call, or use split(..., compile=False)", stacklevel=2)
            return self.original(*inputs)

    @property
    def static_compiles(self) -> int:
        return len(self.shared.static)


def compile_pieces(modules: Sequence[torch.fx.GraphModule], options: dict | None = None) -> list[CompiledPiece]:
    """A `CompiledPiece` per module; modules with equal `piece_key`s share their compiles."""
    shared: dict[str, _Shared] = {}
    out = []
    for gm in modules:
        key = piece_key(gm)
        if key not in shared:
            shared[key] = _Shared(gm, dict(options or {}))
        out.append(CompiledPiece(shared[key], gm))
    return out


def _has_unit_batch(traced_inputs: Sequence[Any], inputs: Sequence[Any]) -> bool:
    """Whether a traced-symbolic dimension of an input is 1 now (the dynamic compile
    assumes at least 2)."""
    for traced, value in zip(traced_inputs, inputs):
        if isinstance(traced, torch.SymInt):
            if value == 1:
                return True
        elif isinstance(traced, torch.Tensor) and isinstance(value, torch.Tensor):
            if any(isinstance(d, torch.SymInt) and v == 1 for d, v in zip(traced.shape, value.shape)):
                return True
    return False


def _compile(gm: torch.fx.GraphModule, inputs: Sequence[Any], shapes: str, options: dict) -> Callable:
    """inductor over `gm`: "from_graph" (dynamic as traced: `inputs` are the traced fake
    values, only the batch dimensions symbolic) or "from_example_inputs" (the inputs' exact
    shapes), through standalone_compile; torch.compile where that fails."""
    try:
        from torch._inductor import standalone_compile

        if shapes == "from_graph":
            _carry_fake_mode(gm)
        return standalone_compile(gm, list(inputs), dynamic_shapes=shapes, options={"config_patches": options})
    except Exception as exc:  # an older torch, or a graph standalone compilation refuses
        log.warning("graphify: inductor's standalone compile failed (%s: %s); using torch.compile",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        twin = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # its own code object: its own compile cache
        return torch.compile(twin, dynamic=shapes == "from_graph", fullgraph=True, options=options or None)


def _carry_fake_mode(gm: torch.fx.GraphModule) -> None:
    """Give the piece's outputs their traced fake values as `example_value`, where
    standalone_compile's "from_graph" looks for the fake mode to compile in. Without it,
    torch 2.11 compiles in a fresh one that re-makes every dimension of the inputs
    symbolic, sizes that are equal in the example sharing one symbol: a piece traced with 8
    tokens and 8 heads (8B at TP=4) then asserts tokens == heads at every other size."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for node in torch.utils._pytree.tree_leaves(out.args[0]):
        if isinstance(node, torch.fx.Node) and "example_value" not in node.meta and "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]
