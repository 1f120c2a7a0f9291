"""A one-shot all-reduce through PyTorch symmetric memory, for tensor parallelism's small
messages (a decode step's hidden states, a few KB), where NCCL's per-call latency, not
bandwidth, is the cost: a Llama-3-8B TP=2 decode step makes 64 of them.

Each rank has one buffer that every rank of the group has mapped (`symm_mem.empty` +
`rendezvous`, NVLink P2P). `symm_mem::one_shot_all_reduce_copy` is one kernel: it copies
this rank's partial sum into its buffer, waits on the signal pads for the peers, reads every
peer's buffer over P2P and adds them up. No NCCL and no NVLink multicast: the `multimem_*`
ops are never called, and rendezvous runs with TORCH_SYMM_MEM_DISABLE_MULTICAST=1, so no
multicast object is made (the lent machines forbid one). It is capturable: the buffer is
allocated and rendezvoused once, outside any capture, and the kernel reads only device
pointers fixed at rendezvous.

For large messages a two-shot all-reduce may be cheaper (each rank reads only its share of
every peer's message, then every rank's reduced share): `symm_mem::two_shot_all_reduce_out`
over the same buffer, the message copied in first (that op reads its input from symmetric
memory) and written to a fresh output. `choose` picks per message: one-shot up to
`one_shot_max`, two-shot above it up to `two_shot_max`, NCCL above both. The defaults
(`thresholds`) are the crossover `benchmarks.all_reduce_crossover` measured inside graphs on
two and four H200s (NVLink, 2026-11-28): one-shot up to 1 MiB on two GPUs and 512 KiB on
more, two-shot above it up to the buffer. There one-shot was fastest up to those sizes, and
two-shot beat both one-shot and NCCL from 2 MiB to 16 MiB (at 8 MiB on four GPUs: 55 µs
against one-shot's 96 and NCCL's 69). Where two-shot cannot run, the rule before it holds:
one-shot up to the buffer.

A message above the buffer (`max_bytes`), of another dtype, or not a whole number of 4-byte
words takes NCCL's functional all-reduce. The choice is made per call, on the real size:
eagerly, or while a graph of one size is captured. Under a symbolic trace (`split`'s
make_fx) the size is not known yet, so the reduce is recorded as one registered op,
`graphify_models::symm_mem_all_reduce`, which makes the same choice when it runs (so is a
two-shot reduce under a fake trace: torch registers no fake kernel for the two-shot op).
"""

from __future__ import annotations

import logging
import os
import socket

import torch

__all__ = ["DEFAULT_MAX_BYTES", "ONE_SHOT_MAX_BYTES", "ONE_SHOT_MAX_BYTES_MANY", "KINDS", "agree", "choose",
           "thresholds", "two_shot_reason", "symm_mem_reduce", "nccl_reduce", "nccl_gather_last"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 << 20  # 8 MiB: B=1024 tokens of a 4096-wide bf16 hidden state
ONE_SHOT_MAX_BYTES = {2: 1 << 20}  # world size -> the one-shot limit measured there
ONE_SHOT_MAX_BYTES_MANY = 512 << 10  # any other world: four GPUs' (each rank reads more peers' whole messages)
_DTYPES = (torch.bfloat16, torch.float32)  # what the one- and two-shot kernels dispatch on
KINDS = ("one_shot", "two_shot", "nccl")  # in the order `choose` hands them out as messages grow
_BUFFERS: dict[tuple, torch.Tensor] = {}  # (group name, max_bytes, dtype, device) -> rendezvoused buffer
_TWO_SHOT: dict[tuple, str | None] = {}  # the same keys -> why two-shot cannot run there (None: it can)
_WORLDS: dict[str, int] = {}  # group name -> its world size (the two-shot out-of-place kernel takes 2, 4 or 8)
_HANDLES: dict[int, object] = {}  # a buffer's address -> its rendezvous handle (peers' buffers and signal pads)


def choose(nbytes: int, dtype: torch.dtype, one_shot_max: int, two_shot_max: int, max_bytes: int,
           buffer_dtype: torch.dtype | None = None) -> str:
    """The kind of reduce ("one_shot", "two_shot" or "nccl") for a message of `nbytes` bytes of
    `dtype`: NCCL for what the buffer cannot take (empty, above `max_bytes`, not a whole number
    of 4-byte words, a dtype the kernels or the buffer (`buffer_dtype`) do not hold); else
    one-shot up to `one_shot_max`, two-shot above it up to `two_shot_max`, NCCL above both.
    With one_shot_max = max_bytes and two_shot_max = 0 (`thresholds`' defaults): one-shot
    whenever the buffer can take the message, the rule before two-shot."""
    if nbytes <= 0 or nbytes > max_bytes or nbytes % 4 or dtype not in _DTYPES:
        return "nccl"
    if buffer_dtype is not None and dtype != buffer_dtype:
        return "nccl"
    if nbytes <= one_shot_max:
        return "one_shot"
    return "two_shot" if nbytes <= two_shot_max else "nccl"


def thresholds(max_bytes: int, one_shot_max_bytes: int | None = None, two_shot_max_bytes: int | None = None,
               world: int = 2) -> tuple[int, int]:
    """(one_shot_max, two_shot_max) for `choose` on a group of `world` ranks: unless told,
    one-shot up to the measured crossover (`ONE_SHOT_MAX_BYTES`, never past the buffer) and
    two-shot above it up to the buffer. Raises ValueError on a negative or non-integer
    threshold."""
    one = min(ONE_SHOT_MAX_BYTES.get(world, ONE_SHOT_MAX_BYTES_MANY), max_bytes) if one_shot_max_bytes is None \
        else one_shot_max_bytes
    two = max_bytes if two_shot_max_bytes is None else two_shot_max_bytes
    named = (("max_bytes", max_bytes), ("one_shot_max_bytes", one), ("two_shot_max_bytes", two))
    for what, value in named:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"symm_mem all-reduce: {what} must be a non-negative int of bytes, not {value!r}")
    return one, two


