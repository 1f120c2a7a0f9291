"""Capture-size schedules and the padding map (pure functions over sorted integers)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable

__all__ = [
    "vllm_sizes",
    "sglang_decode_sizes",
    "sglang_piecewise_sizes",
    "normalize_sizes",
    "round_to_multiple",
    "pad_to",
    "padding_table",
]


def _check_max(name: str, max_size: int) -> int:
    if int(max_size) != max_size or max_size < 1:
        raise ValueError(f"{name}(max_size={max_size!r}): max_size must be a positive integer")
    return int(max_size)


def vllm_sizes(max_size: int = 512) -> tuple[int, ...]:
    """vLLM's default schedule: 1, 2, 4, then steps of 8 below 256, then steps of 16.

    `max_size=0` gives no sizes, as vLLM's `max_cudagraph_capture_size = 0` (mode NONE).

    !!! example
        >>> len(vllm_sizes(512)), vllm_sizes(20), vllm_sizes(0)
        (51, (1, 2, 4, 8, 16), ())
    """
    if max_size == 0 and not isinstance(max_size, bool):
        return ()  # vLLM: max_cudagraph_capture_size = 0 means no capture (mode NONE)
    m = _check_max("vllm_sizes", max_size)
    sizes = [s for s in (1, 2, 4) if s <= m]
    sizes += range(8, min(m + 1, 256), 8)
    sizes += range(256, m + 1, 16)
    return tuple(sizes)


def sglang_decode_sizes(max_size: int = 256) -> tuple[int, ...]:
    """SGLang's decode batch sizes: 1, 2, 4, 8, 12, then 16-256 by 8, 272-496 by 16, 512+ by 32."""
    m = _check_max("sglang_decode_sizes", max_size)
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 497, 16), *range(512, m + 1, 32)]
    return tuple(s for s in sizes if s <= m)


def sglang_piecewise_sizes(max_size: int = 4096) -> tuple[int, ...]:
    """SGLang's token schedule for piecewise prefill/extend graphs.

    4-32 by 4, 48-256 by 16, 288-512 by 32, 576-1024 by 64, 1280-4096 by 256, then by 512.

    !!! example
        >>> len(sglang_piecewise_sizes(2048)), len(sglang_piecewise_sizes(8192))
        (42, 58)
    """
    m = _check_max("sglang_piecewise_sizes", max_size)
    sizes = [
        *range(4, 33, 4),
        *range(48, 257, 16),
        *range(288, 513, 32),
        *range(576, 1025, 64),
        *range(1280, 4097, 256),
        *range(4608, m + 1, 512),
    ]
    return tuple(s for s in sizes if s <= m)


def normalize_sizes(sizes: Iterable[int], *, name: str = "sizes", allow_empty: bool = False) -> tuple[int, ...]:
    """Sorted, de-duplicated positive integers; `ValueError` naming the bad value. An
    empty list is an error unless `allow_empty` (mode NONE captures nothing)."""
    out = set()
    for s in sizes:
        if isinstance(s, bool) or int(s) != s or s < 1:
            raise ValueError(f"{name}: capture sizes must be positive integers, got {s!r}")
        out.add(int(s))
    if not out and not allow_empty:
        raise ValueError(f"{name}: need at least one capture size (an empty list is valid with mode NONE only)")
    return tuple(sorted(out))


def round_to_multiple(sizes: Iterable[int], k: int) -> tuple[int, ...]:
    """Round every size up to a multiple of `k` (spec decode with 1+k query tokens, TP)."""
    if k < 1:
        raise ValueError(f"round_to_multiple: k must be >= 1, got {k}")
    return normalize_sizes(-(-s // k) * k for s in normalize_sizes(sizes))


def pad_to(sizes: tuple[int, ...], n: int) -> int | None:
    """The smallest size >= n, or None when n is above the largest (the batch runs eagerly).

    `sizes` must be sorted ascending (as `normalize_sizes` returns them).
    """
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def padding_table(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """`pad_to` precomputed for every n in 0..max(sizes): index with n, O(1) per batch."""
    table = [0] * (sizes[-1] + 1)
    lo = 0
    for s in sizes:
        for n in range(lo + 1, s + 1):
            table[n] = s
        lo = s
    return tuple(table)
