"""A sequence axis padded to a few lengths, for models whose adapter says they allow it.

An encoder is sent batches of every length a request has (8, 13, 200, 511 tokens): a graph per
length would be a capture for nearly every call. Where padding the sequence leaves the real
positions' outputs as they were (a bidirectional encoder that masks padded keys), first use
pads each call's sequence to the next of a few lengths (`bucket`), so a handful of graphs
serve every length, and cuts the outputs back. graphify cannot know which models allow it;
an adapter registers a `SequencePadding` for the models it knows (`register_sequence_padding`),
and the first padded call of each graphified function is compared with the model run as
called (`graphify.graphified.padded_calls`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["BUCKETS", "bucket", "SequencePadding", "register_sequence_padding", "sequence_padding_for"]

# Lengths a sequence is padded to, doubling: 8-512 tokens take 6 call structures, within first
# use's default bound of 8 (`Limits.structures`: each holds a pool of its own), at the cost of
# at most twice a call's tokens (a third more on average over uniform lengths). With 1.5x steps
# the same range took 11, and past the bound every call of the last three ran eagerly.
BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def bucket(length: int, cap: int) -> int | None:
    """The length a sequence of `length` is padded to: the smallest bucket at least as long,
    or `cap` (the model's longest) where that is shorter; None past `cap`. Pure.

    !!! example
        >>> bucket(13, 512), bucket(200, 512), bucket(500, 512), bucket(600, 512), bucket(300, 314)
        (16, 256, 512, None, 314)
    """
    if length > cap:
        return None
    return min([b for b in BUCKETS if b >= length] + [cap])


@attrs.frozen
class SequencePadding:
    """How to pad one model's calls: `length(call)` the sequence length of a call (its
    arguments by name; None: a call not to pad), `pad(call, to)` the call padded to `to`,
    `cut(out, length, to)` the outputs of a call padded to `to` cut back to `length`, `cap`
    the longest sequence, `name` what the messages call the model."""

    name: str
    length: Callable[[dict], "int | None"]
    pad: Callable[[dict, int], dict]
    cut: Callable[[Any, int, int], Any]
    cap: int


_FINDERS: list[Callable[[Any], "SequencePadding | None"]] = []


def register_sequence_padding(find: Callable[[Any], "SequencePadding | None"]) -> None:
    """Register `find(model)`: the `SequencePadding` of a model it knows, else None."""
    if find not in _FINDERS:
        _FINDERS.append(find)


def sequence_padding_for(model: Any) -> SequencePadding | None:
    """The first registered padding for `model`, or None."""
    if model is None:
        return None
    for find in _FINDERS:
        found = find(model)
        if found is not None:
            return found
    return None