def two_shot_reason() -> str | None:
    """Why this torch cannot run the two-shot all-reduce (None: it has the op)."""
    ops = torch.ops.symm_mem
    if not (hasattr(ops, "two_shot_all_reduce_out") or hasattr(ops, "two_shot_all_reduce_")):
        return f"torch {torch.__version__} has no symm_mem::two_shot_all_reduce_out or two_shot_all_reduce_"
    return None


def nccl_reduce(name: str):
    """x -> the sum of x over group `name`, by torch's functional collective (NCCL; gloo on CPUs)."""

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", name))

    return reduce


def nccl_gather_last(name: str, world: int):
    """x [..., n] -> [..., world * n], the ranks' slices of the last dimension joined in rank
    order, by torch's functional all-gather (NCCL; gloo on CPUs): a vocab-parallel LM head's
    logits."""

    def gather(x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops._c10d_functional
        joined = ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), world, name))  # [world * rows, n]
        return joined.view(world, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], world * x.shape[-1])

    return gather


def _one_shot(x: torch.Tensor, buf: torch.Tensor, name: str) -> torch.Tensor:
    """Sum `x` over the group by the one-shot kernel, which copies `x` into `buf` itself."""
    size = x.element_size()
    if not x.is_contiguous() or (x.storage_offset() * size) % 16:  # the kernel wants both views aligned alike
        x = x.clone(memory_format=torch.contiguous_format)
    return torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:x.numel()].view(x.shape), x, "sum", name)


