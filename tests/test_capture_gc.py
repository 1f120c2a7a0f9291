"""What a capture does to Python's garbage collector (`graphify.capture.context.freeze_gc`):
young garbage collected first, the oldest generation (a loaded model's objects) not walked,
no collection while graphs are captured, and the collector as it was afterwards."""

from __future__ import annotations

import gc
import weakref

import pytest

from graphify.capture.context import freeze_gc


class Node:
    pass


def young_cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_young_garbage_goes_before_a_capture_and_the_oldest_generation_is_not_walked(monkeypatch):
    alive = young_cycle()
    generations = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: generations.append(generation) or real(generation))
    with freeze_gc():
        assert alive() is None  # a dead cycle made just before: collected
        assert not gc.isenabled()
    assert generations and max(generations) < 2  # a full collection walks every object the process holds


@pytest.mark.parametrize("enabled", [True, False])
def test_no_collection_while_capturing_and_the_collector_as_it_was_after(enabled):
    was, frozen = gc.isenabled(), gc.get_freeze_count()
    (gc.enable if enabled else gc.disable)()
    try:
        with freeze_gc(collect=False):
            alive = young_cycle()
            for _ in range(3 * gc.get_threshold()[0]):
                Node()  # enough allocations to trigger the collector, were it running
            assert alive() is not None
        assert gc.isenabled() is enabled and gc.get_freeze_count() == frozen
    finally:
        (gc.enable if was else gc.disable)()
