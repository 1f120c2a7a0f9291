"""`Batching`: how the batches a function is called with are made up, as one value.

vLLM's and SGLang's schedulers describe a batch by its tokens, its requests, whether it is
a *uniform* decode (every request brings the same number of query tokens: one, or 1 + k
with speculative decoding) and whether it needs LoRA. These decide which graphs exist and
which one a call replays; they belong together.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

__all__ = ["Batching"]


def _at_least_one(instance, attribute, value):
    if value is not None and value < 1:
        raise ValueError(f"graphify: {attribute.name} must be >= 1, got {value}")


@attrs.frozen(kw_only=True)
class Batching:
    """How a function's batches are made up.

    **Arguments:**
    - `uniform_query_len`: tokens per request in a uniform batch (1, or 1 + speculative
      tokens); uniform FULL graphs are planned for it.
    - `max_num_reqs`: the most requests a batch holds; caps uniform decode graphs.
    - `lora`: also capture LoRA variants of every graph; `has_lora(*args)` says which a call
      needs.
    - `uniform`: `uniform(*args) -> bool`, per call; default: tokens == requests ×
      `uniform_query_len` (exact for single-token decode; with speculative decoding pass a
      predicate).
    - `has_lora`: `has_lora(*args) -> bool`, per call, when `lora` graphs exist.

    !!! example
        >>> from graphify import Batching, graphify
        >>> spec = Batching(uniform_query_len=3, max_num_reqs=64)
        >>> g = graphify(lambda x: x * 2, mode="FULL", batching=spec)
    """

    uniform_query_len: int = attrs.field(default=1, validator=_at_least_one)
    max_num_reqs: int | None = attrs.field(default=None, validator=_at_least_one)
    lora: bool = False
    uniform: Callable[..., bool] | None = None
    has_lora: Callable[..., bool] | None = None
