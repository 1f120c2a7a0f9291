"""Which calls the compile line compiles with dynamic shapes, and which per captured shape.

A graph replays one shape, so a compile for that exact shape costs no generality; a dynamic
compile is shared by every shape of a kind of call, so it costs one compile instead of one per
shape. graphify compiles dynamically (a transformers `generate()` loop meets new lengths all the
time) except where inductor's own code says dynamic shapes cost speed: it chooses channels-last
layouts for 2-D and 3-D convolutions only when their shapes are static (`decide_layout_opt`,
"perf regression with dynamic shape", pytorch#102670). Over ResNet-50 and EfficientNet-B0 a
dynamic compile ran 1.5-2.2x the time of reduce-overhead's static one, and a compile per shape
as fast or faster (`benchmarks/results/zoo-prof-*`, H200).

So under `dynamic="auto"` (the default) the dynamic compile's backend refuses a traced graph
holding such a convolution over symbolic shapes (`Specialise`, raised before any kernel is
built), and the function is compiled per shape from then on (`dynamic=False`). Not where
inductor would skip the layout at static shapes too: a graph of 300 nodes or more per
convolution ("only a few conv": a ViT's one patch embedding among 600 nodes), where a compile
per shape would buy nothing. Counted on dynamo's graph, which has fewer nodes than the ATen
graph inductor counts, so a borderline graph is still compiled per shape.

Any other function under `dynamic="auto"` compiles its first shape static, as torch.compile's
own default does: a function called at one shape (a classifier, an encoder served at one
length, a decoder's prefill at one length) gets the static shape's kernels and trace, where a
dynamic trace took 2-4x as long (a Llama-1B shape, CPU) and its kernels ran the sequence length
as a symbol. A call whose arguments differ from the first call's (`call_signature`: their
shapes, dtypes and plain values) goes to the dynamic compile, from then on: one compile for
the sizes to come (dynamo's own default makes each changed dimension dynamic in turn, a
compile each). Decided before the call, on its arguments, so no call is stopped part-way. A
call that carries an object holding state (a transformers cache: `generate()`'s steps, whose
cache is a new object of another length each `generate()`) is a loop's, compiled dynamically
from the start. So is a compile in a worker (`Options(compile="background")`): one compile the
worker makes serves every later shape. The first call's signature is kept per model class (or
function) and compile settings (`FirstShape`), not per graphified function: a model graphified
again, or a second model of its class, at another shape goes to the dynamic compile at once and
reuses the one already made, where a record of its own would compile each new wrapper's first
shape static again (the zoo, a new wrapper per shape: 7-10 s a shape on the H200 for BERT-base,
against 0.2 s reusing the dynamic compile), each an entry on the code's cache until dynamo's
recompile limit runs the rest eagerly. A call whose signature matches but whose static compile
compiles again (a state the signature does not see changed: a tensor the function reads, another
model's parameter shapes) is that compile's last: every call after goes to the dynamic compile.

A module whose leaf modules are convolutions often enough (one in `LEAVES_PER_CONVOLUTION`
or more: a CNN, never a ViT) is compiled per shape from the start, without the dynamic trace
the backend would refuse: that trace was 1.5-2 s of ResNet-50's first compile on the H200
(dynamo's tracing 3.2-3.6 s against reduce-overhead's 1.8 s). A dynamo graph holds two to
four nodes a leaf module (the op, its parameters' placeholders), so such a module's graphs
hold well under `NODES_PER_CONVOLUTION` nodes a convolution; modules in between are decided
on their traced graphs as above.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

__all__ = ["AUTO", "Specialise", "wants_static", "asked_to_specialise", "per_shape_from_the_start", "call_signature",
           "FirstShape", "first_shape", "convolution_nodes", "Convolution"]

AUTO = "auto"  # `Options(compile={"dynamic": ...})`'s default: static first, then dynamic (per shape: convolutions)
NODES_PER_CONVOLUTION = 300  # inductor's `decide_layout_opt`: at or above, no channels-last layout at any shape
LEAVES_PER_CONVOLUTION = 50  # at or below, a module compiles per shape without a dynamic trace first
_CONVOLUTION_MODULES = (torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)

_TRANSPOSED = frozenset({torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d,
                         torch.nn.functional.conv_transpose1d, torch.nn.functional.conv_transpose2d,
                         torch.nn.functional.conv_transpose3d})
_CONVOLUTIONS = frozenset({torch.conv1d, torch.conv2d, torch.conv3d, torch.convolution, torch.nn.functional.conv1d,
                           torch.nn.functional.conv2d, torch.nn.functional.conv3d,
                           torch.ops.aten.convolution.default}) | _TRANSPOSED


class Specialise(Exception):
    """Raised by a dynamic compile's backend: this graph compiles per shape instead."""


