"""How a function and a call of it cross to the compile worker (`graphify.compile.background.line`), and
the process state its compile depends on.

- A module's *parameters* cross by CUDA IPC handle: read there, never written, not copied.
  Everything else crosses by value, copied when it is sent: a call's tensors (the caller goes
  on writing its buffers and cache) and a module's buffers (a model may keep its cache or a
  counter in one, which the worker's run would write into the caller's memory).
- graphify's own callables installed on an object (`model.forward = graphify(...)`) become
  `DROPPED`, which the worker removes so the object's own method shows.
- The compile's inputs beyond the call: matmul precision, TF32, default dtype, deterministic
  algorithms, dynamo's and inductor's settings, autocast. The worker applies the caller's,
  so what it builds is what the caller's compile looks up in the caches.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions (CUDA IPC) with ForkingPickler

from graphify.reads.torch_settings import sdp_flags, set_sdp_flags

__all__ = ["DROPPED", "dumps", "parameters_of", "torch_state", "applied", "scrub", "register_rebuilt",
           "register_carried"]


class _Dropped:
    """What a graphify callable installed on an object becomes in the worker."""

    def __reduce__(self):
        return _dropped, ()


DROPPED = _Dropped()


def _dropped() -> _Dropped:
    return DROPPED


def _bound(func, obj):
    return types.MethodType(func, obj)


def _on_device(data: bytes, device: str, requires_grad: bool, parameter: bool, marks: dict,
               view: tuple | None = None) -> torch.Tensor:
    tensor = torch.load(io.BytesIO(data), weights_only=True).to(device)
    if view is not None:
        with contextlib.suppress(RuntimeError):  # a view not made again there crosses compacted
            tensor = _as_view(tensor, *view)
    tensor = torch.nn.Parameter(tensor, requires_grad) if parameter else tensor.requires_grad_(requires_grad)
    return _marked(tensor, marks)


VIEW_BASE_BYTES = 256 << 20  # a larger base than this (and than 4x its view) crosses compacted


def view_geometry(tensor: torch.Tensor) -> tuple | None:
    """(base size, base stride, size, stride, storage offset) of a view of a base that starts
    its storage (graphify's static buffers at a key's rows); None for any other tensor, and
    for a view of a base too large to allocate again there for nothing (a slice of a large
    cache crosses compacted). Dynamo gives a view's base sizes symbols of their own, and
    symbols are named by hashing their sources with collisions probed in order: a compacted
    copy in the worker names the rest differently (another cache key) once a model has
    enough of them (24 layers did)."""
    base = tensor._base
    if (base is None or base.storage_offset() != 0 or base.dtype != tensor.dtype or tensor.is_conj() or tensor.is_neg()
            or tensor.is_quantized or torch._debug_has_internal_overlap(tensor) == 1):
        return None  # none, or one `_as_view` cannot make again: an expanded view, `.real`, a conjugate, ...
    base_extent = _extent(base)
    if _extent(tensor) > base_extent or base_extent * base.element_size() > max(VIEW_BASE_BYTES, 4 * tensor.nbytes):
        return None  # reaching past its base, or a base too large to make again for it
    return tuple(base.shape), base.stride(), tuple(tensor.shape), tensor.stride(), tensor.storage_offset()


def _extent(tensor: torch.Tensor) -> int:
    """Elements of storage from its start to the tensor's last element."""
    if tensor.numel() == 0:
        return 0
    return tensor.storage_offset() + sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride())) + 1


def _as_view(values: torch.Tensor, base_size, base_stride, size, stride, offset) -> torch.Tensor:
    """`values` as the same view of a base of the same geometry (the rest of the base unset:
    a compile reads shapes, not the rows a call does not pass)."""
    base = torch.empty_strided(base_size, base_stride, dtype=values.dtype, device=values.device)
    view = base.as_strided(size, stride, offset)
    view.copy_(values)
    return view


def _marked(tensor: torch.Tensor, marks: dict) -> torch.Tensor:
    tensor.__dict__.update(marks)
    return tensor


def _rebuilt_marked(rebuild, args, marks: dict) -> torch.Tensor:
    return _marked(rebuild(*args), marks)


