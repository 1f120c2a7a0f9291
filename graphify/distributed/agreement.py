"""Before a tensor-parallel call runs: the ranks check that each runs the same graph.

Under `Options(lockstep="graph")` (the default) a FULL graph carries the check itself, so
only PIECEWISE and eager calls run it first, eagerly; under "host" every call all-gathers
its choice on a CPU group first (`graphify.distributed.lockstep.Lockstep`); under "off", nothing.
"""

from __future__ import annotations

from graphify.distributed.lockstep import graph_code
from graphify.base.modes import Mode

__all__ = ["CallAgreement", "agreement_for"]

_MODES = tuple(Mode)


class CallAgreement:
    """The per-call check of one table's `Lockstep`."""

    def __init__(self, lockstep):
        self.lockstep = lockstep
        self.host = lockstep.policy == "host"

    def needed(self, mode: Mode) -> bool:
        """Whether a call in `mode` runs the check before it (a FULL graph under the "graph"
        policy carries it)."""
        return self.host or mode is not Mode.FULL

    def before(self, decision, tokens: int, reqs: int | None) -> None:
        """Agree on the call `decision` makes for a batch of `tokens` and `reqs` rows:
        raise (or stop the ranks) if another rank chose otherwise."""
        key = decision.key
        if key is not None:
            tokens, reqs = key.num_tokens, key.reqs_rows
        choice = (_MODES.index(decision.mode), tokens, -1 if reqs is None else reqs)
        if self.host:
            self.lockstep.agree_call(*choice)
        elif decision.mode is not Mode.FULL:
            self.lockstep.guard(graph_code(*choice))


def agreement_for(lockstep) -> CallAgreement | None:
    """The per-call check for a table's lockstep; None without one or with lockstep "off"."""
    if lockstep is None or lockstep.policy == "off":
        return None
    return CallAgreement(lockstep)
