"""Room for one more call structure of a kind that has graphs, once the bound is reached.

transformers makes a new cache every `generate()`; when the caller keeps the old ones (the
outputs of `return_dict_in_generate=True` hold their caches), no new cache can take over an
old one's memory, so each call opens a structure of its own. Past the bound of structures,
the kind's least recently used one is released to make room, instead of every later call
running eagerly. Calls that come back to objects whose structure went so (calls cycling over
more objects than the bound) would capture every time: after `MAX_RETURNS` such calls a kind
makes no more room, and the bound holds.
"""

from __future__ import annotations

import logging

__all__ = ["Room", "MAX_RETURNS", "REMEMBERED"]

MAX_RETURNS = 4  # objects of structures released to make room, met again, before a kind stops making room
REMEMBERED = 64  # the objects of such structures remembered (weakly), to tell a return

log = logging.getLogger("graphify")


class Room:
    """What made room so far: the released structures' objects (weakly) and, per kind,
    the calls that came back to them."""

    def __init__(self):
        self.released: list = []  # WeakStatic
        self.returns: dict = {}  # family -> calls whose objects were such

    def oldest_of(self, structures: list, family: tuple, objects: dict):
        """The structure to release for a call of `family` over new `objects` (structures:
        most recently used first), or None: none of the kind holds its objects weakly (none
        to tell a return by), or the kind came back `MAX_RETURNS` times already."""
        if not objects:
            return None
        if any(w() is o for w in self.released for o in objects.values()):
            returns = self.returns[family] = self.returns.get(family, 0) + 1
            if returns > MAX_RETURNS:
                return None
        oldest = next((s for s in reversed(structures) if s.family == family and s.capture.statics()), None)
        if oldest is not None:
            self.released = ([w for w in oldest.capture.statics() if w() is not None] +
                             [w for w in self.released if w() is not None])[:REMEMBERED]
        return oldest

    def make(self, structures: list, family: tuple, objects: dict, label: str) -> bool:
        """For a call of a kind that has graphs, over new `objects`: release the kind's least
        recently used structure (`oldest_of`) out of `structures` (their lock held); False where
        none goes."""
        oldest = self.oldest_of(structures, family, objects)
        if oldest is None:
            return False
        log.debug("%s: %d call structures have graphs; the least recently used of this kind made room",
                  label, len(structures))
        structures.remove(oldest)
        oldest.release()
        return True
