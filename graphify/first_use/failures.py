"""What first use (`graphify.first_use.first_use`) does with a capture that failed.

- Python state the call sets up itself (a cache layer made on its first use, met by the
  capture a *kin* structure makes at once; on a GPU that layer's counter moves to the device,
  a tensor replaced): this call runs eagerly and makes it, and the next call captures. Once
  a (mode, key) of a branch, and at most `MAX_RETRIES` times in a row for a kind of call,
  so objects each called once do not cost a failed capture apiece.
- A tensor replaced on every call (a DynamicCache's torch.cat) is raised, for first use to
  run such calls eagerly from then on.
- The user's profiler and tracer hold both of Python's call hooks (`HooksHeldError`): this call
  runs eagerly, with one warning, and a later call captures once they let go.
- Anything else (an op that reads a device value on the host, ...): that graph is not tried
  again, its calls run eagerly, with one warning per kind of failure; under a compile in the
  background, until that compile is made (its graphs are tried then).
- `Options(first_use="strict")` raises every failure.
"""

from __future__ import annotations

import warnings

from graphify.base.errors import CaptureError, HooksHeldError, StateReplacedError

__all__ = ["CaptureFailures", "MAX_RETRIES"]

MAX_RETRIES = 3  # retries in a row for a kind of call, with no capture between


class CaptureFailures:
    """The failures of one `FirstUse`; `warned` is its set of once-only warnings."""

    def __init__(self, strict: bool, warned: set):
        self.strict, self.warned = strict, warned
        self.retries: dict = {}  # family -> captures retried in a row

    def after(self, exc: CaptureError, family, branch, pair, kin: bool, job=None) -> None:
        """Return where the call runs eagerly; raise what first use must handle above. `job`:
        the capture's compile in the background, if any. Where the function as written failed
        before that compile was made, the compile is sent anyway (it may capture where the
        function as written cannot: a host copy inductor folds away) and tried once made."""
        awaits = job is not None and getattr(exc, "graphify_plain_first", False) and not isinstance(exc, StateReplacedError)
        if awaits:
            branch.waiting.setdefault(pair, job.send())
        if self.strict:
            raise exc
        replaced = getattr(exc, "replaced", False)
        if isinstance(exc, StateReplacedError) and (kin or not replaced) and self._retry(family, branch, pair):
            return
        if replaced:
            raise exc
        if isinstance(exc, HooksHeldError):  # the user's tools hold both hooks for now: the next call tries again
            self._warn(exc, "this call runs eagerly, and the next call needing the graph captures it where it can")
            return
        branch.uncapturable.add(pair)
        until = (" until the compile in the background is made, whose graphs are tried then" if awaits else "")
        self._warn(exc, f"this call, and calls needing the same graph, run eagerly{until}; other calls keep their graphs")

    def _warn(self, exc: CaptureError, what_runs: str) -> None:
        """One warning per kind of failure."""
        what = f"cannot capture: {type(exc).__name__}"
        if what not in self.warned:
            self.warned.add(what)
            warnings.warn(f"{exc}\n({what_runs}. Options(first_use='strict') raises instead.)", stacklevel=8)

    def captured(self, family) -> None:
        self.retries.pop(family, None)

    def _retry(self, family, branch, pair) -> bool:
        tries = self.retries.get(family, 0)
        if pair in branch.changed_once or tries >= MAX_RETRIES:
            return False
        branch.changed_once.add(pair)
        self.retries[family] = tries + 1
        return True
