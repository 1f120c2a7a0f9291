"""graphify's layers, kept: a module imports only its own layer and the layers below it,
at the top of a file or inside a function, and the core never imports its adapters.

The layers, bottom first, are the packages of `graphify/` (`LAYERS`); `graphify/__init__.py`
and `extend.py` sit on top, the public faces. The adapters (`graphify.transforms`,
`graphify.models`: transformers' cache types, graph rewrites, reference models) build on the
core and register with it through `graphify.extend` and the entry points in pyproject.toml;
the core names none of them. Imports are read from the source (`ast`), lazy ones included,
and relative ones resolved.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "graphify"
# bottom first: each may import itself and what is below it
LAYERS = ("base", "distributed", "reads", "plan", "backends", "compile", "capture", "call", "first_use", "graphified")
FACES = ("graphify", "graphify.extend")  # the top: may import any layer
ADAPTERS = ("graphify.transforms", "graphify.models", "transforms", "models")


_MODULE_NAME = re.compile(r"^(graphify\.)?(transforms|models)(\.\w+)*$|^graphify(\.\w+)+$")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: pathlib.Path) -> set[str]:
    """Every module name `path` imports, anywhere in the file (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_NAME.match(node.value):
            found.add(node.value)  # a module named in a string: `importlib.import_module("...")`, a table of them
    return found


def layer_of(module: str) -> int | None:
    """The index of `module`'s layer in `LAYERS`; len(LAYERS) for the faces; None outside the core."""
    if module in FACES:
        return len(LAYERS)
    parts = module.split(".")
    if parts[0] != "graphify" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def violations(files) -> list[str]:
    """Imports of a higher layer, and of an adapter, by the core modules in `files`."""
    out = []
    for path in files:
        name = module_name(path)
        own = layer_of(name)
        if own is None:
            continue
        for target in sorted(imported(path)):
            if any(target == a or target.startswith(a + ".") for a in ADAPTERS):
                out.append(f"{name} imports the adapter {target}")
                continue
            theirs = layer_of(target)
            if theirs is not None and theirs > own:
                out.append(f"{name} ({LAYERS[own] if own < len(LAYERS) else 'face'}) imports {target} "
                           f"({LAYERS[theirs] if theirs < len(LAYERS) else 'face'}), a layer above it")
    return out


def core_files():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_root_holds_the_layers_and_the_faces_alone():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and not p.name.endswith(".so"))
    assert entries == sorted(["__init__.py", "extend.py", *LAYERS]), entries
    assert len(entries) <= 12


def test_every_core_module_belongs_to_a_layer():
    assert [module_name(p) for p in core_files() if layer_of(module_name(p)) is None] == []


def test_no_module_imports_a_layer_above_it_or_an_adapter():
    assert violations(core_files()) == []


@pytest.mark.parametrize("probe, what", [
    ("from graphify.first_use.first_use import FirstUse\n", "a layer above it"),
    ("def f():\n    from graphify.graphified import callable\n", "a layer above it"),
    ("def f():\n    import importlib\n    importlib.import_module('graphify.transforms.hf')\n", "the adapter"),
    ("from ..capture import spec\n", "a layer above it"),
])
def test_the_contract_catches_an_upward_import_lazy_or_not(probe, what):
    path = PACKAGE / "plan" / "_layer_probe.py"
    path.write_text(probe)
    try:
        found = violations([path])
    finally:
        path.unlink()
    assert any(what in v for v in found), found


def test_the_adapters_build_on_the_public_names_and_extend_alone():
    """transforms/ and models/ import graphify's faces (`graphify`, `graphify.extend`) and each
    other, never a core package: what they need of the core is written down in `extend`."""
    found = []
    for folder in ("transforms", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for target in sorted(imported(path)):
                core = layer_of(target)
                if core is not None and core < len(LAYERS):
                    found.append(f"{path.relative_to(ROOT)} imports {target}")
    assert found == []
