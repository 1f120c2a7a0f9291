"""What a structure's captures wrote outside the call, carried to a kin that captures the same
code compiled (`Options(compile="background")`: the structure compiled graphs replace).

A capture's first warm-up normally runs the function as written under the state keeper's
dispatch mode, which records each in-place write so the warm-ups can be undone; compiled code
cannot run under it, so a compiled capture first runs the eager original, recorded. At 0.5B on
an H100 that recorded run was most of the call that took the compiled graphs in (over a
hundred milliseconds: every op through a Python dispatch mode). Where the replaced structure's
recorded runs wrote only tensors of its static objects (a KV cache), their positions in the
walk of those objects are kept (`written_positions`); the kin, whose objects have the same
skeleton, finds the tensors at the same positions (`storages_at`) and undoes its compiled
warm-ups by whole copies of their storages taken before, within a bound on their bytes.
"""

from __future__ import annotations

from graphify.reads.reach import has_address

__all__ = ["WHOLE_UNDO_BYTES", "written_positions", "storages_at"]

WHOLE_UNDO_BYTES = 1 << 30  # past this, the kin's capture records the eager original's writes again


def written_positions(keeper, shallow) -> tuple | None:
    """(tensor count, positions in `shallow.tensors`) of the storages `keeper` restored since
    its `since` was emptied; None where a write landed outside the static objects, could not
    be restored, or no run was recorded (nothing is known)."""
    if not keeper.recorded or keeper.unrestorable:
        return None
    at: dict[int, int] = {}
    for i, t in enumerate(shallow.tensors):
        if has_address(t):  # a tensor without storage (a subclass) is never a target
            at.setdefault(t.untyped_storage().data_ptr(), i)
    if any(p not in at for p in keeper.since):
        return None
    return len(shallow.tensors), frozenset(at[p] for p in keeper.since)


def storages_at(writes: tuple | None, shallow) -> tuple | None:
    """The storages of `shallow`'s tensors at the positions `writes` keeps, each once; None
    where the walk differs in length (another skeleton) or their bytes pass `WHOLE_UNDO_BYTES`."""
    if writes is None:
        return None
    count, positions = writes
    if len(shallow.tensors) != count:
        return None
    storages = {}
    for i in sorted(positions):
        storage = shallow.tensors[i].untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    if sum(s.nbytes() for s in storages.values()) > WHOLE_UNDO_BYTES:
        return None
    return tuple(storages.values())
