"""Grouped-query attention of one query without the expanded keys and values.

A decoder with grouped-query attention (fewer key/value heads than query heads) expands its
cached keys and values to every query head before SDPA (transformers' `repeat_kv`:
`x[:, :, None].expand(b, kv, n_rep, L, d).reshape(b, kv * n_rep, L, d)`), a copy of the
whole cache n_rep times over, twice a layer, at every decode step. Where the query is one
token, the same attention is SDPA over the unexpanded cache with the query heads of a
group as that group's queries: (b, kv * n_rep, 1, d) -> (b, kv, n_rep, d). Each query row
sees the same keys, values and mask, so the result is the same; what goes is the copy (at
an 8B shape, B = 8 and a 320-token cache: 1.3 GB written and read again a token).
transformers does this itself in eager mode from 5.24 on (`pack_gqa`), and not under
dynamo, so a compiled decode step still expands.

`fold_grouped_query_decode(gm)` rewrites dynamo's graph before inductor compiles it
(`graphify.compile.compiled.KeptCompiles`). It folds only what it can prove from the graph's
example values: a query of length 1 (a static 1), keys and values that are the same
n_rep-fold expansion of 4-D tensors whose head count times n_rep is the query's, no
dropout, not causal, no `enable_gqa`, a mask (if any) shared by all heads (size 1 in its
head and query dimensions), and nothing that may write a tensor between the expansion and
the SDPA (the fold reads the source where the SDPA stands). Anything else is left as written.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from graphify.extend import GraphRewrite

__all__ = ["fold_grouped_query_decode", "REWRITE"]

_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def fold_grouped_query_decode(gm: fx.GraphModule) -> int:
    """Rewrite every foldable SDPA of `gm` (dynamo's graph) in place; returns how many."""
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _SDPA and _fold(gm.graph, node):
            folded += 1
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


class _Plan(NamedTuple):
    """What one fold rewrites: SDPA's arguments, the unexpanded keys and values, the sizes."""

    bound: dict
    keys: fx.Node
    values: fx.Node
    q: torch.Tensor
    groups: int
    n_rep: int
    heads: int
    dim: int
    value_dim: int
    chains: tuple


def _fold(graph: fx.Graph, node: fx.Node) -> bool:
    try:
        plan = _plan(graph, node)
    except Exception:  # a graph shaped unlike any checked here: left as written
        return False
    if plan is None:
        return False
    bound, keys, values, q, groups, n_rep, heads, dim, value_dim, chains = plan
    with graph.inserting_before(node):
        grouped = graph.call_method("reshape", (bound["query"], -1, groups, n_rep, dim))
        _set_value(grouped, q.new_empty((q.shape[0], groups, n_rep, dim)))
        kwargs = {name: bound[name] for name in _PARAMS[3:] if name in bound and name != "enable_gqa"}
        attention = graph.call_function(node.target, (grouped, keys, values), kwargs)
        out = _value(node)
        _set_value(attention, out.new_empty(out.shape[0], groups, n_rep, value_dim) if out is not None else None)
        ungrouped = graph.call_method("reshape", (attention, -1, heads, 1, value_dim))
        _set_value(ungrouped, out)
    node.replace_all_uses_with(ungrouped)
    graph.erase_node(node)
    for chain in chains:
        _erase_unused(graph, chain)
    return True


def _plan(graph: fx.Graph, node: fx.Node) -> "_Plan | None":
    """What the fold of `node` needs, or None where the graph does not prove it exact."""
    bound = _bind(node)
    if bound is None or not _plain_attention(bound):
        return None
    query, mask = bound["query"], bound.get("attn_mask")
    key, n_rep, key_chain = _expanded_source(bound["key"])
    value, n_rep_v, value_chain = _expanded_source(bound["value"])
    q, k, v = _value(query), _value(key), _value(value)
    if k is None or v is None or n_rep != n_rep_v or q is None or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    heads, length, dim = (_int(s) for s in q.shape[1:])
    groups, value_dim = _int(k.shape[1]), _int(v.shape[3])
    if None in (heads, dim, groups, value_dim) or length != 1 or groups * n_rep != heads or _int(v.shape[1]) != groups:
        return None
    if not _shared_mask(mask) or _written_between(graph, set(key_chain + value_chain), node):
        return None
    chains = (key_chain, value_chain) if value_chain != key_chain else (key_chain,)
    return _Plan(bound, key, value, q, groups, n_rep, heads, dim, value_dim, chains)


def _written_between(graph: fx.Graph, starts: set, end: fx.Node) -> bool:
    """Whether a node from the first of `starts` up to `end` may write a tensor in place:
    the expansion copies its source where it stands, the fold reads the source at the SDPA,
    so nothing may change either in between. Walks back from `end` to the last of `starts`."""
    left = set(starts)
    node = end.prev
    while left and node.op != "root":
        if _may_write(node):
            return True
        left.discard(node)
        node = node.prev
    return False


_IN_PLACE = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
             operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
             operator.irshift, operator.imatmul}


