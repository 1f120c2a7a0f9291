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

A message above the buffer (`max_bytes`), of another dtype, or not a whole number of 4-byte
words takes NCCL's functional all-reduce. The choice is made per call, on the real size:
eagerly, or while a graph of one size is captured. Under a symbolic trace (`split`'s
make_fx) the size is not known yet, so the reduce is recorded as one registered op,
`graphify_models::symm_mem_all_reduce`, which makes the same choice when it runs.
"""

from __future__ import annotations

import logging
import os
import socket

import torch

__all__ = ["DEFAULT_MAX_BYTES", "symm_mem_reduce", "nccl_reduce", "nccl_gather_last"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 << 20  # 8 MiB: B=1024 tokens of a 4096-wide bf16 hidden state
_DTYPES = (torch.bfloat16, torch.float32)  # what the one-shot kernel dispatches on
_BUFFERS: dict[tuple, torch.Tensor] = {}  # (group name, max_bytes, dtype, device) -> rendezvoused buffer


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
    """Sum `x` over the group through `buf`, or through NCCL when `x` does not fit it."""
    n, size = x.numel(), x.element_size()
    if n == 0 or x.dtype != buf.dtype or n > buf.numel() or (n * size) % 4:
        return nccl_reduce(name)(x)
    if not x.is_contiguous() or (x.storage_offset() * size) % 16:  # the kernel wants both views aligned alike
        x = x.clone(memory_format=torch.contiguous_format)
    return torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:n].view(x.shape), x, "sum", name)


@torch.library.custom_op("graphify_models::symm_mem_all_reduce", mutates_args=())
def symm_mem_all_reduce(x: torch.Tensor, group_name: str, max_bytes: int) -> torch.Tensor:
    """The reduce as one op, for symbolic traces: its buffer is looked up when it runs."""
    buf = _BUFFERS.get((group_name, max_bytes, x.dtype, x.device))
    return _one_shot(x, buf, group_name) if buf is not None else nccl_reduce(group_name)(x)


@symm_mem_all_reduce.register_fake
def _(x, group_name, max_bytes):
    return torch.empty_like(x)


def _make_reduce(name: str, buf: torch.Tensor, max_bytes: int):
    """The symm_mem reduce over `buf` (rendezvoused for group `name`)."""

    def reduce(x: torch.Tensor) -> torch.Tensor:
        if isinstance(x.numel(), torch.SymInt):  # a symbolic trace: choose when the op runs
            return torch.ops.graphify_models.symm_mem_all_reduce(x, name, max_bytes)
        return _one_shot(x, buf, name)

    reduce.kind, reduce.fallback_reason = "symm_mem", None
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


def _agree(ok: bool, group, device) -> bool:
    """Whether every rank of `group` is ok (collective)."""
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
    return buf


def _self_test(buf: torch.Tensor, name: str, rank: int, world: int) -> bool:
    """One eager one-shot all-reduce of known values: whether it gave their sum."""
    n = min(256, buf.numel())
    x = torch.full((n,), float(rank + 1), dtype=buf.dtype, device=buf.device)
    out = torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:n], x, "sum", name)
    return bool((out == world * (world + 1) / 2).all().item())


def symm_mem_reduce(group, dtype: torch.dtype, device, max_bytes: int = DEFAULT_MAX_BYTES):
    """(reduce, None) summing over `group` through symmetric memory, or (None, reason) when it
    cannot. Collective: every rank of `group` calls it, outside any capture, in the same order.
    Buffers are made once per (group, max_bytes, dtype, device) and shared."""
    import torch.distributed as dist

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    reason = _static_reason(group, dtype, device)
    if reason is not None:
        return None, reason
    name, key = group.group_name, (group.group_name, max_bytes, dtype, device)
    if key in _BUFFERS:
        return _make_reduce(name, _BUFFERS[key], max_bytes), None
    try:
        reason = _peer_reason(group, device)
    except Exception as exc:  # noqa: BLE001 - no answer is a reason to fall back
        reason = f"could not check P2P access: {type(exc).__name__}: {exc}"
    if not _agree(reason is None, group, device):
        return None, reason or "another rank cannot read its peers' GPUs directly"
    try:
        buf = _rendezvous(name, max_bytes, dtype, device)
        if not _self_test(buf, name, dist.get_rank(group), dist.get_world_size(group)):
            reason = "the one-shot all-reduce's self-test gave a wrong sum"
    except Exception as exc:  # noqa: BLE001 - any failure is a reason to fall back, on every rank
        buf, reason = None, f"symmetric memory failed: {type(exc).__name__}: {exc}"
    if not _agree(reason is None, group, device):
        return None, reason or "symmetric memory failed on another rank"
    _BUFFERS[key] = buf
    return _make_reduce(name, buf, max_bytes), None
