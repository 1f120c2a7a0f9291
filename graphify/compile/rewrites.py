"""Rewrites of dynamo's graph before inductor compiles it, as adapters register them.

A rewrite is model-specific code (graphify's own: one-query grouped-query attention without
the expanded cache, `fold_gqa`, on by default; one-row linears through a Triton GEMV,
`gemv`), so it lives with the adapters and is found through the `graphify.rewrites` entry
points (`graphify.base.plugins`). `Options(compile={name: bool})` switches one on or off;
the in-process compile (`graphify.compile.compiled.KeptCompiles`) and the worker's saved
one (`graphify.compile.aot`) apply the same ones in the same order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs
import torch.fx as fx

from graphify.base import plugins

__all__ = ["GraphRewrite", "registered", "switched_on", "rewrite", "ready"]


@attrs.frozen
class GraphRewrite:
    """`apply(gm) -> int` rewrites dynamo's graph in place and returns how many places it
    changed; `default`: whether it is on unless `Options(compile={name: False})`; `ready()`:
    what to import before a compile that uses it (not inside the call that takes compiled
    graphs in), returning whether it can run here."""

    name: str
    apply: Callable[[fx.GraphModule], int]
    default: bool = False
    ready: Callable[[], bool] | None = None


@functools.cache
def registered() -> dict[str, GraphRewrite]:
    """Every declared rewrite, by name (loaded once a process; a saved compiled function's
    code may call ops a rewrite defines, so a load imports them all first)."""
    found = {}
    for name in sorted(plugins.declared(plugins.REWRITES)):
        rewrite_ = plugins.load(plugins.REWRITES, name)
        if not isinstance(rewrite_, GraphRewrite) or rewrite_.name != name:
            raise TypeError(f"the entry point {name!r} of {plugins.REWRITES!r} must name a GraphRewrite called {name!r}")
        found[name] = rewrite_
    return found


def switched_on(switches: dict) -> tuple[str, ...]:
    """The rewrites on for a compile: as `switches` ({name: bool}, from the compile dict)
    says, else each rewrite's default; a name no adapter declares is an error."""
    known = registered()
    unknown = sorted(set(switches) - set(known))
    if unknown:
        raise ValueError(f"Options: compile names {unknown}, which is neither a torch.compile keyword nor a graph "
                         f"rewrite; the rewrites declared here are {sorted(known)}")
    return tuple(name for name, r in known.items() if switches.get(name, r.default))


def ready(names: tuple[str, ...]) -> None:
    """Import what the rewrites `names` run (Triton), here and now."""
    for name in names:
        r = registered()[name]
        if r.ready is not None:
            r.ready()


def rewrite(gm: fx.GraphModule, names: tuple[str, ...]) -> dict[str, int]:
    """Apply the rewrites `names` to `gm` in place, in order; {name: places changed}."""
    known = registered()
    return {name: known[name].apply(gm) for name in names}
