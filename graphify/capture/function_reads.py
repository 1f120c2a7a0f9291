"""What a session's function reaches beyond its static objects, and the check that watches it.

Each capture walks the function deeply (`graphify.reads.reach`, `deep=True`): its modules, the
globals, closures and classes of the code that ran, the global hook dicts. The runs of a
capture are recorded (`graphify.reads.code_ran`), and code that ran for the first time is walked
after them, so the per-call check (`graphify.reads.watch.Watch`) covers what every call that
captured read. Where nothing recorded moved and no new code ran, the last walk serves again.
"""

from __future__ import annotations

import threading
from operator import is_

from graphify.capture.spec import FunctionSpec
from graphify.base.call_layout import fn_name, module_of
from graphify.reads.code_ran import CodeRan
from graphify.reads.reach import Reach
from graphify.reads.code_names import global_hook_dicts
from graphify.reads.stateful_types import adapters_of_imported
from graphify.reads.watch import Watch

__all__ = ["FunctionReads"]


class FunctionReads:
    """The deep walk and per-call check of one callable's function, shared by its sessions
    (each structure of first use captures in a session of its own: a new cache, a new
    length), so a walk serves every capture until something it recorded moves."""

    def __init__(self, label: str, roots: dict, effects: bool, limits=None):
        self.label, self.limits = label, limits  # (`Limits`: how much a walk records)
        self.roots = roots  # what the walk starts from (the function; a split function's module)
        self.effects = effects  # its plain values are side effects (`Options.side_effects`)
        self.ran = CodeRan()  # the Python code its captures' runs executed
        self.watch: Watch | None = None
        self.walked: tuple = (None, {}, 0)  # the last deep walk, its roots, and how much code had run then
        self.lock = threading.Lock()

    @classmethod
    def for_spec(cls, spec: FunctionSpec) -> "FunctionReads":
        """For the function `spec` describes: the walk starts from the function (for a split
        function, whose pieces baked in what its closure held, from its module alone)."""
        if spec.split is None:
            roots = {fn_name(spec.fn): spec.fn}
        else:
            module = module_of(spec.fn)
            roots = {} if module is None else {type(module).__name__: module}
        return cls(spec.label, roots, spec.options.side_effects == "at_capture", spec.options.limits)

    def walk(self, shallow: Reach, objects: dict) -> Reach:
        """The deep walk for a capture over `objects` (whose shallow walk is `shallow`): the
        function, the modules, code and classes the static objects hold (`handoff`), the
        global hook dicts. The last one, where nothing it recorded changed since."""
        roots = {**self.roots, **{f"static {path}": obj for path, obj in shallow.handoff}, **global_hook_dicts()}
        adapters_of_imported()  # a library's capture contexts, wherever its modules sit (a closure, `self`)
        with self.lock:
            return self._walk(roots, objects)

    def _walk(self, roots: dict, objects: dict) -> Reach:
        watch, (last, last_roots, ran_then) = self.watch, self.walked
        if watch is not None and watch.reach is last and last_roots.keys() == roots.keys() \
                and all(map(is_, last_roots.values(), roots.values())) and ran_then == len(self.ran) \
                and (watch.unchanged() or watch.verify() is None):  # (nothing it recorded changed, or nothing read)
            return last
        # static objects are their shallow walk's, but those it handed off (a model passed in) are
        # walked here like a model reached any other way
        handed = {id(obj) for obj in roots.values()}
        skip = tuple(obj for obj in objects.values() if id(obj) not in handed)
        deep = Reach.walk(roots, deep=True, lengths=not self.effects, plains_are_effects=self.effects,
                          skip=skip, ran=self.ran, limits=self.limits)
        self.walked = (deep, roots, len(self.ran))
        return deep

    def after(self, ran: CodeRan, deep: Reach) -> None:
        """After a capture's runs (`ran`): if code ran that no capture ran before, what it
        reads joins `deep` (the walk goes on from where it stopped)."""
        with self.lock:
            if not self.ran.new_in(ran):
                return
            self.ran.update(ran)
            deep.extend(self.ran)
            if self.walked[0] is deep:
                self.walked = (deep, self.walked[1], len(self.ran))
            if self.watch is not None and self.watch.reach is deep:
                self.watch = None  # made again over the edges added

    def watching(self, deep: Reach) -> Watch:
        """The per-call check of `deep`: the one kept for the last walk where `deep` is it,
        else a new one (a session whose walk another session's walk has since replaced)."""
        with self.lock:
            if self.watch is not None and self.watch.reach is deep:
                return self.watch
            watch = Watch(self.label, deep)
            if deep is self.walked[0]:
                self.watch = watch
            return watch
