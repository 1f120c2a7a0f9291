"""What code extending graphify builds on: the contract of a split function, the
registrations an adapter makes, and the pieces of graphify such code needs (graphify's own
adapters, `graphify.transforms` and `graphify.models`, use these names and no private ones).

A split function (what `graphify.transforms.split` returns) is any object with the
attributes of `SplitFunction` (`graphify.base.split_contract`). An adapter registers the
Python state of a library's types (`register_state_type`, `register_capture_context`,
`register_forward_adapter`), models whose sequence may be padded (`register_sequence_padding`)
and graph rewrites (`GraphRewrite`), and is found through the
entry points its package declares (`graphify.base.plugins`).
"""

from __future__ import annotations

from graphify.base.axes import layout_for, param_names
from graphify.base.length_padding import SequencePadding, register_sequence_padding
from graphify.compile.background.job_pickle import register_carried, register_rebuilt
from graphify.reads.stateful_types import StateType, register_capture_context, register_forward_adapter, register_state_type
from graphify.backends import Captured
from graphify.backends.interface import CompiledCode
from graphify.backends.sim import taping
from graphify.backends.tensor_writes import UNANNOTATED_VIEWS, schema_facts
from graphify.backends.torch_cuda import weak_alias
from graphify.base.split_contract import SplitFunction, as_split
from graphify.compile.background.triton_env import as_inductor_compiles
from graphify.compile.rewrites import GraphRewrite
from graphify.plan.support import weakest

__all__ = [
    "SplitFunction", "as_split", "Captured", "layout_for", "param_names", "taping", "weak_alias", "StateType",
    "register_state_type", "register_capture_context", "register_forward_adapter", "register_rebuilt",
    "register_carried", "CompiledCode", "GraphRewrite", "weakest", "UNANNOTATED_VIEWS", "schema_facts", "as_inductor_compiles",
    "SequencePadding", "register_sequence_padding",
]


