"""CPU simulation of CUDA graphs: replay runs what the capture recorded, not the function.

Capture runs the function once under the op guard (`graphify.backends.op_guard`), which rejects ops a
CUDA graph cannot hold (host reads of device values, data-dependent output shapes), and
once more under a *tape*: a dispatch mode that records every ATen op with its arguments.
Replay re-executes the tape: the tensors that existed before the capture run (static
input buffers, weights, a cache's tensors, a closure's tensors) are read through aliases of
the memory they had at capture (`detach()`: the same storage, whatever later becomes of the
tensor object), numbers are baked in as captured, and tensors the run made are made
afresh. So, as on a GPU, a tensor replaced in a cache after capture, a closure rebound to
a new tensor, a closure's number changed, or new storage put under a parameter (`.data =`,
`set_`, `swap_tensors`, `.to()` and back) is *not* seen by a replay: what CPU tests see is
what a CUDA graph would do (graphify checks those before replaying; see `graphify.reads.watch`).

Outputs are written in place on every replay into the tensors recorded at capture,
exactly as with a real graph.

Compiled code hides its kernels from dispatch: a torch.compile'd function is taped
through its eager twin, and compiled graph pieces run their eager original while
`taping()` is set. A GPU replays the compiled code itself, so a stale compiled entry would
show there only; within `compiled_compared()` each capture compares the two. NumPy
functions (`graphify.base.interop`) compute outside torch altogether:
for them `SimBackend(rerun=True)` replays by running the function again on the captured
arguments (so, unlike a GPU, their replays do see replaced objects).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable

import attrs
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from graphify.base.alias import held_alias
from graphify.base.errors import CaptureError
from graphify.reads.reach import has_address
from graphify.backends.op_guard import UNCAPTURABLE_OPS, CaptureGuard, simulating
from graphify.backends.tensor_writes import eager_runs
from graphify.backends.interface import Captured, CompiledCode
from graphify.backends.graph_pool import GraphPool

__all__ = ["SimBackend", "CaptureGuard", "UNCAPTURABLE_OPS", "taping", "Tape", "compiled_compared"]

_COMPARED = threading.local()  # `compiled_compared`'s list on this thread, while one is open


@contextlib.contextmanager
def compiled_compared():
    """Within it, each simulated capture of compiled code compares the compiled warm-up's
    outputs with its eager original's (which the simulation records and replays) and notes
    each disagreement in the list it yields. A GPU replays the compiled code, so a stale
    compiled entry (dynamo's guards missing a change) shows there and nowhere in the
    simulation: tests open this to see it on the CPU. Calls that draw random numbers differ
    legitimately (the warm-up draws its own)."""
    outer = getattr(_COMPARED, "found", None)
    found = _COMPARED.found = [] if outer is None else outer
    try:
        yield found
    finally:
        _COMPARED.found = outer


def _named(fn) -> str:
    """The function a wrapper stands for (graphify's boxing, `__wrapped__` chains, partials), by name."""
    for _ in range(8):
        inner = getattr(fn, "boxes", None) or getattr(fn, "__wrapped__", None) or getattr(fn, "func", None)
        if inner is None:
            break
        fn = inner
    return getattr(fn, "__qualname__", type(fn).__name__)


def _disagree(compiled, eager) -> bool:
    a = [t for t in pytree.tree_leaves(compiled) if isinstance(t, torch.Tensor)]
    b = [t for t in pytree.tree_leaves(eager) if isinstance(t, torch.Tensor)]
    return len(a) != len(b) or any(
        x.shape != y.shape or not torch.allclose(x.float(), y.float(), rtol=1e-4, atol=1e-5) for x, y in zip(a, b))

_copy_all = torch._foreach_copy_  # bound once: replay copies are not input copies
_local = threading.local()


def taping() -> bool:
    """Whether the simulation is recording a tape on this thread: compiled code should run
    its eager original, whose ops the tape can see."""
    return getattr(_local, "taping", False)


def _clone_out(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


class _Slot:
    """A tensor the taped run made: the `index`-th value of a replay."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _has_slot(template) -> bool:
    return isinstance(template, _Slot) or (isinstance(template, (list, tuple)) and any(isinstance(x, _Slot) for x in template))


def _resolve(template, values: list):
    """`template` with each `_Slot` replaced by its replay value (one level of lists)."""
    if isinstance(template, _Slot):
        return values[template.index]
    if isinstance(template, (list, tuple)) and any(isinstance(x, _Slot) for x in template):
        return type(template)(values[x.index] if isinstance(x, _Slot) else x for x in template)
    return template


class Tape(TorchDispatchMode):
    """Records one run's ATen ops; `replay()` runs them again on the same outside tensors."""

    def __init__(self):
        super().__init__()
        self.ops: list = []  # (op, args, kwargs, slots of the flat outputs, substituted arg positions)
        self.made: dict[int, int] = {}  # id(tensor made by the run) -> slot
        self.keep: list = []  # the made tensors, alive while recording (ids must stay unique)
        self.aliases: dict[int, tuple] = {}  # id(outside tensor) -> (it, an alias of its memory now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a tensor subclass (DTensor) dispatches itself: record the plain ops it issues
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        targs = tuple(self._template(a) for a in args)
        tkwargs = {k: self._template(v) for k, v in kwargs.items()}
        subs = tuple(i for i, t in enumerate(targs) if _has_slot(t))
        ksubs = tuple(k for k, t in tkwargs.items() if _has_slot(t))
        slots = []
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                slots.append(None)
            elif id(t) in self.made:
                slots.append(self.made[id(t)])
            elif any(t is a for a in pytree.tree_leaves((args, kwargs))):
                slots.append(None)  # an in-place op on an outside tensor returns that tensor
            else:
                self.made[id(t)] = len(self.keep)
                slots.append(len(self.keep))
                self.keep.append(t)
        self.ops.append((func, targs, tkwargs, tuple(slots), subs, ksubs))
        return out

    def _template(self, a):
        if isinstance(a, torch.Tensor):
            slot = self.made.get(id(a))
            return _Slot(slot) if slot is not None else self._alias(a)
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return type(a)(self._template(x) for x in a)
        return a

    def _alias(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor outside the run, as the memory it has now: what a graph reads, whatever
        later becomes of the object (new storage under a parameter, `set_`, a swap)."""
        held = self.aliases.get(id(t))
        if held is None:
            held = self.aliases[id(t)] = (t, held_alias(t) if has_address(t) else t)
        return held[1]

    def sources(self, out) -> list:
        """Per tensor in `out`'s leaves: the `_Slot` of a tensor the run made, or the outside
        tensor's memory (a function may return an argument or a cache tensor as it is)."""
        found = []
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                slot = self.made.get(id(t))
                found.append(_Slot(slot) if slot is not None else self._alias(t))
        return found

    def finish(self) -> int:
        """Stop recording; returns how many values a replay makes."""
        count = len(self.keep)
        self.keep = []
        self.made = {}
        self.aliases = {}
        return count

    def replay(self, values: list) -> None:
        for func, targs, tkwargs, slots, subs, ksubs in self.ops:
            if subs or ksubs:
                args = list(targs)
                for i in subs:
                    args[i] = _resolve(targs[i], values)
                kwargs = dict(tkwargs)
                for k in ksubs:
                    kwargs[k] = _resolve(tkwargs[k], values)
                out = func(*args, **kwargs)
            else:
                out = func(*targs, **tkwargs)
            if func.namespace == "c10d":  # an in-place collective: its caller waits on the Work in Python
                for w in pytree.tree_leaves(out):
                    if hasattr(w, "wait") and not isinstance(w, torch.Tensor):
                        w.wait()
            if len(slots) == 1:
                if slots[0] is not None:
                    values[slots[0]] = out
            else:
                for slot, t in zip(slots, pytree.tree_leaves(out)):
                    if slot is not None:
                        values[slot] = t


@contextlib.contextmanager
def _taping():
    before = taping()
    _local.taping = True
    try:
        yield
    finally:
        _local.taping = before


class SimBackend:
    """Simulated graphs on any device; see the module docstring."""

    name = "sim"
    trim_frees_live_graphs = False  # simulated pools hold no memory of their own (`Pool.trim`)
    _pool_ids = itertools.count(1)

    def __init__(self, rerun: bool = False):
        self.rerun = rerun

    def validate(self, label: str, device: torch.device) -> None:
        return None

    def new_pool_handle(self, device: torch.device) -> GraphPool:
        return GraphPool(lambda: ("sim", next(self._pool_ids)))

    def new_stream(self, device: torch.device):
        return None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def usage(self, handle) -> None:
        """No allocator to ask: the report counts what each capture kept."""
        return None

    def trim(self, handle, device) -> None:
        return None

    def capture(
        self, fn: Callable, args: tuple, *, pool, warmups: int, weak_outputs: bool, stream=None,
        guard: "bool | Callable" = True, keeper=None,
    ) -> Captured:
        # Warm-ups run the function itself (a compiled one compiles there), the first under
        # the guard; then the capture run on the tape, in the pool as torch's capture runs
        # (`SimGraph`). Every run's writes to outside state are undone after it.
        if self.rerun:
            return _rerun_capture(fn, args, pool=pool, warmups=warmups, guard=guard, keeper=keeper)
        with simulating():
            return self._taped_capture(fn, args, pool=pool, warmups=warmups, guard=guard, keeper=keeper)

    def _taped_capture(self, fn: Callable, args: tuple, *, pool: GraphPool, warmups: int, guard, keeper) -> Captured:
        """Warm-ups, then the capture run on the tape (see `capture`)."""
        twin = guard if callable(guard) else (fn.twin if isinstance(fn, CompiledCode) else None) or getattr(
            fn, "_torchdynamo_orig_callable", None)
        recorded = bool(warmups)
        compared = getattr(_COMPARED, "found", None) if isinstance(fn, CompiledCode) else None
        compiled_out = None
        if warmups:
            compiled_out = eager_runs(fn, args, keeper=keeper, guard=guard, count=warmups,
                                      finish=(lambda r: pytree.tree_map(_clone_out, r)) if compared is not None else None)
            guard = False
        tape = Tape()

        def taped(*a):
            with _taping(), tape:
                out = (twin or fn)(*a)
            return out, tape.sources(out)

        with pool.capturing() as pool_id:  # (as torch's: see `graphify.backends.torch_cuda`)
            graph = SimGraph(pool_id)
            outputs, sources = graph.ran(pool, eager_runs, taped, args, keeper=keeper, guard=bool(guard), count=1,
                                         record=not recorded, finish=lambda r: (pytree.tree_map(_clone_out, r[0]), r[1]))
            return graph.holding(pool, self._taped(tape, outputs, sources, twin, compared, compiled_out))

    @staticmethod
    def _taped(tape: Tape, outputs, sources: list, twin, compared, compiled_out) -> Captured:
        """The capture run's tape and outputs as a replay."""
        count = tape.finish()
        if compared is not None and compiled_out is not None and _disagree(compiled_out, outputs):
            compared.append(f"{_named(twin)}: the compiled warm-up's outputs differ from its eager original's")
        static_out = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        if len(static_out) != len(sources):
            raise CaptureError("sim capture: the outputs could not be traced to the recorded ops")

        def replay() -> None:
            values = [None] * count
            tape.replay(values)
            if static_out:
                _copy_all(static_out, [(values[s.index] if isinstance(s, _Slot) else s).detach() for s in sources])

        nbytes = sum(t.untyped_storage().nbytes() for t in static_out)
        return Captured(replay, None, outputs, nbytes)


class SimGraph:
    """A simulated graph's place in its pool, kept as long as its entry: torch counts the
    graphs of a pool id from the start of their capture and refuses a capture into an id
    whose graphs all went (released, not yet freed: `graphify.backends.graph_pool`); so does
    this. As torch's, a capture that began and never ended (its run raised) keeps its count
    for good: its id is never released."""

    _live: dict = {}  # pool id -> graphs of it alive (and captures that never ended)
    _released: set = set()  # ids whose graphs all went
    _recording: set = set()  # ids a capture run raised in: left routed, as torch 2.11's capture_end leaves them

    def __init__(self, pool_id):
        if pool_id in self._released:
            raise RuntimeError(
                f"sim: capture into graph pool {pool_id} after all its graphs were released (torch's allocators "
                "fail an internal assert, use_count > 0, and leave the RNG in capture mode)"
            )
        if pool_id in self._recording:
            raise RuntimeError(f"sim: beginAllocateToPool: already recording to mempool_id {pool_id} (a capture "
                               "into it raised and was never ended)")
        self.pool_id = pool_id
        self._live[pool_id] = self._live.get(pool_id, 0) + 1
        self._ended = [False]  # read by the finalizer
        weakref.finalize(self, SimGraph._gone, pool_id, self._ended)
        self.replay = None

    def ran(self, pool: GraphPool, run: Callable, *args, **kwargs):
        """`run(*args, **kwargs)`, this graph's capture run: where it raises, the capture
        never ended (torch before pytorch#190348 keeps its pool id's use for good), its id
        stays routed and `pool` captures into a fresh one from then on."""
        try:
            out = run(*args, **kwargs)
        except BaseException:
            self._recording.add(self.pool_id)
            pool.unended()
            raise
        self._ended[0] = True
        return out

    @classmethod
    def _gone(cls, pool_id, ended: list) -> None:
        if not ended[0]:  # as torch's `CUDAGraph::reset`: a pool's use given back only for a capture that ended
            return
        cls._live[pool_id] -= 1
        if not cls._live[pool_id]:
            del cls._live[pool_id]
            cls._released.add(pool_id)

    def holding(self, pool: GraphPool, captured: Captured) -> Captured:
        """`captured`, with this graph in it and counted by `pool`."""
        self.replay = captured.replay
        pool.holds(self, self.pool_id)
        return attrs.evolve(captured, graph=self)


def _rerun_capture(fn: Callable, args: tuple, *, pool: GraphPool, warmups: int, guard, keeper) -> Captured:
    """Capture by running `fn` (warm-ups, then the capture run); replay runs it again on the
    capture's arguments and copies its results into the captured outputs."""
    if warmups:
        eager_runs(fn, args, keeper=keeper, guard=guard, count=warmups)
    with pool.capturing() as pool_id:
        graph = SimGraph(pool_id)
        outputs = graph.ran(pool, eager_runs, fn, args, keeper=keeper, guard=False if warmups else guard, count=1,
                            record=not warmups, finish=lambda r: pytree.tree_map(_clone_out, r))
        return graph.holding(pool, _rerun_replay(fn, args, outputs))


def _rerun_replay(fn: Callable, args: tuple, outputs) -> Captured:
    """The captured outputs of `fn(*args)`, refilled by each replay's run of `fn` again."""
    from graphify.base.axes import WeakStatic, weaken

    static_out = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
    held = tuple(a if isinstance(a, torch.Tensor) else weaken(a) for a in args)  # objects weakly, as a graph
    del args

    def replay() -> None:
        fresh = [t for t in pytree.tree_leaves(fn(*[a() if isinstance(a, WeakStatic) else a for a in held]))
                 if isinstance(t, torch.Tensor)]
        if len(fresh) != len(static_out) or any(a.shape != b.shape for a, b in zip(fresh, static_out)):
            raise CaptureError("sim replay: the function returned different output shapes than at capture")
        if static_out:
            _copy_all(static_out, [t.detach() for t in fresh])

    return Captured(replay, None, outputs, sum(t.untyped_storage().nbytes() for t in static_out))