def _value(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None


class Convolution(NamedTuple):
    """One convolution of a traced graph, as example values (`out` None where it has none)."""

    x: torch.Tensor
    w: torch.Tensor
    out: "torch.Tensor | None"
    transposed: bool
    groups: int
    geometry: tuple = (1, 0, 1)  # stride, padding (or "same", "valid"), dilation, as the call gave them


_GROUPS_AT = {torch.convolution: 8, torch.ops.aten.convolution.default: 8}  # else 6 (conv*d, conv_transpose*d)


def _transposed(node) -> bool:
    if node.target in _TRANSPOSED:
        return True
    if node.target not in _GROUPS_AT:
        return False
    return (node.args[6] if len(node.args) > 6 else node.kwargs.get("transposed", False)) is True


def _groups(node) -> int:
    at = _GROUPS_AT.get(node.target, 6)
    groups = node.args[at] if len(node.args) > at else node.kwargs.get("groups", 1)
    return groups if isinstance(groups, int) else 1


_GEOMETRY = (("stride", 1), ("padding", 0), ("dilation", 1))  # arguments 3 to 5 of every convolution above


def _geometry(node) -> tuple:
    return tuple(node.args[3 + i] if len(node.args) > 3 + i else node.kwargs.get(name, default)
                 for i, (name, default) in enumerate(_GEOMETRY))


def convolution_nodes(gm: torch.fx.GraphModule) -> list[Convolution]:
    """The traced graph's convolutions, 1-D to 3-D. Pure."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _CONVOLUTIONS:
            continue
        x, w, out = (_value(a) for a in (*node.args[:2], node))
        if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() >= 3:
            found.append(Convolution(x, w, out if isinstance(out, torch.Tensor) else None, _transposed(node),
                                     _groups(node), _geometry(node)))
    return found


def wants_static(gm: torch.fx.GraphModule) -> bool:
    """Whether a traced graph holds 2-D or 3-D convolutions, one of them over a symbolic
    size, and fewer than `NODES_PER_CONVOLUTION` nodes per convolution: one inductor would
    lay out channels-last at static shapes and not at these. Pure."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    convolutions = [(c.x, c.w) for c in convolution_nodes(gm) if c.w.dim() >= 4]
    symbolic = any(free_symbols(x) or free_symbols(w) for x, w in convolutions)
    return symbolic and len(gm.graph.nodes) < NODES_PER_CONVOLUTION * len(convolutions)


def asked_to_specialise(exc: BaseException) -> bool:
    """Whether `exc` (dynamo wraps a backend's error) is, or was caused by, `Specialise`."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, Specialise):
            return True
        exc = exc.__cause__ or exc.__context__ or getattr(exc, "inner_exception", None)
        seen += 1
    return False


def per_shape_from_the_start(fn) -> bool:
    """Whether `fn` is (or is a method of) a module with a 2-D or 3-D convolution module in
    every `LEAVES_PER_CONVOLUTION` of its leaf modules or fewer: one whose traced graphs
    `wants_static` would refuse dynamic. Pure (reads the module tree)."""
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(module, torch.nn.Module):
        return False
    leaves = convolutions = 0
    for m in module.modules():
        if next(m.children(), None) is None:
            leaves += 1
            convolutions += isinstance(m, _CONVOLUTION_MODULES)
    return convolutions > 0 and leaves <= LEAVES_PER_CONVOLUTION * convolutions


_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device)
_OPAQUE = object()  # an argument that is neither a tensor nor a plain value


def call_signature(args: tuple, kwargs: dict):
    """What a static compile specialises on in a call's arguments: each tensor's shape, strides,
    dtype and device, each plain value (numbers, strings, None, dtypes, devices), and the
    structure of the tuples, lists and dicts holding them. None where an argument is anything
    else: an object that holds state, such as a cache a loop replaces with one of another
    size. Pure."""
    def of(value, depth: int = 0):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device)
        if isinstance(value, _PLAIN):
            return (type(value), value)
        if depth < 4 and isinstance(value, (tuple, list)):
            return (type(value), tuple(of(v, depth + 1) for v in value))
        if depth < 4 and isinstance(value, dict):
            return (type(value), tuple((k, of(v, depth + 1)) for k, v in value.items()))
        return _OPAQUE

    signature = (of(args), of(kwargs))
    return None if _holds(signature, _OPAQUE) else signature


def _holds(signature, item) -> bool:
    if signature is item:
        return True
    return isinstance(signature, tuple) and any(_holds(s, item) for s in signature)


class FirstShape:
    """The first call's signature (`call_signature`) of the functions of one model class (or
    function) compiled with one compile's settings, until a call of another signature (or one
    carrying an object that holds state), or a second compile of the static one, makes them
    dynamic for good."""

    __slots__ = ("signature", "dynamic", "compiled")

    def __init__(self):
        self.signature, self.dynamic, self.compiled = None, False, False

    def static(self, signature) -> bool:
        """Whether a call of `signature` goes to the first shape's static compile."""
        if not self.dynamic and signature is not None and self.signature in (None, signature):
            self.signature = signature
            return True
        self.dynamic = True
        return False

    def ran(self, compiled: bool) -> None:
        """After a call went to the static compile: whether that call compiled. The first that
        did made the static compile; another one means the static compile no longer serves."""
        if compiled:
            self.dynamic, self.compiled = self.compiled, True


# By the static compile's backend (shared by the functions compiled with the same settings,
# `graphify.compile.compiled.shared_backend`), then by the function's kind; gone with the backend.
_FIRSTS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def first_shape(fn, backend) -> FirstShape:
    """The `FirstShape` shared under `backend` by `fn`'s kind: a module's class and `forward` (a
    module and its bound `forward` are one), a bound method's class and function, a plain
    function's code. One of its own for a closure (graphify's compiles claim a closure's code
    one closure at a time, `graphify.compile.code_claims`, so closures of one code share no
    compiled entries), a partial, or another callable object."""
    if isinstance(fn, torch.nn.Module):
        key = (type(fn), type(fn).forward)
    elif getattr(fn, "__self__", None) is not None and hasattr(fn, "__func__"):
        key = (type(fn.__self__), fn.__func__)
    elif hasattr(fn, "__code__") and not getattr(fn, "__closure__", None):
        key = fn.__code__
    else:
        return FirstShape()
    return _FIRSTS.setdefault(backend, {}).setdefault(key, FirstShape())
