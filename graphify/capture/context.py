"""What every capture runs inside: the garbage collector held still, the arguments'
device current, and the device found from the argument specs."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Sequence

import torch

from graphify.base.axes import ArgSpec
from graphify.base.errors import CaptureError

__all__ = ["freeze_gc", "device_of", "device_scope", "progress"]

YOUNG = 1  # gc.collect(YOUNG): generations 0 and 1, not the oldest, where a loaded model's objects sit


@contextlib.contextmanager
def freeze_gc(collect: bool = True):
    """Collect the young generations once (unless `collect` is False), then keep the GC from
    running (and from scanning old objects) while graphs are captured: a collection
    mid-capture costs time and can free memory the capture is using (vLLM's and SGLang's
    `freeze_gc`). Only the young generations: a full collection in a process holding a
    model walks every object it holds (0.2-0.8 s, paid on a call), and what a capture could
    gain from it, a dead cycle holding device memory, torch's own capture stopped paying
    for (`torch.compiler.config.force_cudagraph_gc`). First-use captures after the first
    skip even that. A process that froze its objects itself (a server after start-up, to
    make collections cheap) keeps them frozen: gc.unfreeze() would thaw its objects too."""
    frozen_before = gc.get_freeze_count() > 0
    if collect:
        gc.collect(YOUNG)
    was_enabled = gc.isenabled()
    if not frozen_before:
        gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()
        if was_enabled:
            gc.enable()


def device_of(specs: Sequence[ArgSpec]) -> torch.device | None:
    devices = {s.device for s in specs if s.device is not None}
    if len(devices) > 1:
        names = ", ".join(f"{s.name}: {s.device}" for s in specs if s.device is not None)
        raise CaptureError(f"arguments are on several devices ({names}); a graph runs on one device")
    return next(iter(devices), None)


def device_scope(device: torch.device | None):
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def progress(pairs, label: str, show: bool):
    """`pairs` with a progress bar where `show` and the output is a terminal (tqdm's own
    switch, `TQDM_DISABLE=1`, turns it off)."""
    if not show:
        return pairs
    from tqdm.auto import tqdm

    return tqdm(pairs, desc=f"{label}: capturing", unit="graph", leave=False, disable=None)
