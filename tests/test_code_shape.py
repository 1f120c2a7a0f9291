"""The package's shape, measured: small classes, short functions, short files, and no module
of `graphify/` that imports one that imports it back, at the top of a file or inside a
function (the layers are `test_layers.py`'s).

Limits for `graphify/`: a class holds at most 15 fields (attrs fields and names assigned on
`self`), a function spans at most 60 lines and takes at most 8 parameters (`self` and `cls`
not counted), a file has at most 400 lines.
"""

from __future__ import annotations

import ast
import pathlib

from test_layers import imported, module_name


ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "graphify"
MAX_FIELDS, MAX_LINES, MAX_PARAMS, MAX_FILE_LINES = 15, 60, 8, 400

def _files():
    return sorted(PACKAGE.rglob("*.py"))


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    first = (a.posonlyargs + a.args)[:1]
    return count - (1 if first and first[0].arg in ("self", "cls") else 0)


def _fields(cls: ast.ClassDef) -> set[str]:
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    names.discard("__slots__")
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def shape_violations(files=None) -> list[str]:
    """Every class, function and file of `files` (default: graphify/) over its limit."""
    out = []
    for path in files if files is not None else _files():
        source = path.read_text()
        name = path.relative_to(ROOT)
        if len(source.splitlines()) > MAX_FILE_LINES:
            out.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES or _params(node) > MAX_PARAMS:
                    out.append(f"{name}:{node.lineno} {node.name}: {lines} lines, {_params(node)} parameters")
            elif isinstance(node, ast.ClassDef) and len(_fields(node)) > MAX_FIELDS:
                out.append(f"{name}:{node.lineno} {node.name}: {len(_fields(node))} fields")
    return out


def imports() -> dict[str, set[str]]:
    """{module: graphify modules it imports}, wherever in the file the import is."""
    modules = {module_name(p): p for p in _files()}
    return {name: {m for m in imported(path) if m in modules and m != name} for name, path in modules.items()}


def _reaches(graph: dict, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_graphify_stays_within_its_size_limits():
    assert shape_violations() == []


def test_the_limits_catch_what_they_measure(tmp_path):
    wide = "def f(" + ", ".join(f"a{i}" for i in range(9)) + "):\n    pass\n"
    long = "def g():\n" + "    x = 1\n" * 61
    big = "class C:\n    def __init__(self):\n" + "".join(f"        self.f{i} = {i}\n" for i in range(16))
    for text, what in ((wide, "9 parameters"), (long, "62 lines"), (big, "16 fields"), ("x = 1\n" * 401, "401 lines")):
        path = PACKAGE / "_shape_probe.py"  # inside the package, so names resolve as for real files
        path.write_text(text)
        try:
            found = shape_violations([path])
        finally:
            path.unlink()
        assert any(what in v for v in found), (what, found)


def test_no_module_imports_one_that_imports_it_back():
    graph = imports()
    cycles = sorted(m for m in graph if m in _reaches(graph, m))
    assert cycles == []
