"""Which nodes of a traced graph write, in place, to state from outside the call.

A capture's warm-ups run the function for real, so graphify must undo what they write to
tensors that existed before the call (a KV cache, a counter, a closed-over buffer). For a
split function the traced ATen graph tells, before anything runs, which ops can do that: an
op whose schema marks an argument written (`Tensor(a!)`) where that argument is, through
views and other in-place ops, an input of the graph or a tensor it closed over (a
`get_attr` constant). graphify's capture uses the answer to skip an eager, recorded run of
the whole function at sizes where only the split ops (run eagerly, recorded as they run)
can write outside state.

The answer over-approximates: a callable without a schema that takes such a tensor, or an
op returning an alias of one, counts as reaching outside state. Saying "writes" where
nothing does costs start-up time; the reverse would leave state changed by a capture.
"""

from __future__ import annotations

import operator

import torch

from graphify.extend import UNANNOTATED_VIEWS, schema_facts

__all__ = ["outside_writes"]


def _tensor_nodes(value) -> list:
    nodes: list = []
    torch.fx.node.map_arg(value, nodes.append)
    return nodes


def outside_writes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The call nodes of `gm` that may write in place to a graph input or constant."""
    outside: set = set()  # nodes whose value is (or may alias) outside state
    writers = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            outside.add(node)
            continue
        if node.op not in ("call_function", "call_module", "call_method"):
            continue
        inputs = node.all_input_nodes
        if node.target is operator.getitem:  # an item of a result: aliases whatever the result did
            if inputs and inputs[0] in outside:
                outside.add(node)
            continue
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:  # unknown Python: assume it writes what it reads and returns it
            if any(n in outside for n in inputs):
                outside.add(node)
                writers.append(node)
            continue
        by_name = {a.name: a for a in schema.arguments}
        bound = list(zip(schema.arguments, node.args)) + [(by_name[k], v) for k, v in node.kwargs.items() if k in by_name]
        written_names = {schema.arguments[i].name for i in schema_facts(node.target)[0]}
        written = [v for a, v in bound if a.name in written_names]
        if any(n in outside for v in written for n in _tensor_nodes(v)):
            writers.append(node)
        if schema.name in UNANNOTATED_VIEWS and any(n in outside for n in inputs):
            outside.add(node)
            continue
        if schema.name == "aten::set_" and any(n in outside for n in inputs):
            # the written tensor now shares an outside storage: it and everything after it is outside
            outside.update(n for _, v in bound[:1] for n in _tensor_nodes(v))
            outside.add(node)
            continue
        returns = [r for r in schema.returns if r.alias_info is not None]
        if not returns:
            continue
        # a list return (split, unbind: `Tensor(a)[]`) names no alias set at the top: any
        # annotated argument may be what it views
        sets = {s for r in returns for s in r.alias_info.before_set}
        if any(n in outside for a, v in bound if a.alias_info is not None
               and (not sets or set(a.alias_info.before_set) & sets) for n in _tensor_nodes(v)):
            outside.add(node)
    return writers
