"""`Options(compile={...})`'s dict, validated by attrs as `Options` is.

Users write the dict (`{"mode": "max-autotune", "gemv": True, "background": True}`);
`CompileOptions.parse` checks it key by key: graphify's own keys (`background`, `whole`,
`deadline_s`), torch.compile's keywords, and graph rewrites by name (any other key whose
value is True or False: `fold_gqa`, `gemv`, or an adapter's; which names exist is known
when a compile runs, `graphify.compile.rewrites`).
"""

from __future__ import annotations

from typing import Any

import attrs
from attrs.validators import deep_mapping, instance_of, optional

__all__ = ["CompileOptions"]


def _seconds(instance, attribute, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(f"Options: compile's 'deadline_s' must be a positive number of seconds, got {value!r}")


def _dynamic(instance, attribute, value):
    if value is not None and not isinstance(value, bool) and value != "auto":
        raise TypeError(f"Options: compile's 'dynamic' must be True, False, None or 'auto', got {value!r}")


def _switch(instance, attribute, value):
    if not isinstance(value, bool):
        raise TypeError(f"Options: compile's {attribute.name!r} must be True or False, got {value!r}")


@attrs.frozen(kw_only=True)
class CompileOptions:
    """**Arguments** (the dict's keys):
    - `background`: compile in a worker process while plain graphs serve.
    - `whole`: a background compile comes back saved whole (default where torch can).
    - `deadline_s`: a background compile running longer stops the worker (default 1200).
    - `backend`, `mode`, `options`, `fullgraph`, `disable`: torch.compile's own keywords.
    - `dynamic`: torch.compile's, or "auto" (default): the first shape static, dynamic shapes
      from the first call at another shape (from the start for a call carrying a cache, and in
      a background worker); a function whose traced call holds 2-D or 3-D convolutions (enough
      of them for inductor to lay them out: a CNN, not a ViT) is compiled per captured shape,
      where inductor's layouts for them need static shapes (`graphify.compile.shape_policy`).
    - `rewrites`: graph rewrites switched on or off by name (in the dict as top-level keys).
    """

    background: bool = attrs.field(default=False, validator=_switch)
    whole: bool | None = attrs.field(default=None, validator=optional(_switch))
    deadline_s: float | None = attrs.field(default=None, validator=_seconds)
    backend: Any = "inductor"
    mode: str | None = attrs.field(default=None, validator=optional(instance_of(str)))
    options: dict | None = attrs.field(default=None, validator=optional(instance_of(dict)))
    dynamic: bool | None | str = attrs.field(default="auto", validator=_dynamic)
    fullgraph: bool = attrs.field(default=False, validator=_switch)
    disable: bool = attrs.field(default=False, validator=_switch)
    rewrites: dict = attrs.field(factory=dict, validator=deep_mapping(instance_of(str), _switch))

    def __attrs_post_init__(self):
        if self.whole is not None and not self.background:
            raise ValueError("Options: compile's 'whole' says how a compile in the background comes back; add "
                             "'background': True")
        if self.deadline_s is not None and not self.background:
            raise ValueError("Options: compile's 'deadline_s' bounds a compile in the background; add 'background': True")

    @classmethod
    def parse(cls, value: dict) -> "CompileOptions":
        """The dict's keys checked; a key neither graphify's nor torch.compile's names a rewrite."""
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"Options: compile's keys must be strings, got {list(value)!r}")
        known = {a.name for a in attrs.fields(cls)} - {"rewrites"}
        rewrites = {k: v for k, v in value.items() if k not in known}
        for name, on in rewrites.items():
            if not isinstance(on, bool):
                raise TypeError(
                    f"Options: compile's {name!r} must be True or False (a graph rewrite switched by name, as "
                    f"fold_gqa and gemv are; the other keys are {sorted(known)}), got {on!r}")
        return cls(**{k: v for k, v in value.items() if k in known}, rewrites=rewrites)
