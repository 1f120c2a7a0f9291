"""The changes research code makes to Python state between calls, as data for `test_watch.py`.

Each `Case` builds a world on a device: the function to graphify (called as `call(fn, x)`),
and a `change` to make between calls. Worlds are built twice from one seed, one graphified
and one run eagerly, and every change is made to both, so the eager answer is what the
graphified call must give. `where` is a pattern the error of a captured callable must name.
Controls change tensors in place: their graphs must keep replaying.
"""

from __future__ import annotations

import functools
import itertools
import sys
import types
from collections.abc import Callable

import attrs
import torch
import torch.nn.utils.parametrize
import torch.nn.utils.prune

D = 8  # features


@attrs.frozen
class Case:
    name: str
    build: Callable  # device -> World
    where: str = ""  # a pattern the StateChangedError of a captured callable names
    replays_after: bool = True  # calls go back to graphs after the change
    too_large: bool = False  # what the function reaches is more than a walk records: never captured
    seeded: bool = False  # the function draws random numbers: both worlds are seeded alike per call


@attrs.define
class World:
    fn: Callable
    change: Callable[[], None]
    call: Callable = lambda f, x: f(x)
    axes: tuple | None = None
    cleanup: Callable[[], None] = lambda: None


def mlp(device, act: torch.nn.Module | None = None) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(D, D), act or torch.nn.ReLU(), torch.nn.Linear(D, D)).to(device).eval()


def reload(m: torch.nn.Module) -> None:
    """`load_state_dict(..., assign=True)` with new values: new Parameters, new storage."""
    m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()}, assign=True)


_modules = itertools.count()


def namespace(source: str, **values) -> dict:
    """A module's globals: `source` executed in a fresh module holding `values` (registered
    in sys.modules, as torch.compile imports a function's module by name)."""
    module = types.ModuleType(f"watch_case_globals_{next(_modules)}")
    sys.modules[module.__name__] = module
    ns = module.__dict__
    ns.update(torch=torch, **values)
    exec(source, ns)  # noqa: S102 - test code
    return ns


class Runner:
    """A plain object whose bound method is graphified (`graphify(runner.step)`)."""

    def __init__(self, model):
        self.model = model

    def step(self, x):
        return self.model(x)


class Holder:
    def __init__(self, model):
        self.model = model


class Scaled(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.body = mlp(device)
        self.scale = 2.0
        self.shift = torch.randn(D, device=device)  # a plain tensor attribute (not a buffer)
        self.blocks = [torch.nn.Linear(D, D).to(device)]  # modules in a plain list
        self.named = {"out": torch.nn.Linear(D, D).to(device)}  # and in a plain dict
        self.register_buffer("offset", torch.randn(D, device=device))

    def forward(self, x):
        y = self.body(x) * self.scale + self.shift + self.offset
        for block in self.blocks:
            y = block(y)
        return self.named["out"](y)


class Mixed(torch.nn.Module):
    """A square buffer the forward multiplies by: a transpose over the same storage changes its answer."""

    def __init__(self, device):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)
        self.register_buffer("mix", torch.randn(D, D))
        self.to(device)

    def forward(self, x):
        return self.lin(x) @ self.mix


def _apply(model, x):
    return model(x)


def _module_world(device, change) -> World:
    model = Scaled(device).eval()
    return World(model, lambda: change(model))


def _closure(device, change) -> World:
    model = mlp(device)

    def step(x):
        return model(x)

    return World(step, lambda: change(model))


def _steering(device, rebind: bool) -> World:
    model = mlp(device)
    vec = torch.randn(D, device=device)
    state = {"vec": torch.randn(D, device=device)}

    def hook(module, args, out):
        return out + (vec if rebind else state["vec"])

    model[0].register_forward_hook(hook)

    def change():
        nonlocal vec
        if rebind:
            vec = torch.randn(D, device=device)
        else:
            state["vec"] = torch.randn(D, device=device)

    return World(model, change)


