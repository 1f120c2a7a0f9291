"""`Graphified`: the immutable callable `graphify` returns, with its stages (capture,
release, static inputs) and its introspection (check, explain, summary)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from operator import is_
from typing import Any, ClassVar

import attrs
import torch
from attrs.converters import default_if_none, optional

from graphify.call import paths as _call_paths
from graphify.base.batching import Batching
from graphify.graphified.check import CheckReport
from graphify.plan.dispatch import Decision, dispatcher_for, explain_miss
from graphify.base.errors import GraphifyError
from graphify.capture.spec import FunctionSpec
from graphify.plan.keys import KeySet
from graphify.base.call_layout import fn_name
from graphify.base.modes import Mode
from graphify.base.options import Options
from graphify.plan.pool import Pool
from graphify.plan.sizes import normalize_sizes
from graphify.plan.stats import Stats
from graphify.plan.support import Resolution, Support, weakest
from graphify.plan.table import GraphTable
from graphify.capture import capture_ahead

__all__ = ["Graphified"]


@attrs.frozen(eq=False, kw_only=True)
class Graphified:
    """A function with CUDA graphs: immutable; `capture(...)` returns a new one.

    Before `capture()`, calls capture on first use (`graphify.first_use.first_use`): graphs come as
    calls need them, per call structure. After capture a call pads its batch into static
    buffers, dispatches to a captured graph (or runs eagerly when none fits) and returns
    outputs cut back to the real batch. Build it with `graphify`; the fields are its
    arguments, and `spec` what they resolve to (`graphify.capture.spec.FunctionSpec`).
    """

    dropped_in_workers: ClassVar[bool] = True  # where `graphify.compile.background.line` sends the object it is set on
    fn: Callable
    mode: Mode = attrs.field(default=Mode.FULL, converter=Mode.parse)
    sizes: tuple[int, ...] | None = attrs.field(
        default=None, converter=optional(functools.partial(normalize_sizes, allow_empty=True))
    )
    axes: Any = None
    support: Support = attrs.field(default=Support.ALWAYS, converter=weakest)
    batching: Batching = attrs.field(factory=Batching, converter=default_if_none(factory=Batching))
    pool: Pool | None = None
    options: Options = attrs.field(factory=Options, converter=default_if_none(factory=Options))
    table: GraphTable | None = attrs.field(default=None, repr=False)
    spec: FunctionSpec = attrs.field(init=False, repr=False)
    stats: Stats = attrs.field(init=False, repr=False)
    _runtime: Any = attrs.field(init=False, repr=False)
    _first_use: Any = attrs.field(init=False, repr=False)
    _padded: Any = attrs.field(init=False, repr=False)  # first use's padded sequences (`padded_calls`), or None

    def __attrs_post_init__(self):
        spec = FunctionSpec.build(
            self.fn, mode=self.mode, sizes=self.sizes, axes=self.axes, support=self.support,
            batching=self.batching, pool=self.pool, options=self.options,
        )
        if self.table is None:  # once, when built; not again per capture
            spec.announce()
        stats = Stats()
        runtime = _call_paths.runtime_for(spec, self.table) if self.table is not None else None
        first_use = None
        if self.table is None and spec.first_use:
            from graphify.first_use.first_use import FirstUse

            first_use = FirstUse(spec, stats)
        padded = _padded_calls(spec) if first_use is not None else None
        for name, value in (("spec", spec), ("stats", stats), ("_runtime", runtime), ("_first_use", first_use),
                            ("_padded", padded)):
            object.__setattr__(self, name, value)

    # -- identity -------------------------------------------------------------------------
    @property
    def __wrapped__(self) -> Callable:
        return self.fn

    @property
    def __name__(self) -> str:
        return fn_name(self.fn)

    @property
    def captured(self) -> bool:
        return self.table is not None

    @property
    def resolution(self) -> Resolution:
        """The runtime mode the function's support allows, and why it differs from `mode`."""
        return self.spec.resolution

    @property
    def keys(self) -> KeySet:
        """The graphs `capture()` plans."""
        return self.spec.keys

    @property
    def _label(self) -> str:
        return self.spec.label

    # -- stages ---------------------------------------------------------------------------
    def capture(self, *example_args, **example_kwargs) -> "Graphified":
        """Capture every planned graph; returns a new callable, this one is unchanged.

        **Arguments:** one example call of `fn`. Its persistent tensors (weights, KV cache)
        are the ones the graphs will read; its other tensors give dtypes, devices and
        trailing shapes. Capture itself runs `fn` on all-padding batches.

        **Returns:** a new `Graphified` whose table holds the graphs. Raises `CaptureError`
        naming the key that failed; graphs captured before it are released.
        """
        return attrs.evolve(self, table=capture_ahead(self.spec, example_args, example_kwargs))

    def release(self) -> "Graphified":
        """Free this callable's graphs now instead of when it is dropped; returns the
        uncaptured callable (capture it again to get graphs back). Calls to this one then
        raise. The pool's free memory goes back to the device with `pool.trim()`."""
        if self._runtime is not None:
            self._runtime.forget()
            self.table.release()
        if self._first_use is not None:
            self._first_use.release()
        return attrs.evolve(self, table=None)

    def wait_compiles(self, timeout: float | None = None) -> bool:
        """Under `Options(compile="background")`: wait (at most `timeout` s) for the compiles
        calls have sent to the worker so far; whether they all finished. The calls after
        that capture their graphs again with the compiled function. A service can call this
        after its warm-up requests; nothing needs it to be right."""
        return self._first_use.wait_compiles(timeout) if self._first_use is not None else True

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
            raise ValueError(f"{self._label}.static_inputs: capture first; static buffers exist only after capture")
        top = self.table.keys.max_tokens()
        if not 1 <= num_tokens <= top or (num_reqs is not None and not 1 <= num_reqs <= num_tokens):
            raise ValueError(
                f"{self._label}.static_inputs: need 1 <= num_reqs <= num_tokens <= {top} (the largest captured size), "
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
                f"{self._label}: a captured callable holds CUDA graphs and device buffers, which cannot be "
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
        # torch.compiler.disable's wrapper, which adds its own frame and checks to every call.
        prior = _set_eval_frame(None)
        try:
            if _peek_functorch() is not None:
                raise GraphifyError(
                    f"{self._label} was called inside a torch.func transform (vmap, grad, jacrev, jvp, ...): a graph "
                    "replays fixed kernels on real tensors and cannot be transformed. Put the transform inside: "
                    "graphify(vmap(f)), graphify(vmap(grad(loss)))"
                )
            runtime = self._runtime
            if runtime is not None:
                static = runtime.static_call
                if static is not None and not kwargs and len(args) == len(static.args) and all(map(is_, args, static.args)):
                    return runtime.run(args, self.stats)  # static_inputs()'s very tuple: already bound
                return _call_paths.run(runtime, self.table.layout.bind(args, kwargs), self.stats)
            if self._padded is not None:
                return self._padded.call(self._first_use.run, args, kwargs)
            if self._first_use is not None:
                return self._first_use.run(args, kwargs)
            return _call_paths.eager(self.spec, self.stats, args, kwargs)
        finally:
            _set_eval_frame(prior)

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
        from graphify.graphified.check import check_callable

        runtime = self._runtime
        if runtime is None and self._first_use is not None and self._first_use.current() is not None:
            runtime = self._first_use.current().runtime  # first use: the most recently used structure
        return check_callable(self._label, runtime, make_batch, sizes, rtol=rtol, atol=atol, seed=seed)

    def explain(self, num_tokens: int, *, uniform: bool = False, has_lora: bool = False) -> str:
        """Which graph a batch of `num_tokens` would replay, and why (or why none)."""
        keys = self.table.keys if self.table is not None else KeySet(uniform_query_len=self.batching.uniform_query_len)
        decision: Decision = dispatcher_for(keys, self.options.limits.padding_ratio).lookup(num_tokens, uniform, has_lora)
        if decision.key is not None:
            return f"num_tokens={num_tokens} -> {decision.mode.value} {decision.key} ({decision.reason})"
        from graphify.base.descriptor import BatchDescriptor

        probe = BatchDescriptor(num_tokens, None, False, has_lora)
        return f"num_tokens={num_tokens} -> NONE ({decision.reason}); {explain_miss(keys, probe)}"

    def summary(self) -> str:
        """How many graphs, how long they took, and how much pool memory they reserved."""
        head = f"{self._label}: resolved mode {self.resolution.mode.value}"
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


def _padded_calls(spec: FunctionSpec):
    """First use's padding of a model's sequence axis where an adapter allows it
    (`graphify.base.length_padding`); None for any other function, or one given axes or sizes
    (its calls are shaped as the user said)."""
    if spec.axes is not None or spec.sizes is not None or spec.split is not None:
        return None
    from graphify.base.call_layout import module_of
    from graphify.base.length_padding import sequence_padding_for
    from graphify.graphified.padded_calls import PaddedCalls
    from graphify.reads.stateful_types import adapters_of_imported

    model = module_of(spec.fn)
    if model is None:
        return None
    adapters_of_imported()
    padding = sequence_padding_for(model)
    return None if padding is None else PaddedCalls(spec.label, spec.fn, padding)


_peek_functorch = torch._C._functorch.peek_interpreter_stack
_set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame


def _opaque_to_dynamo(fn):
    """Mark `fn` so dynamo neither inlines it while tracing a caller (a graph break, as for
    torch.compiler.disable'd functions) nor compiles its frame; no wrapper, no per-call cost.
    Through torch's C half of dynamo (what `torch._dynamo.eval_frame.skip_code` calls), so
    `import graphify` imports no compiler; an older torch without it imports dynamo's."""
    frames = torch._C._dynamo.eval_frame
    if all(hasattr(frames, name) for name in ("set_code_exec_strategy", "_FrameExecStrategy", "_FrameAction")):
        action = frames._FrameAction
        frames.set_code_exec_strategy(fn.__code__, frames._FrameExecStrategy(action.SKIP, action.DEFAULT))
    else:
        from torch._dynamo.eval_frame import skip_code

        skip_code(fn.__code__)
    fn._torchdynamo_disable = True
    return fn


_opaque_to_dynamo(Graphified.__call__)


def _rebuild(fields: dict) -> Graphified:
    return Graphified(**fields)
