"""A Triton matmul for a few rows: `y[M, N] = x[M, K] @ w[N, K].T` in bf16 (or fp16), M <= 16,
written for HBM bandwidth (decode's GEMMs read every weight once per token and compute little).

Each program owns `block_n` rows of `w` and walks its share of K in chunks of `block_k`, with
16-byte loads along K (the weight's marked evict-first: read once), `num_stages - 1` chunks
in flight as asynchronous copies when above 1, and accumulates in fp32 for all M rows at
once: a broadcast multiply into a [M, block_n, block_k] accumulator summed once at the end
(`dot=False`, few rows), or `tl.dot` with the rows padded to 16 (`dot=True`).

Few output blocks (k/v's N = 1024) leave SMs idle, so K may be split over `split_k` programs
per block. Each writes its fp32 partial to a workspace and counts itself in at a per-block
counter; the last to arrive sums the partials in split order (deterministic), writes `y` and
zeroes the counter for the next launch: one launch, no memset, no second pass, graph-safe.
A workspace serves one stream at a time (its launches in stream order).

`choose(m, n, k, sms)` is a pure function of the shape: the same shape always gets the same
config, so a captured graph replays what eager ran. The first call of a config compiles (and
allocates its workspace): make it before any capture. Triton is imported on first use; it is
not a dependency, and without it `gemv` raises `RuntimeError`. CPU tensors run under Triton's
interpreter (TRITON_INTERPRET=1 before Triton is imported), for tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["GemvConfig", "choose", "candidates", "gemv", "available", "interpreting", "sms"]


@dataclass(frozen=True)
class GemvConfig:
    """One launch's shape: rows of `w` per program, K per step, programs per block (split-K),
    warps, pipeline stages, and broadcast-multiply (`dot=False`) or `tl.dot` (`dot=True`)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    dot: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k", "split_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig: {name} must be a power of two, got {value}")
        if self.dot and self.block_n < 16:
            raise ValueError(f"GemvConfig: tl.dot needs block_n >= 16, got {self.block_n}")


MAX_ROWS = 16
DEFAULT_SMS = 132  # an H100 SXM / H200: the CPU's interpreter has no count of its own


def _pad(m: int) -> int:
    return 1 << max(m - 1, 0).bit_length()


