"""What a graphified function is apart from its graphs, as one frozen value.

`graphify(fn, ...)` resolves its arguments once: the runtime mode the function's support
allows, the keys to capture, the name messages use. Capture, first use, the call layer and
`check()` read this `FunctionSpec`; none of them reaches back into the `Graphified` that
holds it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from graphify.base.batching import Batching
from graphify.compile.compiled import compile_for_captures, compiles_in_background
from graphify.plan.keys import KeySet, plan_keys
from graphify.base.call_layout import fn_name
from graphify.base.modes import Mode
from graphify.base.options import Options
from graphify.plan.pool import Pool
from graphify.plan.sizes import normalize_sizes, vllm_sizes
from graphify.plan.support import Resolution, resolve_mode, weakest
from graphify.base.split_contract import as_split

__all__ = ["FunctionSpec", "DEFAULT_SIZES"]

log = logging.getLogger("graphify")

DEFAULT_SIZES = vllm_sizes(512)  # what capture() captures when no sizes are given


@attrs.frozen(kw_only=True)
class FunctionSpec:
    """A graphified function's settings, resolved (see the module docstring)."""

    fn: Callable
    label: str  # how messages name the callable: "graphify(step, mode='FULL')"
    mode: Mode  # as requested
    resolution: Resolution  # the mode the function's support allows, and why
    sizes: tuple[int, ...] | None
    keys: KeySet  # the graphs capture() plans
    axes: Any
    pool: Pool | None
    batching: Batching
    options: Options
    compiled: Callable | None = None  # `fn` compiled for captures (Options.compile), else None

    @property
    def backend(self) -> str:
        return self.options.backend

    @property
    def outputs(self) -> str:
        return self.options.outputs

    @property
    def out_axes(self) -> Any:
        return self.options.out_axes

    @property
    def group(self) -> Any:
        return self.options.group

    @property
    def split(self):
        """The split function `fn` is (`graphify.extend.SplitFunction`), or None."""
        return as_split(self.fn)

    @property
    def background(self) -> bool:
        """Whether first use compiles in a worker process while plain graphs serve."""
        return compiles_in_background(self.options.compile)

    def plain(self) -> "FunctionSpec":
        """This spec with captures recording the function as written (no compile)."""
        return attrs.evolve(self, compiled=None)

    @property
    def first_use(self) -> bool:
        """Whether calls before `capture()` capture what they need."""
        return self.options.first_use is not False and self.group is None and self.resolution.mode is not Mode.NONE

    @classmethod
    def build(
        cls, fn: Callable, *, mode: "Mode | str", sizes: Iterable[int] | None, axes: Any, support: Any,
        batching: Batching | None, pool: Pool | None, options: Options | None,
    ) -> "FunctionSpec":
        """Check and resolve `graphify`'s arguments."""
        options = Options() if options is None else options
        if not isinstance(options, Options):
            raise TypeError(f"graphify: options must be a graphify.Options, got {type(options).__name__}")
        batching = Batching() if batching is None else batching
        if not isinstance(batching, Batching):
            raise TypeError(f"graphify: batching must be a graphify.Batching, got {type(batching).__name__}")
        mode = Mode.parse(mode)
        sizes = None if sizes is None else normalize_sizes(sizes, allow_empty=True)
        label = f"graphify({fn_name(fn)}, mode={mode.value!r})"
        if sizes == () and mode is not Mode.NONE:
            raise ValueError(
                f"{label}: sizes is empty, so no graph could be captured; give capture sizes, leave sizes out "
                "for the default, or use mode='NONE' (eager, no graphs)"
            )
        resolution = resolve_mode(
            mode, weakest(support), split=as_split(fn) is not None, uniform_query_len=batching.uniform_query_len,
        )
        compiled = compile_for_captures(label, fn, options.compile) if options.compile is not False else None
        keys = plan_keys(
            resolution.mode, sizes if sizes is not None else DEFAULT_SIZES,
            uniform_query_len=batching.uniform_query_len, max_num_reqs=batching.max_num_reqs, lora=batching.lora,
        )
        return cls(
            fn=fn, label=label, mode=mode, resolution=resolution, sizes=sizes, keys=keys, axes=axes, pool=pool,
            batching=batching, options=options, compiled=compiled,
        )

    def announce(self) -> None:
        """Log (and for PIECEWISE without a split function, warn) that the mode was
        downgraded: once, when a callable is built, not again per capture."""
        resolution, label = self.resolution, self.label
        if not resolution.changed:
            return
        log.warning("%s: %s", label, "; ".join(resolution.reasons))
        if self.mode is Mode.PIECEWISE and resolution.mode is Mode.NONE and self.split is None:
            warnings.warn(
                f"{label}: the function is not split, so PIECEWISE has no pieces to capture and it runs "
                "eagerly (mode NONE, no graphs); wrap it with graphify.split(fn, ops, *example) to capture "
                "the pieces between its graph-unsafe ops, or use mode='FULL' for one graph of the whole function",
                UserWarning,
                stacklevel=5,
            )