def _global_hook(device) -> World:
    model = mlp(device)
    handles = []

    def change():
        handles.append(torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out: out * 1.5 if isinstance(m, torch.nn.Linear) else out))

    return World(model, change, cleanup=lambda: [h.remove() for h in handles])


def _hook_removed(device) -> World:
    model = mlp(device)
    handle = model[0].register_forward_hook(lambda m, args, out: out * 2)
    return World(model, handle.remove)


def _list_argument(device) -> World:
    mods = [mlp(device)]

    def step(x, mods):
        return mods[0](x)

    return World(step, lambda: reload(mods[0]), call=lambda f, x: f(x, mods))


def _module_argument(device, change, how: str = "positional", model=None) -> World:
    """A model passed *in*: positionally, by keyword, or bound by keyword in a partial."""
    model = model if model is not None else mlp(device)
    if how == "positional":
        return World(lambda x, model: model(x), lambda: change(model), call=lambda f, x: f(x, model))
    if how == "keyword":
        def step(x, *, model):
            return model(x)

        return World(step, lambda: change(model), call=lambda f, x: f(x, model=model))
    return World(functools.partial(_apply_keyword, model=model), lambda: change(model))


def _apply_keyword(x, *, model):
    return model(x)


def _restride(p) -> None:
    """New strides over the same storage: `p.data = p.data.t()` (same data pointer)."""
    p.data = p.data.t()


def _static_attribute(device) -> World:
    holder = Holder(mlp(device))

    def step(x, holder):
        return holder.model(x)

    return World(step, lambda: reload(holder.model), call=lambda f, x: f(x, holder))


def _globals(device, source: str, change, **values) -> World:
    ns = namespace(source, **values)
    return World(ns["step"], lambda: change(ns))


def _growing(device, as_dict: bool) -> World:
    adapters = {"a": torch.nn.Linear(D, D).to(device)} if as_dict else [torch.nn.Linear(D, D).to(device)]

    def step(x):
        for a in (adapters.values() if as_dict else adapters):
            x = a(x)
        return x

    def change():
        extra = torch.nn.Linear(D, D).to(device)
        if as_dict:
            adapters["b"] = extra
        else:
            adapters.append(extra)

    return World(step, change)


def _long_list(device) -> World:
    scales = [1.0] * 5000

    def step(x):
        return x * scales[4500]

    return World(step, lambda: scales.__setitem__(4500, 2.0))


def _restrided(device) -> World:
    from graphify import persistent, tokens

    state = {"w": torch.randn(D, D, device=device)}

    def step(x, w):
        return x @ w

    return World(step, lambda: state.update(w=state["w"].t()), call=lambda f, x: f(x, state["w"]),
                 axes=(tokens(), persistent()))


def _class_method(device) -> World:
    class Block(torch.nn.Module):  # a class of its own per world: the change stays in it
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(D, D)

        def forward(self, x):
            return self.lin(x)

    model = Block().to(device)
    return World(model, lambda: setattr(Block, "forward", lambda self, x: self.lin(x) * 3))


class _Symmetric(torch.nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


def _helper_defaults(device) -> World:
    model = mlp(device)

    def helper(y, scale=2.0):
        return y * scale

    def step(x):
        return helper(model(x))

    return World(step, lambda: setattr(helper, "__defaults__", (3.0,)))


def _untie(model):
    model[2].weight = torch.nn.Parameter(torch.randn_like(model[2].weight))


def _tied(device, change) -> World:
    model = mlp(device)
    model[2].weight = model[0].weight
    return World(model, lambda: change(model))


def _dropout(device) -> World:
    model = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Dropout(0.5), torch.nn.Linear(D, D)).to(device).eval()
    return World(model, model.train)


def _no_dropout_now(device) -> World:  # a control for the seeded path: eval all along
    model = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Dropout(0.5), torch.nn.Linear(D, D)).to(device).eval()
    return World(model, lambda: None)


def _reregistered(model):
    model.register_buffer("offset", torch.randn_like(model.offset))


