"""What a session's function reaches beyond its static objects, and the check that watches it.

Each capture walks the function deeply (`graphify._reach`, `deep=True`): its modules, the
globals, closures and classes of the code that ran, the global hook dicts. The runs of a
capture are recorded (`graphify._ran`), and code that ran for the first time is walked
after them, so the per-call check (`graphify._watch.Watch`) covers what every call that
captured read. Where nothing recorded moved and no new code ran, the last walk serves again.
"""

from __future__ import annotations

from operator import is_

from .._ran import CodeRan
from .._reach import Reach
from .._roots import global_hook_dicts
from .._watch import Watch

__all__ = ["FunctionReads"]


class FunctionReads:
    """The deep walk and per-call check of one session's function."""

    def __init__(self, label: str, roots: dict, effects: bool):
        self.label = label
        self.roots = roots  # what the walk starts from (the function; a split function's module)
        self.effects = effects  # its plain values are side effects (`Options.side_effects`)
        self.ran = CodeRan()  # the Python code its captures' runs executed
        self.watch: Watch | None = None

    def walk(self, shallow: Reach, objects: dict) -> Reach:
        """The deep walk for a capture over `objects` (whose shallow walk is `shallow`): the
        function, the modules, code and classes the static objects hold (`handoff`), the
        global hook dicts. The last one, where nothing it recorded changed since."""
        roots = {**self.roots, **{f"static {path}": obj for path, obj in shallow.handoff}, **global_hook_dicts()}
        watch = self.watch
        if watch is not None and watch.reach.roots.keys() == roots.keys() \
                and all(map(is_, watch.reach.roots.values(), roots.values())) \
                and watch.reach.ran_count == len(self.ran) and watch.unchanged():
            return watch.reach
        deep = Reach.walk(roots, deep=True, lengths=not self.effects, plains_are_effects=self.effects,
                          skip=tuple(objects.values()), ran=self.ran)
        deep.roots, deep.ran_count = roots, len(self.ran)
        return deep

    def after(self, ran: CodeRan, shallow: Reach, objects: dict) -> Reach | None:
        """After a capture's runs (`ran`): the walk again if code ran that no capture ran
        before (what it reads is read from now on), else None."""
        if not self.ran.new_in(ran):
            return None
        self.ran.update(ran)
        return self.walk(shallow, objects)

    def watching(self, deep: Reach) -> Watch:
        """The per-call check of `deep` (the one already made, where it is that walk's)."""
        if self.watch is None or self.watch.reach is not deep:
            self.watch = Watch(self.label, deep)
        return self.watch
