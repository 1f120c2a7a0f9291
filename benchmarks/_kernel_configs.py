"""The launch configs inductor's autotuner chose for each Triton kernel a compile built.

A pointwise or reduction kernel with several candidate configs is timed at its first run and
the fastest kept (`triton.autotune_pointwise`); inductor saves the pick beside the kernel's
source, as a `.best_config` file in its cache. Two processes compiling the same kernel can pick
differently, so a kernel slower in one line than in another may be the pick, not the code:
`benchmarks.zoo --profile` records each row's picks, and `benchmarks.zoo_kernels` shows them
beside the kernels that differ.
"""

from __future__ import annotations

import glob
import json
import os
import re

__all__ = ["chosen_configs", "picks_kept", "picks_unread", "KEPT"]

KEPT = ("XBLOCK", "YBLOCK", "R0_BLOCK", "RBLOCK", "num_warps", "num_stages", "found_by_coordesc")
_NAME = re.compile(r"^def (triton_\w+)\(", re.M)


def _best_config_path(source: str) -> str:
    """Where inductor keeps the pick for the kernel whose source file is `source`: the path its own
    `AutotuneCache.create` names for it (torch 2.13 folds torch's own key into the name, 2.11 does
    otherwise; asking inductor follows either without knowing it)."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    cache = AutotuneCache.create({}, source, "")
    if cache is None or cache.local_cache is None:
        raise LookupError(f"this inductor keeps no local autotune cache for {source}")
    return cache.local_cache[1]


def _inductors(cache_dir: "str | None") -> str:
    if cache_dir is not None:
        return cache_dir
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductors

    return inductors()


def picks_kept(cache_dir: "str | None" = None) -> int:
    """How many `.best_config` files inductor's cache holds, matched to a kernel or not: picks
    kept where `chosen_configs` finds none mean this torch names them otherwise."""
    return len(glob.glob(os.path.join(_inductors(cache_dir), "**", "*.best_config"), recursive=True))


def picks_unread(cache_dir: "str | None" = None, most: int = 3) -> list[dict]:
    """The `.best_config` files kept that no kernel source's pick path names (`most` of them), each
    with the names this inductor gives its folder's sources: on a torch that names picks otherwise,
    what to read them by."""
    cache_dir = _inductors(cache_dir)
    named = {}
    for source in glob.glob(os.path.join(cache_dir, "**", "*.py"), recursive=True):
        named.setdefault(os.path.dirname(source), []).append(os.path.basename(_best_config_path(source)))
    kept = sorted(glob.glob(os.path.join(cache_dir, "**", "*.best_config"), recursive=True))
    unread = [p for p in kept if os.path.basename(p) not in named.get(os.path.dirname(p), [])]
    return [{"kept": os.path.relpath(p, cache_dir), "named": sorted(named.get(os.path.dirname(p), []))[:4]}
            for p in unread[:most]]


def chosen_configs(cache_dir: "str | None" = None, seen: "set[str] | None" = None) -> dict[str, list[dict]]:
    """Kernel name -> the picks (one a compiled kernel of that name) of the kernels under inductor's
    cache `cache_dir` (this process's, `TORCHINDUCTOR_CACHE_DIR` or inductor's default, if None)
    that have one, leaving out sources in `seen` and adding the rest to it (a process's later
    shape: only what its own compile built)."""
    cache_dir = _inductors(cache_dir)
    picks: dict[str, list[dict]] = {}
    for source in sorted(glob.glob(os.path.join(cache_dir, "**", "*.py"), recursive=True)):
        if seen is not None and source in seen:
            continue
        best = _best_config_path(source)  # raises where this inductor keeps no picks: the caller says so
        if not os.path.exists(best):
            continue
        with open(source) as f:
            name = _NAME.search(f.read())
        if name is None:
            continue
        with open(best) as f:
            config = json.load(f)
        picks.setdefault(name.group(1), []).append({k: config[k] for k in KEPT if k in config})
        if seen is not None:
            seen.add(source)
    return picks
