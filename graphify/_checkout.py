"""Run in place from a checkout (PYTHONPATH=.), transforms/ and models/ sit beside graphify/
instead of inside it: make them importable as `graphify.transforms` and `graphify.models`,
the names an installed graphify gives them, so examples read the same either way."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("transforms", "models")


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds `graphify.transforms` and `graphify.models` in the checkout's folders."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != "graphify" or name not in SUBPACKAGES:
            return None
        folder = ROOT / name
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def install_if_in_place() -> None:
    """Add the finder (last, after any installed mapping) when graphify runs from a checkout
    whose transforms/ and models/ are not found under graphify's name."""
    if any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        return
    if not all((ROOT / name / "__init__.py").is_file() for name in SUBPACKAGES):
        return  # installed: the folders are graphify's subpackages, or not there at all
    if importlib.util.find_spec("graphify.transforms") is None:
        sys.meta_path.append(CheckoutFinder())