CHANGES = [
    # a module reached through the function, reloaded with assign=True (new Parameters)
    Case("closure list, assign=True", lambda d: (lambda mods: World(lambda x: mods[0](x), lambda: reload(mods[0])))(
        [mlp(d)]), r"mods.*_parameters\['(weight|bias)'\]"),
    Case("closure dict, assign=True", lambda d: (lambda mods: World(lambda x: mods["m"](x), lambda: reload(mods["m"])))(
        {"m": mlp(d)}), r"'mods'\['m'\].*_parameters"),
    Case("global dict, assign=True", lambda d: _globals(
        d, "def step(x):\n    return REGISTRY['m'](x)\n", lambda ns: reload(ns["REGISTRY"]["m"]), REGISTRY={"m": mlp(d)}),
        r"REGISTRY.*_parameters"),
    Case("partial, assign=True", lambda d: (lambda m: World(functools.partial(_apply, m), lambda: reload(m)))(mlp(d)),
         r"args\[0\].*_parameters"),
    Case("bound method of a plain object", lambda d: (lambda r: World(r.step, lambda: reload(r.model)))(Runner(mlp(d))),
         r"__self__\.model.*_parameters"),
    Case("list argument, assign=True", _list_argument, r"_parameters"),
    Case("attribute of a static argument", _static_attribute, r"model.*_parameters"),
    # a model passed in: as an argument, by keyword, bound by keyword in a partial
    Case("module argument, assign=True", lambda d: _module_argument(d, reload), r"_parameters\['(weight|bias)'\]"),
    Case("module keyword argument, assign=True", lambda d: _module_argument(d, reload, "keyword"),
         r"_parameters\['(weight|bias)'\]"),
    Case("partial keyword, assign=True", lambda d: _module_argument(d, reload, "partial"),
         r"keywords.*_parameters\['(weight|bias)'\]"),
    Case("module argument, p.data = new", lambda d: _module_argument(
        d, lambda m: setattr(m[0].weight, "data", torch.randn(D, D, device=d))), r"new storage"),
    Case("partial keyword, p.data = new", lambda d: _module_argument(
        d, lambda m: setattr(m[0].weight, "data", torch.randn(D, D, device=d)), "partial"), r"new storage"),
    Case("module argument, float attribute", lambda d: _module_argument(
        d, lambda m: setattr(m, "scale", 3.0), model=Scaled(d).eval()), r"\.scale"),
    Case("module keyword argument, forward hook added", lambda d: _module_argument(
        d, lambda m: m[0].register_forward_hook(lambda mod, args, out: out * 2), "keyword"), r"_forward_hooks"),
    Case("module argument, train()", lambda d: _module_argument(
        d, lambda m: m.train(), model=torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Dropout(0.5)).to(d).eval()),
        r"training", seeded=True),
    Case("module argument, submodule replaced", lambda d: _module_argument(
        d, lambda m: m.__setitem__(0, torch.nn.Linear(D, D).to(d))), r"_modules\['0'\]"),
    # a parameter given new strides over the same storage
    Case("module's parameter restrided", lambda d: (lambda m: World(m, lambda: _restride(m[0].weight)))(mlp(d)),
         r"strides"),
    Case("closure's parameter restrided", lambda d: _closure(d, lambda m: _restride(m[0].weight)), r"strides"),
    Case("buffer restrided", lambda d: (lambda m: World(m, lambda: setattr(m.mix, "data", m.mix.data.t())))(
        Mixed(d).eval()), r"strides"),
    Case("parameter transposed in place (t_)", lambda d: (lambda m: World(m, lambda: m.lin.weight.t_()))(
        Mixed(d).eval()), r"strides"),
    Case("module argument's parameter restrided", lambda d: _module_argument(d, lambda m: _restride(m[0].weight)),
         r"strides"),
    # the storage under a parameter of a model reached through a closure
    Case("p.data = new", lambda d: _closure(d, lambda m: setattr(m[0].weight, "data", torch.randn(D, D, device=d))),
         r"new storage"),
    Case(".to() and back", lambda d: _closure(d, lambda m: m.double().float()), r"new storage|_parameters"),
    Case("set_", lambda d: _closure(d, lambda m: m[0].weight.set_(torch.randn(D, D, device=d))), r"new storage"),
    Case("swap_tensors", lambda d: _closure(d, lambda m: torch.utils.swap_tensors(
        m[0].weight, torch.nn.Parameter(torch.randn(D, D, device=d)))), r"new storage"),
    # modules in plain containers of the graphified module
    Case("plain list attribute, item swapped", lambda d: _module_world(
        d, lambda m: m.blocks.__setitem__(0, torch.nn.Linear(D, D).to(d))), r"blocks\[0\]"),
    Case("plain list attribute, item reloaded", lambda d: _module_world(d, lambda m: reload(m.blocks[0])), r"blocks\[0\]"),
    Case("plain dict attribute, item swapped", lambda d: _module_world(
        d, lambda m: m.named.__setitem__("out", torch.nn.Linear(D, D).to(d))), r"named\['out'\]"),
    # globals
    Case("global name rebound", lambda d: _globals(
        d, "def step(x):\n    return MODEL(x)\n", lambda ns: ns.__setitem__("MODEL", mlp(d)), MODEL=mlp(d)), r"global 'MODEL'"),
    Case("global function monkeypatched", lambda d: _globals(
        d, "def step(x):\n    return act(MODEL(x))\n", lambda ns: ns.__setitem__("act", torch.tanh),
        MODEL=mlp(d), act=torch.relu), r"global 'act'"),
    Case("global float read by a helper", lambda d: _globals(
        d, "def helper(y):\n    return y * SCALE\ndef step(x):\n    return helper(MODEL(x))\n",
        lambda ns: ns.__setitem__("SCALE", 3.0), MODEL=mlp(d), SCALE=2.0), r"global 'SCALE'"),
    Case("global config object's field", lambda d: _globals(
        d, "def step(x):\n    return MODEL(x) * CFG.scale\n", lambda ns: setattr(ns["CFG"], "scale", 3.0),
        MODEL=mlp(d), CFG=types.SimpleNamespace(scale=2.0)), r"'CFG'\.scale"),
    Case("global dict's field", lambda d: _globals(
        d, "def step(x):\n    return MODEL(x) * CFG['scale']\n", lambda ns: ns["CFG"].__setitem__("scale", 3.0),
        MODEL=mlp(d), CFG={"scale": 2.0}), r"'CFG'\['scale'\]"),
    # plain attributes of the graphified module
    Case("module float attribute", lambda d: _module_world(d, lambda m: setattr(m, "scale", 3.0)), r"\.scale"),
    Case("LeakyReLU.negative_slope", lambda d: (lambda m: World(m, lambda: setattr(m[1], "negative_slope", 0.5)))(
        mlp(d, torch.nn.LeakyReLU(0.1))), r"negative_slope"),
    Case("eval() then train() with dropout", _dropout, r"training", seeded=True),
    Case("instance forward replaced", lambda d: (lambda m: World(m, lambda: setattr(m[1], "forward", torch.tanh)))(mlp(d)),
         r"forward"),
    Case("plain tensor attribute replaced", lambda d: _module_world(
        d, lambda m: setattr(m, "shift", torch.randn(D, device=d))), r"\.shift"),
    Case("module class swapped", lambda d: (lambda m: World(m, lambda: setattr(m[1], "__class__", torch.nn.Tanh)))(mlp(d)),
         r"."),
    Case("class method monkeypatched", _class_method, r"Block\.forward"),
    # hooks
    Case("forward hook added", lambda d: (lambda m: World(m, lambda: m[0].register_forward_hook(
        lambda mod, args, out: out * 2)))(mlp(d)), r"_forward_hooks"),
    Case("forward hook removed", _hook_removed, r"_forward_hooks"),
    Case("steering hook, closure tensor rebound", lambda d: _steering(d, rebind=True), r"closure 'vec'"),
    Case("steering hook, state dict entry rebound", lambda d: _steering(d, rebind=False), r"state.*\['vec'\]"),
    Case("global forward hook added", _global_hook, r"_global_forward_hooks"),
    # registrations
    Case("buffer re-registered", lambda d: _module_world(d, _reregistered), r"offset"),
    Case("submodule replaced", lambda d: (lambda m: World(m, lambda: m.__setitem__(0, torch.nn.Linear(D, D).to(d))))(
        mlp(d)), r"_modules\['0'\]"),
    Case("register_parametrization", lambda d: (lambda m: World(
        m, lambda: torch.nn.utils.parametrize.register_parametrization(m[0], "weight", _Symmetric())))(mlp(d)), r"."),
    # pruning's pre-hook sets a new weight tensor on every call: no graph can follow that (its calls run
    # eagerly, warned once); prune.remove() makes it permanent, and graphs come back
    Case("pruning", lambda d: (lambda m: World(m, lambda: torch.nn.utils.prune.l1_unstructured(m[0], "weight", 0.5)))(
        mlp(d)), r"weight", replays_after=False),
    Case("weights tied", lambda d: (lambda m: World(m, lambda: setattr(m[2], "weight", m[0].weight)))(mlp(d)),
         r"_parameters\['weight'\]"),
    Case("weights untied", lambda d: _tied(d, _untie), r"_parameters\['weight'\]"),
    Case("del weight, weight = tensor", lambda d: (lambda m: World(m, lambda: (
        delattr(m[0], "weight"), setattr(m[0], "weight", torch.randn(D, D, device=d)))))(mlp(d)), r"weight"),
    Case("_parameters['weight'] = p", lambda d: (lambda m: World(m, lambda: m[0]._parameters.__setitem__(
        "weight", torch.nn.Parameter(torch.randn(D, D, device=d)))))(mlp(d)), r"_parameters\['weight'\]"),
    # containers the function iterates
    Case("closure list gains an item", lambda d: _growing(d, as_dict=False), r"adapters"),
    Case("closure dict gains an item", lambda d: _growing(d, as_dict=True), r"adapters"),
    Case("closure list past the walk's limit", _long_list, r".", replays_after=False, too_large=True),
    # arguments and code
    Case("persistent argument restrided at the same address", _restrided, r"strides"),
    Case("helper's defaults changed", _helper_defaults, r"."),
]

