"""CPU micro-benchmark of dispatch alone: the precomputed `Dispatcher.lookup` that every
call uses, and the readable reference `dispatch()`. Target: <= 1 µs per call."""

from __future__ import annotations

import itertools
import random

import torch
from torch.utils.benchmark import Timer

from graphify import dispatch, vllm_sizes
from graphify.plan.dispatch import Dispatcher
from graphify.plan.keys import plan_keys


def _us(stmt: str, names: dict, seconds: float) -> float:
    """Median µs per run of `stmt` (`Timer.blocked_autorange`)."""
    timer = Timer(stmt, globals=names, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=seconds).median * 1e6


def run(seconds: float = 1.0) -> list[dict]:
    keys = plan_keys("FULL_AND_PIECEWISE", vllm_sizes(512), max_num_reqs=256)
    fast = Dispatcher(keys)
    rnd = random.Random(0)
    batches = [(rnd.randint(1, 600), rnd.random() < 0.5) for _ in range(4096)]
    names = {"batches": itertools.cycle(batches), "lookup": fast.lookup, "dispatch": dispatch, "keys": keys}
    base = _us("n, u = next(batches)", names, seconds)  # the loop's own cost, taken off both
    fast_us = _us("n, u = next(batches)\nlookup(n, u, False)", names, seconds) - base
    ref_us = _us("n, u = next(batches)\ndispatch(keys, n, uniform=u)", names, seconds) - base
    return [
        {"what": "Dispatcher.lookup (precomputed, used per call)", "us_per_call": fast_us, "target_us": 1.0},
        {"what": "dispatch() (pure reference)", "us_per_call": ref_us, "target_us": None},
    ]


if __name__ == "__main__":
    for row in run():
        print(f"{row['what']:<50} {row['us_per_call']:.3f} µs/call")
