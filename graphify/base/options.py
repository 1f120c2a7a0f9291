"""`Options`: the rarely changed knobs of `graphify`, grouped so its signature stays small."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from graphify.base.compile_options import CompileOptions
from graphify.base.limits import Limits

__all__ = ["Options", "OUTPUTS", "BACKEND_NAMES", "LOCKSTEP_POLICIES"]

OUTPUTS = ("copy", "view")
BACKEND_NAMES = ("cuda", "cupy", "sim")  # `graphify.backends.BACKENDS`' keys
LOCKSTEP_POLICIES = ("graph", "host", "off")  # how tensor-parallel ranks agree on a graph (`graphify.distributed`)


COMPILE_SIZE_RULES = ("none", "all")


def _compile_sizes(value):
    if isinstance(value, str):
        if value not in COMPILE_SIZE_RULES:
            raise ValueError(f"Options: compile_sizes must be one of {COMPILE_SIZE_RULES} or token counts, got {value!r}")
        return value
    sizes = tuple(sorted({int(s) for s in value}))
    if any(s < 1 for s in sizes):
        raise ValueError(f"Options: compile_sizes must be positive token counts, got {value!r}")
    return sizes


FIRST_USE = (True, False, "strict")
SIDE_EFFECTS = ("refuse", "at_capture")


def _first_use_choice(instance, attribute, value):
    if not any(value is v or value == v and type(value) is type(v) for v in FIRST_USE):
        raise ValueError(f"Options: first_use must be True, False or 'strict', got {value!r}")


def _compile_choice(instance, attribute, value):
    if value == "background" and isinstance(value, str):
        return
    if not isinstance(value, (bool, dict)):
        raise TypeError(
            f"Options: compile must be True, False, 'background' or a dict of torch.compile keywords, got {value!r}"
        )
    if isinstance(value, dict):
        CompileOptions.parse(value)  # each key checked (`graphify.base.compile_options`)


def _backend_name(instance, attribute, value):
    if value != "auto" and value not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {value!r}; valid backends are 'auto', {', '.join(map(repr, BACKEND_NAMES))}")


def _outputs_choice(instance, attribute, value):
    if value not in OUTPUTS:
        raise ValueError(f"graphify: outputs must be one of {OUTPUTS}, got {value!r}")


def _non_negative(instance, attribute, value):
    if value < 0:
        raise ValueError(f"Options: {attribute.name} must be >= 0, got {value}")


@attrs.frozen
class Options:
    """How capture and calls behave where the defaults do not fit.

    **Arguments:**
    - `backend`: "cuda", "sim" (CPU simulation), "cupy" or "auto" (default: cupy for CuPy
      arrays, cuda for CUDA tensors, sim otherwise).
    - `outputs`: "copy" (default): every call returns tensors of its own, correct forever.
      "view": the graph's static output buffers, no copy; a view is valid until the next
      call (on CUDA, reading it afterwards raises, as with torch.compile's graphs; CPU
      builds of torch cannot check, so there the view silently holds the next result).
      CuPy/NumPy callers: keep "copy" (their views cannot be checked).
    - `out_axes`: per flat output "tokens", "reqs" or None; default inferred.
    - `group`: a torch.distributed process group whose ranks run this function together
      (tensor parallelism): capture agrees on the plan and outcome across ranks, and every
      call checks that all ranks chose the same graph, raising instead of hanging.
    - `warmups`: eager runs before a capture (at least one; on CUDA the first size's first
      run is under an op guard that rejects uncapturable ops before CUDA sees them). Later
      sizes of uncompiled graph pieces capture without one, and FULL graphs of a split
      function warm up through the same size's PIECEWISE schedule (see `graphify.capture.capturers`).
    - `restore_state`: undo the in-place writes that warm-ups (and the simulation's
      capture) make to tensors that existed before the call (KV caches, position
      counters, module buffers), so `capture()` leaves state as it found it. Turn it
      off for functions whose outside state is scratch, to skip the bookkeeping.
    - `weak_outputs`: let later captures reuse each graph's output memory (CUDA only).
    - `largest_first`: capture largest sizes first, so smaller ones reuse their memory.

    Long captures show a tqdm progress bar on a terminal; `TQDM_DISABLE=1` turns it off.
    - `allow_full`: `allow_full(*args) -> bool`, called per call: False sends a batch that
      may not run in a FULL graph (vLLM's cascade attention) to PIECEWISE graphs, or
      eagerly where none were captured. Default: every batch may.
    - `lockstep`: with `group` (tensor parallelism), how each call checks that every rank
      runs the same graph: "graph" (default; recorded into FULL graphs, no host cost, a
      mismatch stops the ranks with a device-side assert), "host" (an all-gather on a
      CPU group per call, a host round trip; a mismatch raises `DispatchMismatchError` naming each
      rank's choice and the ranks carry on), or "off". See `graphify.distributed.lockstep`.
    - `compile_sizes`: for a split function with compiled pieces (`split(..., compile=True)`),
      the capture sizes whose graphs record pieces compiled for that exact shape instead of
      the dynamic-shape one: "none" (default; size 1 is always specialised), "all", or token
      counts. Each size costs a compile of every distinct piece (cheap from inductor's cache);
      on the reference model specialising paid only at large sizes
      (`benchmarks/results/compile-sizes-*.md`), so none by default, large sizes for
      long-running prefill-heavy servers.
    - `first_use`: before `capture()`, capture the graphs calls need when they first need
      them (`graphify.first_use.first_use`). A call whose graph cannot be captured (an op that reads
      a device value on the host, Python state that changes every call, ...) then runs
      eagerly, with one warning naming the cause and the fix. "strict": such a capture
      raises instead. False: calls run eagerly until `capture()`. Callables with a `group`
      always capture ahead of time (the ranks must agree on every capture).
    - `side_effects`: what to do with a function whose Python state in its closure or
      globals (a call counter, a log's length) changes on every call. "refuse" (default):
      its calls run eagerly (or `capture()` raises), since a replay runs kernels, not
      Python. "at_capture": capture it anyway; those side effects happen when a capture
      runs (its warm-up and capture), never on replays, and the log says so, as jax's side
      effects happen when it traces. Tensors the closure holds are still checked.
    - `compile`: record inductor's kernels instead of eager ones: True (or a dict of
      `torch.compile` keywords) compiles the function, its first shape static and with dynamic
      shapes from its first call at another (a call carrying a cache, as `generate()`'s steps
      do, dynamic from the start), unless the dict says otherwise (a function whose traced call
      holds 2-D or 3-D convolutions, as a CNN does, compiles per captured shape instead, where
      inductor's layouts for them need static shapes: `graphify.compile.shape_policy`), for the
      calls that capture graphs; calls that run without a graph (transformers' prefill, sizes
      not captured) run it as written, so they never compile. The first capture pays the
      compile (Python floats such as `eps` are specialised, so dynamo traces the model once,
      not twice), a second shape one more (dynamic), and a batch of 1 after larger ones (or the
      reverse) one more; other shapes reuse it.
      `graphify(torch.compile(fn))` instead compiles every call, eager ones included.
      What the compile made lives as long as the graphified function, whose graphs launch
      it (`torch._dynamo.reset()` does not free it). "background" (or `"background": True`
      in the dict): calls capture plain graphs at once while a worker process compiles the
      same calls (`graphify.compile.background.line`: the weights cross by CUDA IPC, not copied) into
      torch's on-disk caches and saves it whole (torch's `aot_compile`); once a call's
      compile is there, this process loads it (no trace of the model here) and captures its
      graphs again with it. Where it was not saved whole (`"whole":
      False` in the dict, or a torch that cannot), the compile in this process traces the
      model and loads inductor's output from those caches, a stall of seconds.
      The first `generate()` costs what the plain line's does; a restarted process finds the
      caches filled. A compile running past `"deadline_s"` (default 1200) stops the worker:
      its calls keep plain graphs, with one warning. `capture()` compiles in its own process.
      Grouped-query attention of one query (a decode step) reads the cache's keys and values
      unexpanded, where the model expands them per query head (`graphify.transforms.gqa_fold`: the
      same attention without a copy of the cache a layer); `"fold_gqa": False` in the dict
      compiles the model as written. `"gemv": True` runs every linear of one row (a decode
      step at batch 1, bf16 or fp16 on CUDA) through graphify's Triton GEMV rather than cuBLAS
      (`graphify.transforms.one_row_linear`; Triton is what inductor uses already); other linears run as
      written. For a split function, FULL graphs
      record the function it was split from, compiled whole, and PIECEWISE graphs keep its
      pieces. On the reference model it is as fast as compiled pieces
      (`split(..., compile=True)`) for a longer compile (`benchmarks.decode_profile`), so
      compiled pieces stay the way to compile.
    - `limits`: the bounds of what graphify holds and records for this function
      (`graphify.base.limits.Limits`: call structures, graphs a structure, the walk of
      what a call reads); past one, calls run eagerly, never wrongly.
    """

    backend: str = attrs.field(default="auto", validator=_backend_name)
    outputs: str = attrs.field(default="copy", validator=_outputs_choice)
    out_axes: Any = None
    group: Any = None
    warmups: int = attrs.field(default=1, validator=_non_negative)
    restore_state: bool = True
    weak_outputs: bool = True
    largest_first: bool = True
    allow_full: Callable[..., bool] | None = None
    lockstep: str = attrs.field(default="graph", validator=attrs.validators.in_(LOCKSTEP_POLICIES))
    first_use: "bool | str" = attrs.field(default=True, validator=_first_use_choice)
    side_effects: str = attrs.field(default="refuse", validator=attrs.validators.in_(SIDE_EFFECTS))
    compile_sizes: "str | tuple[int, ...]" = attrs.field(default="none", converter=_compile_sizes)
    compile: "bool | str | dict" = attrs.field(default=False, validator=_compile_choice)
    limits: Limits = attrs.field(factory=Limits, validator=attrs.validators.instance_of(Limits))
