"""How a replay's outputs reach the caller: copies, views, or views that go stale loudly.

A graph writes its outputs into the same static buffers on every replay. `Options(outputs=
"copy")` (the default) hands out a clone of each; "view" hands out the buffers themselves,
valid until the next call. On CUDA builds of torch a view handed out earlier is poisoned
before the next one goes out, so reading it raises instead of showing the newer result
(torch.compile's graphs do the same); CPU builds cannot poison a storage, so there views
are plain.
"""

from __future__ import annotations

import torch

from graphify.base.alias import alias_maker

__all__ = ["HandOut", "hand_out_for"]

_set_storage_msg = getattr(torch._C, "_set_storage_access_error_msg", None)  # CUDA builds of torch


class HandOut:
    """Copies: every call's outputs are the caller's to keep."""

    checked = False  # whether plans need alias makers (`aliases`)

    def __call__(self, plan) -> list:
        """The outputs of a replay of `plan` (a `graphify.call.runtime.Plan`) for the caller."""
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in plan.outputs]

    def aliases(self, outputs: list) -> tuple:
        """(output index, alias maker) per tensor output, for checked views; none here."""
        return ()


class _Views(HandOut):
    """The static output buffers themselves."""

    def __call__(self, plan) -> list:
        return plan.outputs


class _CheckedViews(HandOut):
    """Views on storage objects of their own; the previous call's are poisoned first."""

    checked = True

    def __init__(self, label: str):
        self.handed: list = []
        self.message = (
            f"{label}: this output was overwritten by a later call (Options(outputs='view') hands out the graph's "
            "static output buffers, valid until the next call); clone() what you keep, or use Options(outputs='copy')"
        )

    def __call__(self, plan) -> list:
        for t in self.handed:
            _set_storage_msg(t, self.message)
        out = list(plan.outputs)
        handed = []
        for i, make in plan.aliases:
            handed.append(make())
            out[i] = handed[-1]
        self.handed = handed
        return out

    def aliases(self, outputs: list) -> tuple:
        return tuple((i, alias_maker(t)) for i, t in enumerate(outputs) if isinstance(t, torch.Tensor))


def hand_out_for(label: str, outputs: str, device: torch.device | None) -> HandOut:
    """The hand-out for `Options(outputs=...)` on `device`."""
    if outputs == "copy":
        return HandOut()
    if device is not None and device.type == "cuda" and _set_storage_msg is not None:
        return _CheckedViews(label)
    return _Views()
