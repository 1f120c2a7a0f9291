"""`Limits`: the bounds a user may reasonably tune, in one place (`Options(limits=...)`).

Each bounds what graphify holds or records for one graphified function; past it, calls run
eagerly (logged or warned once), never wrongly. Other bounds are named constants of the
module whose policy they are, each with a line on why its value.
"""

from __future__ import annotations

import attrs

__all__ = ["Limits"]


def _positive(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Limits: {attribute.name} must be a positive int, got {value!r}")


def _ratio(instance, attribute, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1):
        raise ValueError(f"Limits: padding_ratio must be >= 1 (a padded size over the real one; 1 means exact "
                         f"sizes only), got {value!r}")


def _bound(default: int):
    return attrs.field(default=default, validator=_positive)


@attrs.frozen
class Limits:
    """**Arguments:**
    - `structures` (8): call structures first use keeps graphs for (which arguments, their
      non-batch shapes, static objects); calls of others run eagerly, but a new cache of a
      kind with graphs takes the place of the kind's least recently used.
    - `graphs_per_structure` (64): graphs first use captures for one structure without
      `sizes=` (each batch size its own, unpadded); other sizes run eagerly.
    - `exact_max_tokens` (512): the largest batch first use captures unpadded, without `sizes=`.
    - `branches` (8): branches of a registered type's Python state (a sliding window:
      filling, full, rolling) a structure captures graphs for.
    - `walk_items` (4,096), `walk_edges` (200,000), `walk_depth` (100): how much Python
      state the walk of what a call reads records (items in one container, edges in all,
      nesting). A function that reaches more is not captured: a change past the limit
      would go unseen before a replay.
    - `padding_ratio` (None): run a batch eagerly rather than pad it beyond this factor (a
      padded size over the real one; 1: exact sizes only). None: pad to any captured size.
    """

    structures: int = _bound(8)
    graphs_per_structure: int = _bound(64)
    exact_max_tokens: int = _bound(512)
    branches: int = _bound(8)
    walk_items: int = _bound(4096)
    walk_edges: int = _bound(200_000)
    walk_depth: int = _bound(100)
    padding_ratio: float | None = attrs.field(default=None, validator=_ratio)
