"""`graphify(fn, mode=...)`: the transform."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ._batching import Batching
from ._graphify import Graphified
from ._mode import Mode
from ._options import Options
from ._outer_compile import prepare_for_compilers
from ._pool import Pool
from ._support import Support

__all__ = ["graphify"]


def graphify(
    fn: Callable | None = None,
    *,
    mode: "Mode | str" = Mode.FULL,
    sizes: Iterable[int] | None = None,
    axes: "Sequence | Mapping | None" = None,
    out_axes: Any = None,
    support: "Support | str | Iterable[Support | str]" = Support.ALWAYS,
    backend: str = "auto",
    pool: Pool | None = None,
    batching: Batching | None = None,
    outputs: str = "copy",
    group: Any = None,
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
      sequence or a mapping by parameter (or keyword) name; default: tensors `tokens()`,
      other values `static()`: plain values (None, numbers, strings, dtypes, tuples of them)
      must be equal on every call, other objects (a cache, a config) the same object.
    - `out_axes`: per flat output "tokens", "reqs" or None; default inferred.
    - `support`: the graph support of the function's backends (the weakest counts); the
      mode is downgraded to what it allows, with the reason logged and kept in `.resolution`.
    - `backend`: "cuda", "sim" (CPU simulation) or "auto" (cuda for CUDA tensors).
    - `pool`: a `Pool` to capture into; share one between functions to share memory.
    - `batching`: a `Batching`: how batches are made up (tokens per request in a uniform
      batch, the most requests, LoRA variants, and per-call `uniform` / `has_lora`
      predicates); default: single-token decode, no LoRA.
    - `outputs`: "copy" (default): every call returns tensors of its own, correct forever.
      "view": the graph's static output buffers, no copy; a view is valid until the next
      call (on CUDA, reading it afterwards raises, as with torch.compile's graphs; CPU
      builds of torch cannot check, so there the view silently holds the next result).
      CuPy/NumPy callers: keep "copy" (their views cannot be checked).
    - `group`: a torch.distributed process group whose ranks run this function together
      (tensor parallelism): capture agrees on the plan and outcome across ranks, and every
      call checks that all ranks chose the same graph, raising instead of hanging.
    - `options`: an `Options` for the rarely changed knobs: warm-ups, restoring state
      written during capture, full per-call checks, weak outputs, progress bar, capture
      order, per-call FULL exclusion, the tensor-parallel check, first use, specialised
      compile sizes, the padding limit (see `Options`).

    **Returns:** a `Graphified`. Called as it is, it captures on first use: a call structure
    (arguments, dtypes, non-batch shapes, static values) that runs in two consecutive calls
    gets graphs, each batch size captured by the call that first needs it (see
    `graphify._first_use` for the policy and its bounds). `.capture(*example)` captures
    every size ahead of time instead. Without `fn`, a decorator: `@graphify(mode="FULL", axes=...)`.

    !!! example
        >>> model.forward = graphify(model.forward)  # doctest: +SKIP
        >>> model.generate(**inputs, cache_implementation="static")  # doctest: +SKIP

    !!! example
        >>> import torch
        >>> g = graphify(lambda x: x * 2, mode="FULL", sizes=[1, 2, 4], backend="sim")
        >>> g = g.capture(torch.randn(3, 8))
        >>> g(torch.ones(3, 8)).shape
        torch.Size([3, 8])
    """
    if fn is None:  # used as a decorator with options: @graphify(mode="FULL", ...)
        settings = dict(locals())
        del settings["fn"]
        return lambda f: graphify(f, **settings)
    prepare_for_compilers(fn)
    return Graphified(
        fn=fn, mode=mode, sizes=sizes, axes=axes, out_axes=out_axes, support=support, backend=backend, pool=pool,
        batching=batching, outputs=outputs, group=group, options=options,
    )
