"""CPU micro-benchmark of dispatch alone: the precomputed `Dispatcher.lookup` that every
call uses, and the readable reference `dispatch()`. Target: <= 1 µs per call."""

from __future__ import annotations

import random
import statistics
import timeit

from graphify import Dispatcher, dispatch, plan_keys, vllm_sizes


def run(calls: int = 200_000) -> list[dict]:
    keys = plan_keys("FULL_AND_PIECEWISE", vllm_sizes(512), max_num_reqs=256)
    fast = Dispatcher(keys)
    rnd = random.Random(0)
    batches = [(rnd.randint(1, 600), rnd.random() < 0.5) for _ in range(4096)]
    mask = len(batches) - 1

    def lookups():
        lookup = fast.lookup
        for i in range(calls):
            n, u = batches[i & mask]
            lookup(n, u, False)

    def references():
        for i in range(calls // 20):
            n, u = batches[i & mask]
            dispatch(keys, n, uniform=u)

    def loop_only():
        for i in range(calls):
            n, u = batches[i & mask]

    base = statistics.median(timeit.repeat(loop_only, number=1, repeat=5)) / calls
    fast_s = statistics.median(timeit.repeat(lookups, number=1, repeat=5)) / calls - base
    ref_s = statistics.median(timeit.repeat(references, number=1, repeat=5)) / (calls // 20) - base
    return [
        {"what": "Dispatcher.lookup (precomputed, used per call)", "us_per_call": fast_s * 1e6, "target_us": 1.0},
        {"what": "dispatch() (pure reference)", "us_per_call": ref_s * 1e6, "target_us": None},
    ]


if __name__ == "__main__":
    for row in run():
        print(f"{row['what']:<50} {row['us_per_call']:.3f} µs/call")
