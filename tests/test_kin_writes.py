"""What a structure's captures wrote, carried to a kin's compiled captures
(`graphify.capture.kin_writes`, `graphify.backends.tensor_writes.KinWrites`): positions in the walk of the
static objects, the storages they name in another walk, and when nothing may be said."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from graphify.backends.tensor_writes import KinWrites, StateKeeper
from graphify.capture import kin_writes
from graphify.capture.kin_writes import storages_at, written_positions


def walk(*tensors):
    return SimpleNamespace(tensors=tuple(tensors))


def recorded(fn, *tensors) -> StateKeeper:
    """A keeper after one recorded run of `fn` and its restore, as a capture leaves it."""
    keeper = StateKeeper()
    keeper.record_writes(fn, *tensors)
    keeper.restore()
    keeper.forget()
    return keeper


def test_the_positions_of_written_tensors_name_the_same_tensors_in_a_walk_of_the_same_skeleton():
    a, b, c = torch.randn(4), torch.randn(4), torch.randn(4)
    keeper = recorded(lambda x, y, z: (y.add_(1), z.mul_(2)), a, b, c)
    writes = written_positions(keeper, walk(a, b, c))
    assert writes == (3, frozenset({1, 2}))
    other = [torch.randn(6) for _ in range(3)]  # another object of the same skeleton (another length)
    found = storages_at(writes, walk(*other))
    assert [s.data_ptr() for s in found] == [other[1].untyped_storage().data_ptr(), other[2].untyped_storage().data_ptr()]


def test_a_write_outside_the_walk_or_one_that_cannot_be_restored_says_nothing():
    a, outside = torch.randn(4), torch.randn(4)
    assert written_positions(recorded(lambda x, y: y.add_(1), a, outside), walk(a)) is None
    keeper = recorded(lambda x: x.add_(1), a)
    keeper.unrestorable.add("aten::some_op")
    assert written_positions(keeper, walk(a)) is None
    assert written_positions(StateKeeper(), walk(a)) is None  # nothing recorded: nothing known


def test_views_of_one_storage_are_copied_once_and_a_walk_of_another_length_or_too_many_bytes_is_refused(monkeypatch):
    base = torch.randn(8)
    views = walk(base[:4], base[4:], torch.randn(2))
    assert len(storages_at((3, frozenset({0, 1})), views)) == 1
    assert storages_at((4, frozenset({0})), views) is None
    monkeypatch.setattr(kin_writes, "WHOLE_UNDO_BYTES", 16)
    assert storages_at((3, frozenset({0})), views) is None  # 32 bytes
    assert storages_at(None, views) is None


@pytest.mark.parametrize("second, union", [((3, frozenset({2})), (3, frozenset({0, 2}))), (None, None),
                                            ((5, frozenset({0})), None)])
def test_a_sessions_writes_are_the_union_of_its_captures_and_none_for_good_once_one_cannot_say(second, union):
    kin = KinWrites()
    kin.note((3, frozenset({0})))
    kin.note(second)
    assert kin.own == union
    kin.note((3, frozenset({1})))
    assert kin.own == (union and (3, union[1] | {1}))
