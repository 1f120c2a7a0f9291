"""Adapters found through entry points: the core names no adapter; adapters name themselves.

A package that extends graphify declares its adapters in its own pyproject.toml, and graphify
loads them when it first needs them:

- `[project.entry-points."graphify.adapters"]`, `<library> = "<module>"`: the module
  registers (`graphify.extend`) how graphify follows that library's objects; imported the
  first time an object of that library reaches graphify (transformers' caches).
- `[project.entry-points."graphify.rewrites"]`, `<name> = "<module>:<GraphRewrite>"`: a
  rewrite of dynamo's graph before inductor compiles it, switched by
  `Options(compile={name: True | False})` (`graphify.compile.rewrites`).

graphify's own adapters (its `transforms/` and `models/`) are declared so in graphify's
pyproject.toml: an installed graphify (`pip install -e .` in a checkout) finds them.
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import Any

__all__ = ["ADAPTERS", "REWRITES", "declared", "load"]

ADAPTERS = "graphify.adapters"
REWRITES = "graphify.rewrites"


@functools.cache
def declared(group: str) -> dict[str, Any]:
    """{name: entry point} of `group`, read once a process (reading every installed
    package's metadata takes tens of milliseconds)."""
    return {ep.name: ep for ep in entry_points(group=group)}


def load(group: str, name: str) -> Any:
    """What entry point `name` of `group` names (importing its module), or None if none is declared."""
    ep = declared(group).get(name)
    return None if ep is None else ep.load()