def _split(n: int, k: int, block_n: int, block_k: int, programs: int) -> int:
    """The fewest K splits (a power of two, at most 8, each at least two steps) that bring the
    launch to `programs` programs."""
    split = 1
    while -(-n // block_n) * split < programs and split < 8 and k // (2 * split) >= 2 * block_k:
        split *= 2
    return split


def choose(m: int, n: int, k: int, sms: int = DEFAULT_SMS) -> GemvConfig:
    """The config for an [m, k] x [n, k].T product on a GPU of `sms` SMs. One row:
    broadcast-multiply over 2 rows of w a program and 2048 K a step (4 and 1024 past 8192 K),
    plain loads, 4 warps: on an H200 the fastest of `candidates` at every Llama-3-8B shape but
    the LM head (1.6% off) in `benchmarks.one_row_gemm --sweep`. Up to 4 rows: 4 rows of w and
    fewer K a step as the rows grow (the fp32 accumulator holds m * block_n * block_k values).
    Above: `tl.dot` over 32 rows of w, four stages of asynchronous copies. K is split until
    about two programs per SM."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"choose: m must be 1 to {MAX_ROWS}, got {m}")
    if m <= 4:
        block_n, block_k = ((2, 2048) if k <= 8192 else (4, 1024)) if m == 1 else (4, 1024 // _pad(m))
        return GemvConfig(block_n, block_k, _split(n, k, block_n, block_k, 2 * sms), num_warps=4, num_stages=1)
    block_n, block_k = 32, 128
    return GemvConfig(block_n, block_k, _split(n, k, block_n, block_k, 2 * sms), num_warps=4, num_stages=4,
                      dot=True)


def candidates(m: int, n: int, k: int, sms: int = DEFAULT_SMS) -> list[GemvConfig]:
    """Configs around `choose`'s (first) for a benchmark to time: broadcast-multiply with 2 to
    16 rows of w per program (K per step from a budget of 32-64 accumulators a thread), plain
    loads or three stages of asynchronous copies, 4 or 8 warps; `tl.dot` with 16 to 64 rows."""
    pad = _pad(m)
    found = [choose(m, n, k, sms)]
    if pad <= 8:
        for block_n in (2, 4, 8, 16):
            block_k = max(64, min(2048, 8192 // (block_n * pad)))
            for stages in (1, 3):
                found.append(GemvConfig(block_n, block_k, _split(n, k, block_n, block_k, 2 * sms), num_stages=stages))
            found.append(GemvConfig(block_n, block_k, _split(n, k, block_n, block_k, 2 * sms), num_warps=8))
        for block_k in (512, 2048):
            found.append(GemvConfig(4, block_k, _split(n, k, 4, block_k, 2 * sms)))
    for block_n, block_k in ((16, 256), (32, 128), (64, 128)):
        found.append(GemvConfig(block_n, block_k, _split(n, k, block_n, block_k, 2 * sms), num_stages=4, dot=True))
    return list(dict.fromkeys(found))


def available() -> bool:
    """Whether Triton can be imported here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter here: TRITON_INTERPRET=1 when Triton was
    imported (its own library functions, `tl.zeros` among them, are decorated then)."""
    import triton.language as tl

    return type(tl.zeros).__name__ == "InterpretedFunction"


@functools.lru_cache(maxsize=None)
def _kernel():
    """The kernel, built on first use (decorated for the interpreter or not as Triton was)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x, w, y, part, counters, m, n,
                    K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT: tl.constexpr, STEPS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                    DOT: tl.constexpr, DOT_F32: tl.constexpr, STAGES: tl.constexpr):
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.arange(0, M_PAD)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        start = split * (STEPS * BLOCK_K)
        if DOT:
            acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
            x_at = x + rows[:, None] * K + ks[None, :]
            w_at = w + cols.to(tl.int64)[:, None] * K + ks[None, :]
            x_in = rows[:, None] < m
            w_in = cols[:, None] < n
        else:  # [M_PAD, BLOCK_N, BLOCK_K]: x broadcast over N, w over M, summed over K at the end
            acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
            # x's pointers broadcast over N before the load, so that x loads in w's layout (the
            # load of a [M_PAD, 1, BLOCK_K] tile took a layout of its own, converted through
            # shared memory every step); the repeats hit L1
            spread = tl.zeros([1, BLOCK_N, 1], dtype=tl.int32)
            x_at = x + (rows[:, None, None] * K + ks[None, None, :] + spread)
            w_at = w + cols.to(tl.int64)[None, :, None] * K + ks[None, None, :]
            x_in = (rows[:, None, None] + spread) < m
            w_in = cols[None, :, None] < n
        for step in tl.range(0, STEPS, num_stages=STAGES):
            k0 = start + step * BLOCK_K
            if EVEN_K:
                x_ok = x_in
                w_ok = w_in
            elif DOT:
                x_ok = x_in & (k0 + ks[None, :] < K)
                w_ok = w_in & (k0 + ks[None, :] < K)
            else:
                x_ok = x_in & (k0 + ks[None, None, :] < K)
                w_ok = w_in & (k0 + ks[None, None, :] < K)
            xs = tl.load(x_at + k0, mask=x_ok, other=0.0, eviction_policy="evict_last")
            if EVEN_N and EVEN_K:
                ws = tl.load(w_at + k0, eviction_policy="evict_first")
            else:
                ws = tl.load(w_at + k0, mask=w_ok, other=0.0, eviction_policy="evict_first")
            if DOT_F32:  # the interpreter (3.6) multiplies bf16 dot operands as their uint16 bits
                acc += tl.dot(xs.to(tl.float32), tl.trans(ws.to(tl.float32)))
            elif DOT:
                acc += tl.dot(xs, tl.trans(ws))
            else:
                acc += xs.to(tl.float32) * ws.to(tl.float32)
        if DOT:
            total = acc
        else:
            total = tl.sum(acc, axis=2)
        out_at = rows[:, None] * n + cols[None, :]
        out_ok = (rows[:, None] < m) & (cols[None, :] < n)
        if SPLIT == 1:
            tl.store(y + out_at, total.to(y.dtype.element_ty), mask=out_ok)
        else:
            # this split's partial, then count in; the last to arrive sums them in split order
            tl.store(part + split * (M_PAD * n) + out_at, total, mask=out_ok)
            tl.debug_barrier()  # every thread's partial stored before the release below
            arrived = tl.atomic_add(counters + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                tl.debug_barrier()
                total = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLIT):  # from L2 (.cg): other SMs wrote them
                    total += tl.load(part + s * (M_PAD * n) + out_at, mask=out_ok, other=0.0, cache_modifier=".cg")
                tl.store(y + out_at, total.to(y.dtype.element_ty), mask=out_ok)
                tl.atomic_xchg(counters + pid_n, 0)

    return gemv_kernel