def _may_write(node: fx.Node) -> bool:
    """An in-place method or function, an `out=` call, a module or a higher-order op: anything
    that could write a tensor (conservative)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_")
    if node.op == "call_module":
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if target in _IN_PLACE or "out" in node.kwargs or isinstance(target, torch._ops.HigherOrderOperator):
        return True
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def _bind(node: fx.Node) -> "dict | None":
    """SDPA's arguments by name, or None where the call has more than the signature."""
    if len(node.args) > len(_PARAMS):
        return None
    bound = dict(zip(_PARAMS, node.args))
    for name, arg in node.kwargs.items():
        if name not in _PARAMS or name in bound:
            return None
        bound[name] = arg
    return bound if all(name in bound for name in _PARAMS[:3]) else None


def _plain_attention(bound: dict) -> bool:
    """No dropout, not causal, no GQA flag: the attention the fold keeps exact."""
    return (bound.get("dropout_p", 0.0) in (0, 0.0) and bound.get("is_causal", False) is False
            and bound.get("enable_gqa", False) is False)


def _shared_mask(mask) -> bool:
    """No mask, or one every head and the query row share (size 1 in dims -3 and -2), so
    that it broadcasts over a group's queries as it did over its heads."""
    if mask is None:
        return True
    m = _value(mask) if isinstance(mask, fx.Node) else None
    return m is not None and m.dim() == 4 and _int(m.shape[1]) == 1 and _int(m.shape[2]) == 1


def _expanded_source(node) -> "tuple[fx.Node | None, int, tuple]":
    """(x, n_rep, the nodes from `node` back to x) where `node` is x's n_rep-fold head
    expansion, written as transformers' `repeat_kv` (x[:, :, None].expand(b, kv, n_rep, L,
    d).reshape(b, kv * n_rep, L, d)) or as `x.repeat_interleave(n_rep, dim=1)`; (None, 0, ())
    for anything else."""
    none = (None, 0, ())
    if not isinstance(node, fx.Node):
        return none
    if _is_repeat_interleave(node):
        source = node.args[0]
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        x = _value(source)
        if isinstance(repeats, int) and repeats > 1 and x is not None and x.dim() == 4:
            return source, repeats, (node,)
        return none
    if not (node.op == "call_method" and node.target == "reshape"):
        return none
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return none
    unsqueezed = expand.args[0]
    source = _unsqueezed_at_2(unsqueezed)
    x, e, r = _value(source), _value(expand), _value(node)
    if source is None or x is None or e is None or r is None or x.dim() != 4 or e.dim() != 5 or r.dim() != 4:
        return none
    n_rep = _int(e.shape[2])
    if n_rep is None or n_rep < 2 or _int(e.stride(2)) != 0:
        return none
    same = _same_sizes(e.shape, (x.shape[0], x.shape[1], n_rep, x.shape[2], x.shape[3]))
    same = same and _same_sizes(r.shape, (x.shape[0], x.shape[1] * n_rep, x.shape[2], x.shape[3]))
    return (source, n_rep, (node, expand, unsqueezed)) if same else none


def _is_repeat_interleave(node: fx.Node) -> bool:
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
    if node.op == "call_function" and node.target is torch.repeat_interleave:
        return dim == 1
    return node.op == "call_method" and node.target == "repeat_interleave" and dim == 1


def _unsqueezed_at_2(node) -> "fx.Node | None":
    """x where `node` is x[:, :, None] (or x[:, :, None, :, :]) or x.unsqueeze(2)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method" and node.target == "unsqueeze" and tuple(node.args[1:]) == (2,):
        return node.args[0]
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], tuple):
        index = node.args[1]
        full = slice(None, None, None)
        if index[:3] == (full, full, None) and all(i == full for i in index[3:]) and len(index) <= 5:
            return node.args[0]
    return None


def _same_sizes(a, b) -> bool:
    """Equal sizes, symbolic ones compared as expressions (no guard is added)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.SymInt) or isinstance(y, torch.SymInt):
            if str(x) != str(y):
                return False
        elif x != y:
            return False
    return True


def _int(size) -> "int | None":
    """A size as an int: an int, or a symbolic size the shape environment has already
    made a constant; None for a size that can vary."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        return size.node.maybe_as_int()
    return None


def _value(node) -> "torch.Tensor | None":
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _set_value(node: fx.Node, value) -> None:
    if value is not None:
        node.meta["example_value"] = value


def _erase_unused(graph: fx.Graph, chain: tuple) -> None:
    """Drop a folded key's or value's expansion (views and the copy, never what they read)
    where nothing else reads it."""
    for node in chain:
        if node.users:
            return
        graph.erase_node(node)


# on by default: the same attention, without a copy of the cache a layer (`Options(compile={"fold_gqa": False})` turns it off)
REWRITE = GraphRewrite("fold_gqa", fold_grouped_query_decode, default=True)
