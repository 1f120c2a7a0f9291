"""`graphify(fn, mode=...)`: the transform."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from graphify.base.batching import Batching
from graphify.graphified.callable import Graphified
from graphify.base.modes import Mode
from graphify.base.options import Options
from graphify.compile.outer import prepare_for_compilers
from graphify.plan.pool import Pool
from graphify.plan.support import Support

__all__ = ["graphify"]


def graphify(
    fn: Callable | None = None,
    *,
    mode: "Mode | str" = Mode.FULL,
    sizes: Iterable[int] | None = None,
    axes: "Sequence | Mapping | None" = None,
    support: "Support | str | Iterable[Support | str]" = Support.ALWAYS,
    batching: Batching | None = None,
    pool: Pool | None = None,
    options: Options | None = None,
) -> Graphified:
    """Give `fn` CUDA graphs: a callable that pads, dispatches and replays.

    **Arguments:**
    - `fn`: the function, an `nn.Module` (calls bind against its `forward`), or a
      `split(fn, ops)` value for piecewise modes. Calls may mix positional and keyword
      arguments, defaults and `**kwargs`, as the capture's example call did.
    - `mode`: a `Mode` or its name: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE.
    - `sizes`: token counts to capture; batches pad up to the next one. Default: `capture()`
      captures vLLM's schedule up to 512; first use (calls before any `capture()`) captures
      each batch size as it comes, unpadded, up to 512 tokens. An empty list only with
      mode NONE.
    - `axes`: per argument `tokens()`, `reqs()`, `fixed()`, `persistent()` or `static()`, as a
      sequence or a mapping by parameter (or keyword) name; default: tensors `tokens()`
      (those whose first dimension is not the batch's, the one most tensor arguments share,
      `fixed()`: shape kept, a new shape a new graph), other values `static()`: plain values (None, numbers, strings, dtypes, tuples of them)
      must be equal on every call, other objects (a cache, a config) the same object.
    - `support`: the graph support of the function's backends (the weakest counts); the
      mode is downgraded to what it allows, with the reason logged and kept in `.resolution`.
    - `pool`: a `Pool` to capture into; share one between functions to share memory.
    - `batching`: a `Batching`: how batches are made up (tokens per request in a uniform
      batch, the most requests, LoRA variants, and per-call `uniform` / `has_lora`
      predicates); default: single-token decode, no LoRA.
    - `options`: an `Options` for the rarely changed knobs: the backend (by default picked
      from the arguments' device), outputs as copies or views, a tensor-parallel process
      group, compiling, first use, and the rest (see `Options`).

    **Returns:** a `Graphified`. Called as it is, it captures on first use: a call structure
    (arguments, dtypes, non-batch shapes, static values) that runs in two consecutive calls
    gets graphs, each batch size captured by the call that first needs it (see
    `graphify.first_use.first_use` for the policy and its bounds). `.capture(*example)` captures
    every size ahead of time instead. Without `fn`, a decorator: `@graphify(mode="FULL", axes=...)`.

    !!! example
        >>> model.forward = graphify(model.forward)  # doctest: +SKIP
        >>> model.generate(**inputs, cache_implementation="static")  # doctest: +SKIP

    !!! example
        >>> import torch
        >>> g = graphify(lambda x: x * 2, mode="FULL", sizes=[1, 2, 4])
        >>> g = g.capture(torch.randn(3, 8))
        >>> g(torch.ones(3, 8)).shape
        torch.Size([3, 8])
    """
    if fn is None:  # used as a decorator with options: @graphify(mode="FULL", ...)
        settings = dict(locals())
        del settings["fn"]
        return lambda f: graphify(f, **settings)
    prepare_for_compilers(fn)
    return Graphified(fn=fn, mode=mode, sizes=sizes, axes=axes, support=support, batching=batching, pool=pool, options=options)