@functools.lru_cache(maxsize=None)
def _compiles_as_inductor(device_index: int) -> None:
    """Once a process, before the first compile: Triton's cache folder and ptxas as inductor's
    (`graphify.compile.background.triton_env`), so the binaries graphify's compile worker built for the GEMV
    are found here."""
    from graphify.extend import as_inductor_compiles

    as_inductor_compiles(device_index)


_WORKSPACES: dict = {}  # never freed: a captured graph keeps reading the one it captured


def _workspace(device: torch.device, parts: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, parts, blocks)
    if key not in _WORKSPACES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # made inside a capture, the counters' zeroing would run only when that graph
            # replays: any other launch before it would meet whatever the memory held
            raise RuntimeError("gemv: the first split-K call of this shape is inside a CUDA graph capture; "
                               "call it once outside the capture first")
        _WORKSPACES[key] = (torch.empty(parts, dtype=torch.float32, device=device),
                            torch.zeros(blocks, dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def sms(device: torch.device) -> int:
    """`device`'s SM count (`DEFAULT_SMS` off CUDA), the count `choose` takes."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """`x @ w.T` for x [M, K] (M <= 16) and a contiguous w [N, K] of x's dtype, into `out`
    ([M, N], contiguous) when given. `config`: `choose`'s for the shape unless given.

    >>> y = gemv(x, w)  # as torch.nn.functional.linear(x, w), fp32 sums
    """
    try:
        import triton
    except ImportError:
        raise RuntimeError("gemv: Triton is not installed (pip install triton); use torch.nn.functional.linear") from None
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv(x, w): expected x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv(x, w): 1 to {MAX_ROWS} rows, got {m}")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemv(x, w): x and w both bfloat16 or float16, got {x.dtype} and {w.dtype}")
    if w.stride() != (k, 1):
        raise ValueError(f"gemv(x, w): w must be contiguous, got strides {w.stride()}")
    kernel = _kernel()
    interpret = interpreting()
    if interpret != (type(kernel).__name__ == "InterpretedFunction"):
        raise RuntimeError("gemv: TRITON_INTERPRET changed after Triton was imported; set it before, once")
    if not x.is_cuda and not interpret:
        raise RuntimeError("gemv(x, w): CPU tensors run only under Triton's interpreter "
                           "(TRITON_INTERPRET=1 before Triton is imported)")
    x = x.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"gemv(x, w, out): out must be a contiguous {x.dtype} [{m}, {n}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    cfg = config or choose(m, n, k, sms(x.device))
    m_pad = max(_pad(m), 16) if cfg.dot else _pad(m)
    steps = triton.cdiv(k, cfg.split_k * cfg.block_k)
    blocks = triton.cdiv(n, cfg.block_n)
    part, counters = (out, out) if cfg.split_k == 1 else _workspace(x.device, cfg.split_k * m_pad * n, blocks)
    if x.is_cuda:
        _compiles_as_inductor(x.device.index or 0)
    kernel[(blocks, cfg.split_k)](
        x, w, out, part, counters, m, n,
        K=k, M_PAD=m_pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split_k, STEPS=steps,
        EVEN_K=k % (cfg.split_k * cfg.block_k) == 0, EVEN_N=n % cfg.block_n == 0, DOT=cfg.dot,
        DOT_F32=cfg.dot and interpret, STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