def _two_shot(x: torch.Tensor, buf: torch.Tensor, name: str) -> torch.Tensor:
    """Sum `x` over the group by the two-shot kernel: `x` copied into `buf` (the op reads its
    input from symmetric memory), the sum written to a new tensor (`buf` is reused by the next
    reduce). The out-of-place kernel takes worlds of 2, 4 and 8; others run in place, then copy."""
    staged = buf[:x.numel()].view(x.shape)
    staged.copy_(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ops = torch.ops.symm_mem
    if hasattr(ops, "two_shot_all_reduce_out") and _WORLDS.get(name) in (2, 4, 8):
        return ops.two_shot_all_reduce_out(staged, "sum", name, out)
    ops.two_shot_all_reduce_(staged, "sum", name)
    return out.copy_(staged)


def _reduce(x: torch.Tensor, buf: torch.Tensor, name: str, one_shot_max: int, two_shot_max: int) -> torch.Tensor:
    """Sum `x` over the group by the kind `choose` gives its size (NCCL where `buf` cannot serve)."""
    kind = choose(x.numel() * x.element_size(), x.dtype, one_shot_max, two_shot_max,
                  buf.numel() * buf.element_size(), buf.dtype)
    if kind == "one_shot":
        return _one_shot(x, buf, name)
    return _two_shot(x, buf, name) if kind == "two_shot" else nccl_reduce(name)(x)


@torch.library.custom_op("graphify_models::symm_mem_all_reduce", mutates_args=())
def symm_mem_all_reduce(x: torch.Tensor, group_name: str, max_bytes: int, one_shot_max: int,
                        two_shot_max: int) -> torch.Tensor:
    """The reduce as one op, for symbolic traces: its buffer is looked up when it runs."""
    buf = _BUFFERS.get((group_name, max_bytes, x.dtype, x.device))
    return _reduce(x, buf, group_name, one_shot_max, two_shot_max) if buf is not None else nccl_reduce(group_name)(x)


@symm_mem_all_reduce.register_fake
def _(x, group_name, max_bytes, one_shot_max, two_shot_max):
    return torch.empty_like(x)


def _traced(x: torch.Tensor) -> bool:
    """Whether `x` is a fake or functional tensor of a trace (no kernel runs on it)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(x, (FakeTensor, FunctionalTensor))


def _make_reduce(name: str, buf: torch.Tensor, max_bytes: int, one_shot_max: int | None = None,
                 two_shot_max: int | None = None, two_shot_reason: str | None = None, world: int = 2):
    """The symm_mem reduce over `buf` (rendezvoused for group `name` of `world` ranks): one-shot
    up to `one_shot_max` bytes, two-shot up to `two_shot_max`, NCCL above (defaults: `thresholds`).
    `two_shot_reason` (two-shot cannot run): its range goes to one-shot, as before two-shot."""
    one, two = thresholds(max_bytes, one_shot_max, two_shot_max, world)
    if two_shot_reason is not None:
        one, two = max(one, two), 0
    cap = buf.numel() * buf.element_size()

    def reduce(x: torch.Tensor) -> torch.Tensor:
        if isinstance(x.numel(), torch.SymInt) or (reduce.kind_for(x.numel() * x.element_size(), x.dtype) == "two_shot"
                                                    and _traced(x)):  # choose when the op runs
            return torch.ops.graphify_models.symm_mem_all_reduce(x, name, max_bytes, one, two)
        return _reduce(x, buf, name, one, two)

    reduce.kind, reduce.fallback_reason, reduce.two_shot_reason = "symm_mem", None, two_shot_reason
    reduce.group_name, reduce.max_bytes, reduce.buffer = name, max_bytes, buf
    reduce.one_shot_max_bytes, reduce.two_shot_max_bytes = one, two
    reduce.kind_for = lambda nbytes, dtype: choose(nbytes, dtype, one, two, cap, buf.dtype)  # noqa: E731
    return reduce


def _static_reason(group, dtype, device) -> str | None:
    """Why symmetric memory cannot serve this group, from facts every rank shares."""
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no symmetric memory ({exc})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return f"torch {torch.__version__} has no symm_mem::one_shot_all_reduce_copy"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the tensors are on {device.type}, not a CUDA GPU"
    backend = str(dist.get_backend(group))
    if "nccl" not in backend:  # "nccl", or "cpu:gloo,cuda:nccl" for a group of both
        return f"the group's backend is {backend}, not nccl"
    if dist.get_world_size(group) < 2:
        return "the group has one rank"
    if dtype not in _DTYPES:
        return f"the one-shot kernel takes bfloat16 and float32, not {dtype}"
    if os.environ.get("TORCH_SYMMMEM", "CUDA") != "CUDA":
        return f"TORCH_SYMMMEM={os.environ['TORCH_SYMMMEM']}: only the CUDA backend is known to need no multicast"
    return None


def _peer_reason(group, device) -> str | None:
    """Why this rank cannot read its peers' GPUs directly (collective: every rank calls it)."""
    import torch.distributed as dist

    def uuid(i):
        return str(torch.cuda.get_device_properties(i).uuid)

    mine = (socket.gethostname(), uuid(device))
    peers = [None] * dist.get_world_size(group)
    dist.all_gather_object(peers, mine, group=group)
    local = {uuid(i): i for i in range(torch.cuda.device_count())}
    for host, peer in peers:
        if host != mine[0]:
            return f"a rank runs on another host ({host})"
        if peer != mine[1] and peer in local and not torch.cuda.can_device_access_peer(device, local[peer]):
            return f"GPU {device.index} has no P2P access to GPU {local[peer]}"
    return None


def agree(ok: bool, group, device) -> bool:
    """Whether every rank of `group` is ok (collective; `group` None: the default group). It
    returns once every rank has called it: a line-up too."""
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _rendezvous(name: str, max_bytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's buffer, mapped by every rank of group `name` (collective), multicast off."""
    import torch.distributed._symmetric_memory as symm_mem

    if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
        log.info("symm_mem all-reduce: setting TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (was %r): the one-shot kernel "
                 "needs no multicast object", os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST"))
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # read by rendezvous each time, not once at import
    buf = symm_mem.empty(max_bytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
    buf.zero_()
    handle = symm_mem.rendezvous(buf, name)
    if handle is None:
        raise RuntimeError("rendezvous returned no handle")
    if getattr(handle, "multicast_ptr", 0):
        raise RuntimeError("rendezvous made a multicast object although TORCH_SYMM_MEM_DISABLE_MULTICAST=1")
    _HANDLES[buf.data_ptr()] = handle
    return buf


def _self_test(buf: torch.Tensor, name: str, rank: int, world: int, kind: str = "one_shot") -> bool:
    """One eager all-reduce of known values by `kind`: whether it gave their sum."""
    n = min(256, buf.numel())
    x = torch.full((n,), float(rank + 1), dtype=buf.dtype, device=buf.device)
    out = (_one_shot if kind == "one_shot" else _two_shot)(x, buf, name)
    return bool((out == world * (world + 1) / 2).all().item())


def _check_two_shot(key: tuple, group, buf: torch.Tensor) -> str | None:
    """Why two-shot cannot serve `key`'s buffer (None: its self-test passed on every rank);
    collective, once per buffer."""
    import torch.distributed as dist

    if key not in _TWO_SHOT:
        reason = two_shot_reason()
        if reason is None:
            try:
                if not _self_test(buf, key[0], dist.get_rank(group), dist.get_world_size(group), "two_shot"):
                    reason = "the two-shot all-reduce's self-test gave a wrong sum"
            except Exception as exc:  # noqa: BLE001 - any failure is a reason to use one-shot instead
                reason = f"the two-shot all-reduce failed: {type(exc).__name__}: {exc}"
        if not agree(reason is None, group, buf.device):
            reason = reason or "the two-shot all-reduce failed on another rank"
        _TWO_SHOT[key] = reason
    return _TWO_SHOT[key]


def symm_mem_reduce(group, dtype: torch.dtype, device, max_bytes: int = DEFAULT_MAX_BYTES,
                    one_shot_max_bytes: int | None = None, two_shot_max_bytes: int | None = None):
    """(reduce, None) summing over `group` through symmetric memory, or (None, reason) when it
    cannot. Collective: every rank of `group` calls it, outside any capture, in the same order,
    with the same arguments. Buffers are made once per (group, max_bytes, dtype, device) and
    shared. Per message the reduce is one-shot up to `one_shot_max_bytes`, two-shot up to
    `two_shot_max_bytes`, NCCL above (`choose`; defaults: `thresholds` for the group's size);
    where two-shot cannot run, its range goes to one-shot and `reduce.two_shot_reason` says why."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    one, two = thresholds(max_bytes, one_shot_max_bytes, two_shot_max_bytes, world)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    reason = _static_reason(group, dtype, device)
    if reason is not None:
        return None, reason
    name, key = group.group_name, (group.group_name, max_bytes, dtype, device)
    _WORLDS[name] = world
    if key not in _BUFFERS:
        reason = _make_buffer(key, group)
        if reason is not None:
            return None, reason
    buf = _BUFFERS[key]
    why = _check_two_shot(key, group, buf) if two > one else None
    if why is not None:
        log.warning("symm_mem all-reduce: %s; messages of %d to %d bytes take the one-shot all-reduce instead",
                    why, one + 1, two)
    return _make_reduce(name, buf, max_bytes, one, two, why, world), None


def _make_buffer(key: tuple, group) -> str | None:
    """Rendezvous and self-test `key`'s buffer into `_BUFFERS`; why it failed (None: it did not).
    Collective."""
    import torch.distributed as dist

    name, max_bytes, dtype, device = key
    try:
        reason = _peer_reason(group, device)
    except Exception as exc:  # noqa: BLE001 - no answer is a reason to fall back
        reason = f"could not check P2P access: {type(exc).__name__}: {exc}"
    if not agree(reason is None, group, device):
        return reason or "another rank cannot read its peers' GPUs directly"
    try:
        buf = _rendezvous(name, max_bytes, dtype, device)
        if not _self_test(buf, name, dist.get_rank(group), dist.get_world_size(group)):
            reason = "the one-shot all-reduce's self-test gave a wrong sum"
    except Exception as exc:  # noqa: BLE001 - any failure is a reason to fall back, on every rank
        buf, reason = None, f"symmetric memory failed: {type(exc).__name__}: {exc}"
    if not agree(reason is None, group, device):
        return reason or "symmetric memory failed on another rank"
    _BUFFERS[key] = buf
    return None