def dynamo_marks(tensor: torch.Tensor) -> dict:
    """What dynamo reads off a tensor and keys its compile on: `mark_static_address` (a
    StaticCache's keys and values carry it: static inputs, another cache key without it),
    `mark_dynamic` and their kin."""
    return {k: v for k, v in getattr(tensor, "__dict__", {}).items() if k.startswith("_dynamo_")}


class _JobPickler(ForkingPickler):
    """ForkingPickler (CUDA tensors by IPC handle) for the CUDA tensors in `shared`; every
    other tensor by value (a view's own elements only, rebuilt there as the same view of a
    base of the same geometry: `view_geometry`)."""

    def __init__(self, file, shared: frozenset):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.shared = shared

    def reducer_override(self, obj):
        if getattr(type(obj), "dropped_in_workers", False) is True:  # a graphify callable
            return _dropped, ()
        if isinstance(obj, types.MethodType) and not isinstance(obj.__self__, type):
            return _bound, (obj.__func__, obj.__self__)
        if not isinstance(obj, torch.Tensor):
            return NotImplemented  # pickle's own way
        marks = dynamo_marks(obj)
        if id(obj) in self.shared and obj.is_cuda:  # by IPC handle (torch's reduction), dynamo's marks kept
            if not marks:
                return NotImplemented
            rebuild, args = torch.multiprocessing.reductions.reduce_tensor(obj)
            return _rebuilt_marked, (rebuild, args, marks)
        host = obj.detach().to("cpu")
        if host.untyped_storage().nbytes() > host.nbytes:
            host = host.clone()
        data = io.BytesIO()
        torch.save(host, data)
        return _on_device, (data.getvalue(), str(obj.device), obj.requires_grad and obj.is_leaf,
                            isinstance(obj, torch.nn.Parameter), marks, view_geometry(obj))


def dumps(value: Any, shared: frozenset = frozenset()) -> bytes:
    buf = io.BytesIO()
    _JobPickler(buf, shared).dump(value)
    return buf.getvalue()


def parameters_of(fn: Any) -> frozenset:
    """ids of the parameters of the module `fn` is (or is a method of): what crosses by IPC."""
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(owner, torch.nn.Module):
        return frozenset()
    return frozenset(id(p) for p in owner.parameters())


# Called in the worker on each object (and submodule) rebuilt there: what a library records per
# process when an object is made, which unpickling skips (`graphify.extend.register_rebuilt`).
REBUILT: list = []


def scrub(obj) -> None:
    """Remove what stood for graphify's callables in `obj` and, for a module, its submodules;
    then the `REBUILT` hooks on each."""
    modules = obj.modules() if isinstance(obj, torch.nn.Module) else [obj]
    for m in modules:
        attributes = getattr(m, "__dict__", {})
        for name in [n for n, v in attributes.items() if v is DROPPED]:
            del attributes[name]
        for hook in REBUILT:
            hook(m)


def register_rebuilt(hook) -> None:
    """`hook(obj)` runs in the compile worker on each object rebuilt there from the caller's
    copy: for a library that records an object in a registry of its own when it is made
    (unpickling does not make it), so the worker's trace sees the registry as the caller has it."""
    if hook not in REBUILT:
        REBUILT.append(hook)


# Process-wide state of a library that a compile's guards read, by name: (read it in the caller,
# set it so in the worker) (`graphify.extend.register_carried`).
CARRIED: dict = {}


def register_carried(name: str, read, put) -> None:
    """`read()` in the caller when a job is sent, `put(value)` in the compile worker before the
    job's trace: for a library's process-wide state that the traced code reads (a registry), so
    the compiled function's guards hold what the caller has, not what a fresh process has.
    `read()` returns plain picklable data; `put` must accept what its `read` returns."""
    CARRIED[name] = (read, put)


