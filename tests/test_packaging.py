"""Installed, graphify is one package: transforms/ and models/ live under graphify's name
(no top-level `transforms` or `models` to clash with a user's own), benchmarks/ is not
installed, and `split` is importable from graphify. A split function keeps the contract
written down in `graphify.extend`."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphify
from graphify.extend import SplitFunction, as_split

ROOT = Path(__file__).resolve().parent.parent


def test_split_comes_from_graphify_transforms_and_keeps_the_contract():
    from graphify.transforms import SplitError, split

    assert issubclass(SplitError, Exception)

    def step(x, w):
        return torch.relu(x @ w)

    pw = split(step, [torch.ops.aten.relu.default], torch.randn(4, 8), torch.randn(8, 8),
               axes=(graphify.tokens(), graphify.persistent()))
    assert isinstance(pw, SplitFunction) and as_split(pw) is pw
    assert as_split(step) is None and not isinstance(step, SplitFunction)
    with pytest.raises(AttributeError, match="has no attribute 'split'"):
        graphify.split  # noqa: B018 - the core names no adapter


def test_the_public_surface_is_what_users_and_extension_writers_call():
    """`graphify.__all__` holds the transform, its options and errors, axes, sizes and the
    pure dispatch users test; internals (tables, dispatchers, entries) are not in it."""
    for internal in ("Dispatcher", "GraphTable", "Entry", "plan_keys", "weakest", "ArgSpec", "StatsRow"):
        assert internal not in graphify.__all__
    for public in ("graphify", "Graphified", "Options", "Limits", "tokens", "persistent", "dispatch", "KeySet",
                   "CaptureError", "vllm_sizes"):
        assert public in graphify.__all__
    assert all(hasattr(graphify, name) for name in graphify.__all__)


def test_the_adapters_are_declared_as_entry_points_and_found_by_the_core():
    from graphify.base import plugins
    from graphify.compile import rewrites

    assert set(plugins.declared(plugins.REWRITES)) == {"fold_gqa", "gemv"}
    assert rewrites.registered()["fold_gqa"].default and not rewrites.registered()["gemv"].default
    assert "transformers" in plugins.declared(plugins.ADAPTERS)


def test_the_project_installs_transforms_and_models_under_graphify_and_not_benchmarks():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"graphify": "graphify", "graphify.transforms": "transforms",
                                         "graphify.models": "models"}
    packages = set(setuptools["packages"])
    assert {"graphify.transforms", "graphify.models", "graphify.capture", "graphify.backends"} <= packages
    assert not any(p.split(".")[0] in ("transforms", "models", "benchmarks") for p in packages)
    on_disk = {p.parent.relative_to(ROOT).as_posix().replace("/", ".") for p in (ROOT / "graphify").rglob("__init__.py")}
    assert on_disk <= packages  # every subpackage of graphify/ is listed


def test_an_installed_graphify_has_no_top_level_transforms_models_or_benchmarks(tmp_path):
    try:
        importlib.metadata.distribution("graphify")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("graphify is not installed (pip install -e .): run in place")
    code = (
        "import importlib, importlib.util as u\n"
        "print([n for n in ('transforms', 'models', 'benchmarks') if u.find_spec(n) is not None])\n"
        "print(importlib.import_module('graphify.transforms.split').__name__, importlib.import_module('graphify.models').__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["[]", "graphify.transforms.split graphify.models"]


def test_a_checkout_on_the_path_takes_transforms_and_models_from_its_editable_install(tmp_path):
    """PYTHONPATH=<checkout> (the GPU scripts run so) imports graphify from the checkout;
    `pip install -e .` maps graphify.transforms and graphify.models to the folders beside it."""
    import importlib.util

    spec = importlib.util.find_spec("graphify.transforms")
    if spec is None or Path(spec.origin) != ROOT / "transforms" / "__init__.py":
        pytest.skip("this checkout is not installed editable (pip install -e .)")
    code = "import graphify, graphify.transforms.hf, graphify.models\n" \
           "print(graphify.__file__, graphify.transforms.__file__, graphify.models.__file__)\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(ROOT / "graphify" / "__init__.py"), str(ROOT / "transforms" / "__init__.py"),
                                  str(ROOT / "models" / "__init__.py")]


def test_import_graphify_loads_no_compiler():
    """`import graphify` imports torch and graphify's own modules, not dynamo, inductor, Triton
    or transformers: those load when a compile or an adapter is first asked for."""
    code = ("import sys, graphify\n"
            "print([m for m in ('torch._dynamo', 'torch._inductor', 'triton', 'transformers', 'sympy') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
