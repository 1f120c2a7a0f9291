"""The caller's check of a loaded compiled function hashes each code object once a process, and
the thread that loads the function hashes the recorded classes ahead (`prehash_classes`): the
check still sees a method patched afterwards, and equal code from another file."""

from __future__ import annotations

import torch

from graphify.compile import aot_identity as _aot_identity


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.scale(self.lin(x))

    def scale(self, y):
        return y * 2


def recorded(model, x) -> list:
    return _aot_identity.class_namespaces(model.forward, (x,), {})


def test_after_the_loading_thread_hashed_the_classes_the_check_hashes_nothing_again(monkeypatch):
    model, x = Block(), torch.randn(2, 4)
    record = recorded(model, x)
    monkeypatch.setattr(_aot_identity, "_CODE_HASHES", {})
    _aot_identity.prehash_classes(record)
    hashed = []
    real = _aot_identity._code_hash
    monkeypatch.setattr(_aot_identity, "_code_hash", lambda code: hashed.append(code) or real(code))
    assert _aot_identity.class_changes(record, model.forward, (x,), {}) == []
    assert hashed == []


def test_a_method_patched_after_the_hashes_were_made_is_still_a_change(monkeypatch):
    model, x = Block(), torch.randn(2, 4)
    record = recorded(model, x)
    _aot_identity.prehash_classes(record)
    monkeypatch.setattr(Block, "scale", lambda self, y: y * 3)
    assert _aot_identity.class_changes(record, model.forward, (x,), {}) == [f"{__name__}.Block"]


def test_equal_code_compiled_from_two_files_hashes_apart():
    source = "def f(x):\n    return x + 1\n"
    one, two = ({}, {})
    exec(compile(source, "/a/one.py", "exec"), one)  # noqa: S102 - the same text, two file names
    exec(compile(source, "/b/two.py", "exec"), two)  # noqa: S102
    assert one["f"].__code__ == two["f"].__code__  # equal to Python, which ignores the file name
    assert _aot_identity.code_hash(one["f"].__code__) != _aot_identity.code_hash(two["f"].__code__)
    assert _aot_identity.code_hash(one["f"].__code__) == _aot_identity._code_hash(one["f"].__code__)


def test_a_class_that_is_not_found_here_is_passed_over(monkeypatch):
    import sys
    import types

    odd = types.ModuleType("odd_module")
    odd.__getattr__ = lambda name: (_ for _ in ()).throw(RuntimeError(name))  # raises on any missing name
    monkeypatch.setitem(sys.modules, "odd_module", odd)
    monkeypatch.setattr(_aot_identity, "_CODE_HASHES", {})
    _aot_identity.prehash_classes([("no.such.module", "Gone", ()), (__name__, "Block.missing", ()),
                                   ("odd_module", "Anything", ()), (__name__, "Block", ())])
    assert _aot_identity._CODE_HASHES  # the classes after those were hashed