# -- the process state a compile depends on ------------------------------------------------------
# The process settings a compile reads (inductor keys its caches on the matmul ones): torch's
# per-backend fp32 precisions where it has them (2.9+), and the older switches where it does not.
PRECISION = (
    "backends.fp32_precision", "backends.cuda.matmul.fp32_precision", "backends.cudnn.fp32_precision",
    "backends.cudnn.conv.fp32_precision", "backends.cudnn.rnn.fp32_precision", "backends.mkldnn.fp32_precision",
    "backends.mkldnn.matmul.fp32_precision", "backends.mkldnn.conv.fp32_precision", "backends.mkldnn.rnn.fp32_precision",
    "backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
    "backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
)
LEGACY_PRECISION = ("backends.cuda.matmul.allow_tf32", "backends.cudnn.allow_tf32")


def _owner(path: str) -> tuple[Any, str]:
    """("backends.cuda.matmul.allow_tf32") -> (torch.backends.cuda.matmul, "allow_tf32")."""
    owner, _, name = path.rpartition(".")
    return functools.reduce(getattr, owner.split("."), torch), name


def _setting(path: str):
    return getattr(*_owner(path))


def precision_settings() -> dict:
    """The matmul and convolution precision settings this process runs under, by path."""
    paths = PRECISION if hasattr(torch.backends.cuda.matmul, "fp32_precision") else LEGACY_PRECISION
    found = {"matmul_precision": torch.get_float32_matmul_precision()}  # first: setting it moves the others
    for path in paths:
        try:
            found[path] = _setting(path)
        except (AttributeError, RuntimeError):  # not in this torch
            pass
    return found


def _apply_precision(wanted: dict) -> None:
    """Set what differs from `wanted` only: setting one switch moves others in torch (the
    legacy `set_float32_matmul_precision("highest")` sets "ieee" where the default is
    "none", a different cache key for the same kernels)."""
    for path, value in wanted.items():
        if path == "matmul_precision":
            if torch.get_float32_matmul_precision() != value:
                torch.set_float32_matmul_precision(value)
            continue
        try:
            if _setting(path) != value:
                setattr(*_owner(path), value)
        except (AttributeError, RuntimeError):
            pass


def torch_state() -> dict:
    """The caller's settings that decide what a compile builds (and its cache keys)."""
    state = {
        "precision": precision_settings(),
        "default_dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "autocast": [(d, torch.get_autocast_dtype(d)) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)],
        # dynamo's global-state guard holds the thread count: a caller that set its own would
        # refuse every function the worker compiled under the worker's
        "num_threads": torch.get_num_threads(),
        # the trace picks scaled_dot_product_attention's kernel among the backends enabled
        "attention_backends": sdp_flags(),
    }
    carried = {}
    for name, (read, _) in CARRIED.items():
        try:
            carried[name] = read()
        except Exception:  # noqa: BLE001 - that library's state is then the worker's own
            pass
    state["carried"] = carried
    for name, module in (("dynamo", torch._dynamo.config), ("inductor", torch._inductor.config)):
        save = getattr(module, "save_config_portable", None)
        if save is not None:
            state[name] = _less_deprecated(module, save())
    return state


def _less_deprecated(module, settings: dict) -> dict:
    """`settings` less the keys torch marks deprecated: setting them again in the worker only
    warns (a FutureWarning a user would see on every background compile), and changes nothing."""
    entries = getattr(module, "_config", {})
    return {k: v for k, v in settings.items() if not getattr(entries.get(k), "deprecated", False)}


@contextlib.contextmanager
def applied(state: dict):
    """Run under the caller's `torch_state()` (the worker's process settings, then autocast)."""
    _apply_precision(state["precision"])
    if torch.get_default_dtype() != state["default_dtype"]:
        torch.set_default_dtype(state["default_dtype"])
    if torch.are_deterministic_algorithms_enabled() != state["deterministic"]:
        torch.use_deterministic_algorithms(state["deterministic"])
    if state.get("num_threads") and torch.get_num_threads() != state["num_threads"]:
        torch.set_num_threads(state["num_threads"])
    if state.get("attention_backends"):
        set_sdp_flags(state["attention_backends"])
    for name, value in state.get("carried", {}).items():
        if name in CARRIED:
            CARRIED[name][1](value)
    with contextlib.ExitStack() as stack:
        for name, module in (("dynamo", torch._dynamo.config), ("inductor", torch._inductor.config)):
            if name in state:
                stack.enter_context(module.patch(state[name]))
        for device, dtype in state["autocast"]:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield
