"""Calls as users write them: bind positional and keyword arguments to one flat tuple.

graphify checks, pads and replays a flat tuple of argument *slots*. `CallLayout` is made
once, from the function's signature and the example call given to `capture`: one slot per
named parameter (given or defaulted), one per extra positional argument (`*args`) and one
per extra keyword (`**kwargs`) that the example passed. A later call is bound to the same
slots by a precomputed name -> slot map (no `inspect` on the call path), and the function
itself is called back with the arguments as the user wrote them.

An `nn.Module` is bound against its `forward` (the signature of the module object itself
is `(*args, **kwargs)`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from graphify.base.errors import InputMismatchError

__all__ = ["CallLayout", "signature_of", "fn_name"]


def _tree_of(value: Any):
    """The pytree spec of a dict, list or tuple that holds a tensor (its leaves become slots
    of their own); None for anything else."""
    if not isinstance(value, (dict, list, tuple)):
        return None
    leaves, spec = pytree.tree_flatten(value)
    return spec if any(isinstance(x, torch.Tensor) for x in leaves) else None


def _tensor_leaves(values) -> bool:
    """Whether every value is a plain tensor that pytree takes as a leaf."""
    return all(type(v) is torch.Tensor for v in values) and torch.Tensor not in pytree.SUPPORTED_NODES


_POS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_MISSING = inspect.Parameter.empty


def fn_name(fn: Callable) -> str:
    """The name a callable goes by in messages: its `__name__`, else its type's."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def module_of(fn: Callable) -> "torch.nn.Module | None":
    """The nn.Module behind `fn`: the module itself, a torch.compile'd module's original,
    or the owner of a bound `forward`; None for plain functions."""
    target = getattr(fn, "_orig_mod", fn)
    if isinstance(target, torch.nn.Module):
        return target
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def signature_of(fn: Callable) -> inspect.Signature | None:
    """The signature calls are bound against (a module's `forward`); None if unknown."""
    module = module_of(fn)
    target = module.forward if module is not None and module is getattr(fn, "_orig_mod", fn) else fn
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


@attrs.frozen(eq=False)
class CallLayout:
    """Where each argument of a call goes in the flat slot tuple, and back.

    `names` name the slots: parameter names, `args[i]` for extra positional arguments
    and the keyword itself for extra keywords. `plain` layouts (only positional
    parameters, no defaults used, no extras) map a positional call to itself.
    """

    label: str
    names: tuple[str, ...]
    kinds: tuple[str, ...]  # per slot: "pos", "kw" (keyword-only or **kwargs), "var" (*args)
    defaults: tuple[Any, ...]  # per slot: the parameter default, or _MISSING
    index: Mapping[str, int]  # keyword name -> slot
    num_pos: int  # named positional parameters
    num_var: int  # *args slots the example passed
    has_var_kw: bool
    given: frozenset[int]  # slots the example passed a tensor to (may not be left out later)
    plain: bool
    # Per slot: None, or the pytree spec of a container (dict, list, tuple) holding tensors,
    # which then stands for one slot per leaf, so its tensors are padded and checked like
    # any argument (transformers passes per-layer-type attention masks as a dict).
    trees: tuple = ()
    # How the example call passed its arguments: the number given positionally and the
    # keywords in their order. Captures call the function the same way, so a compiled
    # function's guards (which see the calling convention) match the user's own calls.
    example_nargs: int = 0
    example_keywords: tuple[str, ...] = ()
    num_posonly: int = 0  # leading positional-only parameters (never passed by keyword)
    # Worked out once from the above: (`slot_names`, and per slot the keys in order of a
    # container captured as a dict of leaves, else None)
    _derived: tuple = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self):
        dict_keys = tuple(
            list(tree.context) if tree is not None and tree.type is dict
            and tree == pytree.tree_structure(dict.fromkeys(tree.context, 0)) else None
            for tree in self.trees
        )
        object.__setattr__(self, "_derived", (self._slot_names(), dict_keys))

    @classmethod
    def build(cls, label: str, fn: Callable, args: Sequence[Any], kwargs: Mapping[str, Any]) -> "CallLayout":
        sig = signature_of(fn)
        if sig is None:  # a builtin or C callable: positional calls only
            if kwargs:
                raise InputMismatchError(f"{label}: keyword arguments need a function with a signature; pass them positionally")
            n = len(args)
            return cls(label, tuple(f"arg{i}" for i in range(n)), ("pos",) * n, (_MISSING,) * n, {}, n, 0, False,
                       frozenset(i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), True, example_nargs=n)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise InputMismatchError(f"{label}: {exc}") from None
        names, kinds, defaults = [], [], []
        num_var, has_var_kw = 0, False
        params = list(sig.parameters.values())
        for p in params:
            if p.kind in _POS:
                names.append(p.name), kinds.append("pos"), defaults.append(p.default)
        num_pos = len(names)
        for p in params:
            if p.kind is inspect.Parameter.VAR_POSITIONAL:
                num_var = len(bound.arguments.get(p.name, ()))
                for i in range(num_var):
                    names.append(f"{p.name}[{i}]"), kinds.append("var"), defaults.append(_MISSING)
        for p in params:
            if p.kind is inspect.Parameter.KEYWORD_ONLY:
                names.append(p.name), kinds.append("kw"), defaults.append(p.default)
        for p in params:
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                has_var_kw = True
                for key in bound.arguments.get(p.name, {}):
                    names.append(key), kinds.append("kw"), defaults.append(_MISSING)
        index = {n: i for i, (n, k) in enumerate(zip(names, kinds)) if k != "var"}
        layout = cls(label, tuple(names), tuple(kinds), tuple(defaults), index, num_pos, num_var, has_var_kw,
                     frozenset(), False)
        flat = layout._bind_slow(args, kwargs, check_given=False)
        from graphify.base.axes import same_static

        given = frozenset(  # passed, and not as the default: a call may not leave it out
            i for i, a in enumerate(flat)
            if isinstance(a, torch.Tensor) or (defaults[i] is not _MISSING and not same_static(a, defaults[i]))
        )
        trees = tuple(_tree_of(a) for a in flat)
        trees = trees if any(t is not None for t in trees) else ()
        plain = not kwargs and num_var == 0 and len(args) == len(names) and all(k == "pos" for k in kinds) and not trees
        posonly = sum(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in params)
        return attrs.evolve(layout, given=given, plain=plain, trees=trees, example_nargs=len(args),
                            example_keywords=tuple(kwargs), num_posonly=posonly)

    @property
    def slot_names(self) -> tuple[str, ...]:
        """A name per flat slot: the parameter's, or for a container's leaves the parameter
        and the leaf's path (`attention_mask['full_attention']`)."""
        return self._derived[0]

    def _slot_names(self) -> tuple[str, ...]:
        if not self.trees:
            return self.names
        out = []
        for name, tree in zip(self.names, self.trees):
            if tree is None:
                out.append(name)
            else:
                paths = pytree.tree_flatten_with_path(pytree.tree_unflatten([0] * tree.num_leaves, tree))[0]
                out.extend(name + pytree.keystr(path) for path, _ in paths)
        return tuple(out)

    # -- call -> slots --------------------------------------------------------------------
    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple:
        """The slot tuple of a call; an `InputMismatchError` naming the argument if the
        call cannot fill the slots the capture saw."""
        if not kwargs and self.plain and len(args) == len(self.names):
            return tuple(args)
        slots = self._bind_slow(args, kwargs, check_given=True)
        return self._flatten(slots) if self.trees else slots

    def _flatten(self, slots: tuple) -> tuple:
        out: list = []
        for i, (value, tree, keys) in enumerate(zip(slots, self.trees, self._derived[1])):
            if tree is None:
                out.append(value)
                continue
            if keys is not None and type(value) is dict and list(value) == keys and _tensor_leaves(value.values()):
                out.extend(value.values())  # the captured dict's keys in order, tensors: its spec, unflattened
                continue
            leaves, spec = pytree.tree_flatten(value)
            if spec != tree:
                raise InputMismatchError(
                    f"{self.label}: argument {self.names[i]!r} has another structure than at capture "
                    f"({spec} instead of {tree}); pass the same keys and nesting"
                )
            out.extend(leaves)
        return tuple(out)

    def _unflatten(self, flat: tuple) -> list:
        out, j = [], 0
        for tree in self.trees:
            if tree is None:
                out.append(flat[j])
                j += 1
            else:
                out.append(pytree.tree_unflatten(list(flat[j:j + tree.num_leaves]), tree))
                j += tree.num_leaves
        return out

    def _bind_slow(self, args, kwargs, *, check_given: bool) -> tuple:
        out = list(self.defaults)
        filled = [False] * len(out)
        npos, nvar = self.num_pos, self.num_var
        if len(args) > npos + nvar:
            extra = "" if nvar or len(args) <= npos else " (the function takes no *args)"
            raise InputMismatchError(
                f"{self.label}: got {len(args)} positional arguments but the capture bound {npos + nvar}{extra}; "
                "call with the arguments the capture saw, or capture again"
            )
        if nvar and npos <= len(args) < npos + nvar:
            raise InputMismatchError(
                f"{self.label}: got {len(args) - npos} extra positional arguments (*args) but the capture saw {nvar}; "
                "capture again to change their number"
            )
        for i, a in enumerate(args):
            out[i] = a
            filled[i] = True
        for key, value in kwargs.items():
            i = self.index.get(key)
            if i is None:
                if self.has_var_kw:
                    raise InputMismatchError(
                        f"{self.label}: keyword {key!r} was not passed at capture; the graphs were captured without it: "
                        f"capture again with {key}=... in the example call"
                    )
                raise InputMismatchError(
                    f"{self.label}: unexpected keyword {key!r}; parameters are {list(self.index)}"
                )
            if filled[i]:
                raise InputMismatchError(f"{self.label}: got multiple values for argument {key!r}")
            out[i] = value
            filled[i] = True
        for i, value in enumerate(out):
            if value is _MISSING:
                what = "keyword" if self.kinds[i] == "kw" and self.defaults[i] is _MISSING and self.has_var_kw else "argument"
                raise InputMismatchError(
                    f"{self.label}: missing {what} {self.names[i]!r}, which the capture was given; pass it"
                    + (" (static values must equal the captured ones)" if what == "keyword" else "")
                )
            if check_given and not filled[i] and i in self.given:
                raise InputMismatchError(
                    f"{self.label}: argument {self.names[i]!r} was passed at capture but left out of this call "
                    "(its default differs from what the graphs were captured with); pass it"
                )
        return tuple(out)

    # -- slots -> call --------------------------------------------------------------------
    def call_of(self, slots) -> tuple[tuple, dict]:
        """(positional arguments, keywords) the function gets for `slots`, as `caller` calls it."""
        calls = []
        self.caller(lambda *a, **k: calls.append((a, k)))(*slots)
        return calls[0]

    def caller(self, fn: Callable) -> Callable:
        """`fn` taking the slot tuple positionally: itself when the example passed every
        slot positionally, else a wrapper that calls it as the example did (its positional
        arguments, then its keywords in their order, then any other slot whose value is not
        the default, by name), rebuilding containers from their leaves."""
        if self.trees:
            inner = attrs.evolve(self, trees=()).caller(fn)
            unflatten = self._unflatten

            def rebuild(*flat):
                return inner(*unflatten(flat))

            rebuild.__name__ = getattr(fn, "__name__", type(fn).__name__)
            return rebuild
        nargs = self.example_nargs
        if nargs == len(self.names) and all(k == "pos" for k in self.kinds):
            return fn
        keywords = tuple((self.index[n], n) for n in self.example_keywords)
        rest = tuple(
            (i, n, self.defaults[i]) for i, (n, k) in enumerate(zip(self.names, self.kinds))
            if i >= max(nargs, self.num_posonly) and k != "var" and n not in self.example_keywords
        )
        # positional-only parameters past the example's positional arguments (left at their
        # defaults there): given later, they and those before them go positionally
        posonly = tuple((i, self.defaults[i]) for i in range(nargs, self.num_posonly))

        def from_slots(*slots):
            npos = nargs
            for i, default in posonly:
                if slots[i] is not default:
                    npos = i + 1
            kwargs = {n: slots[i] for i, n in keywords}
            for i, n, default in rest:
                if slots[i] is not default:
                    kwargs[n] = slots[i]
            return fn(*slots[:npos], **kwargs)

        from_slots.__name__ = getattr(fn, "__name__", type(fn).__name__)
        return from_slots