CONTROLS = [  # in place: the graphs see it, and keep replaying
    Case("copy_ into a weight", lambda d: _closure(d, lambda m: m[0].weight.copy_(torch.randn(D, D, device=d)))),
    Case("load_state_dict without assign", lambda d: _closure(d, lambda m: m.load_state_dict(
        {k: torch.randn_like(v) for k, v in m.state_dict().items()}))),
    Case("optimizer step", lambda d: _closure(d, _sgd_step)),
    Case("steering tensor updated in place", lambda d: _inplace_steering(d)),
    Case("buffer updated in place", lambda d: _module_world(d, lambda m: m.offset.add_(1.0))),
    Case("dropout in eval mode, seeded", _no_dropout_now, seeded=True),
    Case("copy_ into a weight of the model passed in", lambda d: _module_argument(
        d, lambda m: m[0].weight.copy_(torch.randn(D, D, device=d)))),
    Case("load_state_dict without assign, partial keyword", lambda d: _module_argument(d, lambda m: m.load_state_dict(
        {k: torch.randn_like(v) for k, v in m.state_dict().items()}), "partial")),
    Case("optimizer step on the model passed by keyword", lambda d: _module_argument(d, _sgd_step, "keyword")),
]


def _sgd_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch.enable_grad():
        for p in model.parameters():
            p.grad = torch.randn_like(p)
    opt.step()


def _inplace_steering(device) -> World:
    model = mlp(device)
    vec = torch.randn(D, device=device)
    model[0].register_forward_hook(lambda m, args, out: out + vec)
    return World(model, lambda: vec.copy_(torch.randn(D, device=device)))
