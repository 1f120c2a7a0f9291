"""`graphify(fn, mode=...)`: the transform, and the immutable callable it returns."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import is_
from typing import Any

import attrs
import torch

from ._options import Options
from ._prepare import prepare, session_args
from ._session import capture_table
from ._check import CheckReport
from ._dispatch import Decision, Dispatcher, explain_miss
from ._errors import CaptureError, GraphifyError
from ._interop import ForeignFunction, module, to_torch, tree_from_torch
from ._keys import KeySet, plan_keys
from ._mode import Mode
from ._pool import Pool
from ._runtime import Runtime
from ._sizes import normalize_sizes, vllm_sizes
from ._stats import Stats
from ._support import Resolution, Support, resolve_mode, weakest
from ._table import GraphTable
from .backends import BACKENDS

__all__ = ["graphify", "Graphified"]

log = logging.getLogger("graphify")

DEFAULT_SIZES = vllm_sizes(512)  # what capture() captures when no sizes are given


def _mode_field(value):
    return Mode.parse(value)


def _backend_name(value: str) -> str:
    if value != "auto" and value not in BACKENDS:
        raise ValueError(f"unknown backend {value!r}; valid backends are 'auto', {', '.join(map(repr, BACKENDS))}")
    return value


def _sizes_field(value):
    return None if value is None else normalize_sizes(value, allow_empty=True)


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


@attrs.frozen(eq=False)
class Graphified:
    """A function with CUDA graphs: immutable; `capture(...)` returns a new one.

    Before `capture()`, calls capture on first use (`graphify._first_use`): graphs come as
    calls need them, per call structure. After capture a call pads its batch into static
    buffers, dispatches to a captured graph (or runs eagerly when none fits) and returns
    outputs cut back to the real batch. Build it with `graphify`.
    """

    fn: Callable
    mode: Mode = attrs.field(converter=_mode_field)
    sizes: tuple[int, ...] | None = attrs.field(converter=_sizes_field)
    axes: Any = None
    out_axes: Any = None
    support: Support = attrs.field(default=Support.ALWAYS, converter=weakest)
    backend: str = attrs.field(default="auto", converter=_backend_name)
    pool: Pool | None = None
    uniform_query_len: int = 1
    max_num_reqs: int | None = None
    lora: bool = False
    max_padding_ratio: float | None = None
    outputs: str = attrs.field(default="copy", validator=attrs.validators.in_(("copy", "view")))
    uniform: Callable[..., bool] | None = None
    has_lora: Callable[..., bool] | None = None
    group: Any = None
    options: Options = attrs.field(factory=Options, converter=lambda o: Options() if o is None else o)
    table: GraphTable | None = attrs.field(default=None, repr=False)
    resolution: Resolution = attrs.field(init=False, repr=False)
    keys: KeySet = attrs.field(init=False, repr=False)
    stats: Stats = attrs.field(init=False, repr=False)
    _runtime: Runtime | None = attrs.field(init=False, repr=False)
    _call: str = attrs.field(init=False, repr=False)
    _first_use: Any = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self):
        if not isinstance(self.options, Options):
            raise TypeError(f"graphify: options must be a graphify.Options, got {type(self.options).__name__}")
        if self.max_padding_ratio is not None and not self.max_padding_ratio >= 1:
            raise ValueError(
                f"graphify: max_padding_ratio must be >= 1 (a padded size over the real one; 1 means exact sizes "
                f"only), got {self.max_padding_ratio}"
            )
        if self.max_num_reqs is not None and self.max_num_reqs < 1:
            raise ValueError(f"graphify: max_num_reqs must be >= 1, got {self.max_num_reqs}")
        call = f"graphify({_fn_name(self.fn)}, mode={self.mode.value!r})"
        if self.sizes == () and self.mode is not Mode.NONE:
            raise ValueError(
                f"{call}: sizes is empty, so no graph could be captured; give capture sizes, leave sizes out "
                "for the default, or use mode='NONE' (eager, no graphs)"
            )
        resolution = resolve_mode(
            self.mode, self.support, split=bool(getattr(self.fn, "is_split", False)), uniform_query_len=self.uniform_query_len
        )
        if resolution.changed and self.table is None:  # once, when built; not again per capture
            log.warning("%s: %s", call, "; ".join(resolution.reasons))
            if self.mode is Mode.PIECEWISE and resolution.mode is Mode.NONE and not getattr(self.fn, "is_split", False):
                import warnings

                warnings.warn(
                    f"{call}: the function is not split, so PIECEWISE has no pieces to capture and it runs "
                    "eagerly (mode NONE, no graphs); wrap it with split(fn, ops) from transforms.split to capture "
                    "the pieces between its graph-unsafe ops, or use mode='FULL' for one graph of the whole function",
                    UserWarning,
                    stacklevel=4,
                )
        keys = plan_keys(
            resolution.mode,
            self.sizes if self.sizes is not None else DEFAULT_SIZES,
            uniform_query_len=self.uniform_query_len,
            max_num_reqs=self.max_num_reqs,
            lora=self.lora,
        )
        runtime = None
        if self.table is not None:
            runtime = self._runtime_for(self.table, Dispatcher(self.table.keys, self.max_padding_ratio), call=call)
        first_use = None
        if self.table is None and self.options.first_use and self.group is None and resolution.mode is not Mode.NONE:
            from ._first_use import FirstUse

            first_use = FirstUse(self)
        for name, value in (
            ("resolution", resolution), ("keys", keys), ("stats", Stats()), ("_runtime", runtime), ("_call", call),
            ("_first_use", first_use),
        ):
            object.__setattr__(self, name, value)

    def _runtime_for(self, table: GraphTable, dispatcher: Dispatcher, *, call: str | None = None, grow=None) -> Runtime:
        """The call machinery over `table` (ahead of time: the whole table; first use: a
        structure's growing table, dispatched over its planned keys)."""
        lib = table.library
        eager = ForeignFunction(self.fn, lib) if lib else self.fn
        return Runtime(
            call=call or self._call,
            fn=table.layout.caller(eager),
            table=table,
            dispatcher=dispatcher,
            uniform_fn=self.uniform,
            lora_fn=self.has_lora,
            outputs=self.outputs,
            full_ok_fn=self.options.allow_full,
            grow=grow,
        )

    # -- identity -------------------------------------------------------------------------
    @property
    def __wrapped__(self) -> Callable:
        return self.fn

    @property
    def __name__(self) -> str:
        return _fn_name(self.fn)

    @property
    def captured(self) -> bool:
        return self.table is not None

    # -- stages ---------------------------------------------------------------------------
    def capture(self, *example_args, **example_kwargs) -> "Graphified":
        """Capture every planned graph; returns a new callable, this one is unchanged.

        **Arguments:** one example call of `fn`. Its persistent tensors (weights, KV cache)
        are the ones the graphs will read; its other tensors give dtypes, devices and
        trailing shapes. Capture itself runs `fn` on all-padding batches.

        **Returns:** a new `Graphified` whose table holds the graphs. Raises `CaptureError`
        naming the key that failed; graphs captured before it are released.
        """
        lockstep = None
        if self.group is not None:  # tensor parallel: every rank plans and captures the same graphs
            from ._distributed import Lockstep

            lockstep = Lockstep(self.group, self._call, self.options.lockstep)
        try:
            fn, twin, args, specs, backend, library, layout = prepare(self, example_args, example_kwargs)
        except Exception as exc:
            if lockstep is not None:  # the other ranks must hear of it, or they wait forever
                lockstep.agree_plan(None, exc)
            raise
        if lockstep is not None:
            lockstep.agree_plan(
                [f"mode {self.resolution.mode.value}"]
                + [f"{m.value} {k}" for m, k in self.keys.pairs(self.options.largest_first)]
            )
        try:
            table = capture_table(
                **session_args(self, fn, twin, args, specs, backend, library, layout, self.keys, lockstep)
            )
        except BaseException as exc:
            if lockstep is not None:
                lockstep.agree_outcome(exc)
            raise
        if lockstep is not None:
            try:
                lockstep.agree_outcome(None)
            except CaptureError:
                table.release()
                raise
            table = attrs.evolve(table, lockstep=lockstep)
        return attrs.evolve(self, table=table)

    def release(self) -> "Graphified":
        """Free this callable's graphs now instead of when it is dropped; returns the
        uncaptured callable (capture it again to get graphs back). Calls to this one then
        raise. The pool's free memory goes back to the device with `pool.trim()`."""
        if self._runtime is not None:
            self._runtime.release()
        if self._first_use is not None:
            self._first_use.release()
        return attrs.evolve(self, table=None)

    def static_inputs(self, num_tokens: int, num_reqs: int | None = None) -> tuple:
        """Arguments for a call of `num_tokens` tokens (and `num_reqs` requests) that *are*
        the static input buffers: persistent tensors as captured, static values as
        captured, and views of the padded and fixed buffers. Write the next batch into
        the views (for example `torch.argmax(logits, -1, out=ids)`) and call with them:
        no input is copied, and a call with exactly this tuple skips the argument checks
        (they ran once, here), so it costs little more than the replay itself.

        !!! example
            >>> ids, pos, rows, kv = step.static_inputs(8)  # doctest: +SKIP
            >>> ids.copy_(next_ids); logits = step(ids, pos, rows, kv)  # doctest: +SKIP
        """
        if self._runtime is None:
            raise ValueError(f"{self._call}.static_inputs: capture first; static buffers exist only after capture")
        top = self.table.keys.max_tokens()
        if not 1 <= num_tokens <= top or (num_reqs is not None and not 1 <= num_reqs <= num_tokens):
            raise ValueError(
                f"{self._call}.static_inputs: need 1 <= num_reqs <= num_tokens <= {top} (the largest captured size), "
                f"got num_tokens={num_tokens}, num_reqs={num_reqs}"
            )
        return self._runtime.static_inputs(num_tokens, num_reqs)

    # -- copies and pickles ---------------------------------------------------------------
    def __copy__(self) -> "Graphified":
        return self  # immutable: a copy is the same callable

    def __deepcopy__(self, memo) -> "Graphified":
        return self  # graphs, pools and static buffers are device state, shared by design

    def __reduce__(self):
        if self.table is not None:
            raise TypeError(
                f"{self._call}: a captured callable holds CUDA graphs and device buffers, which cannot be "
                "pickled; pickle the function (or the callable before capture) and capture again after loading"
            )
        fields = {a.name: getattr(self, a.name) for a in attrs.fields(type(self)) if a.init}
        return (_rebuild, (fields,))

    # -- calls ----------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        # Opaque to an outer torch.compile (transformers' generate() compiles the module's
        # __call__ around this forward): dynamo will not inline this function (see
        # `_opaque_to_dynamo` below), and frames it runs (the user's function, eagerly or
        # under capture) run as written, not compiled by that outer callback. Cheaper than
        # torch.compiler.disable's wrapper, which cost ~13 us a call on the H100 host.
        prior = _set_eval_frame(None)
        try:
            if _peek_functorch() is not None:
                raise GraphifyError(
                    f"{self._call} was called inside a torch.func transform (vmap, grad, jacrev, jvp, ...): a graph "
                    "replays fixed kernels on real tensors and cannot be transformed. Put the transform inside: "
                    "graphify(vmap(f)), graphify(vmap(grad(loss)))"
                )
            runtime = self._runtime
            if runtime is not None:
                fast = runtime.fast
                if fast is not None and not kwargs and len(args) == len(fast[0]) and all(map(is_, args, fast[0])):
                    return runtime.run_trusted(self.stats)  # static_inputs()'s very tuple
                return self._run(runtime, runtime.layout.bind(args, kwargs))
            if self._first_use is not None:
                return self._first_use.call(args, kwargs)
            return self._eager(args, kwargs)
        finally:
            _set_eval_frame(prior)

    def _eager(self, args: tuple, kwargs: dict):
        self.stats.record(Mode.NONE, _leading_rows(args) or _leading_rows(tuple(kwargs.values())), None)
        return self.fn(*args, **kwargs)

    def _run(self, runtime: Runtime, slots: tuple):
        if runtime.library is not None:
            return self._call_foreign(runtime, slots)
        return runtime.run(slots, self.stats)

    def _call_foreign(self, runtime: Runtime, args: Sequence[Any]):
        """A call with CuPy / NumPy arrays: torch views in, views of the outputs back. With
        CuPy, copies and replay run on the caller's current CuPy stream."""
        library = runtime.library
        targs = tuple(map(to_torch, args))
        if library == "cupy":
            from .backends.streams import caller_cupy_stream

            with caller_cupy_stream():
                out = runtime.run(targs, self.stats)
        else:
            out = runtime.run(targs, self.stats)
        return tree_from_torch(out, module(library))

    # -- introspection --------------------------------------------------------------------
    def check(
        self,
        make_batch: Callable[[int], Any] | None = None,
        *,
        sizes: Iterable[int] | None = None,
        rtol: float = 1e-5,
        atol: float = 1e-5,
        seed: int = 0,
    ) -> CheckReport:
        """Compare the captured callable with eager on fresh random batches: at every
        captured size, between sizes (padded) and above the largest. Run it first after
        capture: it shows whether padding changes real rows (a function that mixes rows
        across the batch) before production does.

        **Arguments:**
        - `make_batch`: `make_batch(num_tokens)` returns a call's arguments (a tuple, a
          dict of keywords, or both as `(args, kwargs)`). Default: float rows drawn like
          the example's, integer rows resampled from it, everything else as captured
          (functions with request-axis arguments need a `make_batch`).
        - `sizes`: the token counts to check instead (a model whose batch is fixed, such
          as one over a transformers StaticCache, checks its captured size only).
        - `rtol`, `atol`: the tolerance for "matches".

        **Returns:** a `CheckReport`; `print(report)` shows one row per size and output,
        `report.ok` is True when every real row matched. Outside state the eager runs
        write is put back, and `stats` is not counted.
        """
        from ._check import check_callable

        return check_callable(self, make_batch, sizes, rtol=rtol, atol=atol, seed=seed)

    def explain(self, num_tokens: int, *, uniform: bool = False, has_lora: bool = False) -> str:
        """Which graph a batch of `num_tokens` would replay, and why (or why none)."""
        keys = self.table.keys if self.table is not None else KeySet(uniform_query_len=self.uniform_query_len)
        decision: Decision = Dispatcher(keys, self.max_padding_ratio).lookup(num_tokens, uniform, has_lora)
        if decision.key is not None:
            return f"num_tokens={num_tokens} -> {decision.mode.value} {decision.key} ({decision.reason})"
        from ._descriptor import BatchDescriptor

        probe = BatchDescriptor(num_tokens, None, False, has_lora)
        return f"num_tokens={num_tokens} -> NONE ({decision.reason}); {explain_miss(keys, probe)}"

    def summary(self) -> str:
        """How many graphs, how long they took, and how much pool memory they reserved."""
        head = f"{self._call}: resolved mode {self.resolution.mode.value}"
        if self.resolution.changed:
            head += f" (requested {self.mode.value}: {'; '.join(self.resolution.reasons)})"
        if self.table is None:
            if self._first_use is not None and self._first_use.structures:
                return head + self._first_use.summary()
            return head + f"; not captured ({len(self.keys)} graphs planned)"
        t = self.table
        state = (
            f"; capture wrote and restored {t.state_tensors} outside tensor(s), holding at most "
            f"{t.state_bytes / (1 << 20):.2f} MiB of saved values"
            if t.state_tensors else ""
        )
        return head + (
            f"; {len(t)} graphs on {t.backend.name} ({t.device}) in {t.seconds:.2f} s, "
            f"{t.nbytes / (1 << 20):.1f} MiB reserved in pool {t.pool.name!r}" + state
        )


_peek_functorch = torch._C._functorch.peek_interpreter_stack
_set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame


def _opaque_to_dynamo(fn):
    """Mark `fn` so dynamo neither inlines it while tracing a caller (a graph break, as for
    torch.compiler.disable'd functions) nor compiles its frame; no wrapper, no per-call cost."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(fn.__code__)
    fn._torchdynamo_disable = True
    return fn


_opaque_to_dynamo(Graphified.__call__)


def _rebuild(fields: dict) -> Graphified:
    return Graphified(**fields)


def _leading_rows(args: Sequence[Any]) -> int:
    for a in args:
        shape = getattr(a, "shape", None)
        if shape:
            return int(shape[0])
    return 0


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
    uniform_query_len: int = 1,
    max_num_reqs: int | None = None,
    lora: bool = False,
    max_padding_ratio: float | None = None,
    outputs: str = "copy",
    uniform: Callable[..., bool] | None = None,
    has_lora: Callable[..., bool] | None = None,
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
    - `uniform_query_len`: tokens per request in a uniform batch (1 + spec tokens).
    - `max_num_reqs`: most requests per batch; caps uniform decode graphs.
    - `lora`: also capture LoRA variants; `has_lora(*args)` says which a call needs.
    - `max_padding_ratio`: run eagerly rather than pad beyond this factor.
    - `outputs`: "copy" (default): every call returns tensors of its own, correct forever.
      "view": the graph's static output buffers, no copy; a view is valid until the next
      call (on CUDA, reading it afterwards raises, as with torch.compile's graphs; CPU
      builds of torch cannot check, so there the view silently holds the next result).
      CuPy/NumPy callers: keep "copy" (their views cannot be checked).
    - `uniform`: `uniform(*args) -> bool`; default: tokens == requests * uniform_query_len,
      exact for single-token decode; with spec decode (1+k tokens) pass a predicate.
    - `has_lora`: `has_lora(*args) -> bool` when `lora` keys exist.
    - `group`: a torch.distributed process group whose ranks run this function together
      (tensor parallelism): capture agrees on the plan and outcome across ranks, and every
      call checks that all ranks chose the same graph, raising instead of hanging.
    - `options`: an `Options` for the rarely changed knobs (warm-ups, restoring state
      written during capture, full per-call checks, weak outputs, progress bar, capture order).

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
        options = dict(locals())
        del options["fn"]
        return lambda f: graphify(f, **options)
    return Graphified(
        fn, mode, sizes, axes, out_axes, support, backend, pool, uniform_query_len, max_num_reqs,
        lora, max_padding_ratio, outputs, uniform, has_lora, group, options,
    )
