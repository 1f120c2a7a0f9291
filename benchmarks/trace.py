"""A synthetic serving trace: requests arriving over time, scheduled into steps the way a
continuous-batching engine does (running decodes first, then chunked prefills within a
token budget, some steps verifying speculative tokens). Pure functions of a seed: the
same seed gives the same steps on every machine, so configurations compare on equal work.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import attrs

__all__ = ["Request", "Step", "synthetic_requests", "schedule"]


@attrs.frozen
class Request:
    """One request: when it arrives (step index), its prompt and how many tokens it emits."""

    id: int
    arrival: int
    prompt_len: int
    output_len: int


@attrs.frozen
class Step:
    """One forward step: per scheduled request, its new tokens and the tokens it had cached."""

    request_ids: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def kind(self) -> str:
        """"decode" (one token each), "spec" (the same 1+k each), "prefill" (no context) or "mixed"."""
        lens = set(self.query_lens)
        if lens == {1}:
            return "decode"
        if len(lens) == 1 and all(c > 0 for c in self.context_lens):
            return "spec"
        if all(c == 0 for c in self.context_lens):
            return "prefill"
        return "mixed"


def synthetic_requests(
    seed: int,
    num_requests: int = 64,
    *,
    mean_gap: float = 1.5,
    prompt_range: tuple[int, int] = (16, 512),
    output_range: tuple[int, int] = (8, 96),
) -> tuple[Request, ...]:
    """Requests with exponential inter-arrival gaps (in steps) and uniform lengths."""
    if num_requests < 1 or mean_gap <= 0:
        raise ValueError(f"synthetic_requests: need num_requests >= 1 and mean_gap > 0, got {num_requests}, {mean_gap}")
    rnd = random.Random(seed)
    t = 0.0
    out = []
    for i in range(num_requests):
        out.append(Request(i, int(t), rnd.randint(*prompt_range), rnd.randint(*output_range)))
        t += rnd.expovariate(1.0 / mean_gap)
    return tuple(out)


def schedule(
    requests: Sequence[Request],
    *,
    max_tokens: int = 512,
    max_reqs: int = 64,
    chunk: int = 256,
    spec_tokens: int = 0,
    spec_every: int = 0,
    max_steps: int = 100_000,
) -> tuple[Step, ...]:
    """Continuous batching: every step runs each running request's decode (1 token, or
    1 + `spec_tokens` on every `spec_every`-th step when only decodes run), then admits
    waiting prompts in arrival order, chunked to `chunk` tokens, while the step has fewer
    than `max_tokens` tokens and `max_reqs` requests. A request finishes after
    `output_len` decode tokens (spec steps count 1 + k)."""
    if max_tokens < 1 or max_reqs < 1 or chunk < 1 or spec_tokens < 0:
        raise ValueError("schedule: max_tokens, max_reqs and chunk must be >= 1, spec_tokens >= 0")
    engine = _Engine(requests)
    steps: list[Step] = []
    for step in range(max_steps):
        if not (engine.pending or engine.running or engine.prefilling):
            break
        engine.arrive(step)
        spec = spec_tokens > 0 and spec_every > 0 and not engine.prefilling and step % spec_every == 0
        ids, qlens, ctxs = engine.decodes(max_tokens, max_reqs, spec_tokens if spec else None)
        engine.prefills((ids, qlens, ctxs), max_tokens, max_reqs, chunk)
        if spec and len(set(qlens)) > 1:  # spec steps are uniform: requests near their end decode plainly
            qlens = [1] * len(qlens)
        if ids:
            steps.append(Step(tuple(ids), tuple(qlens), tuple(ctxs)))
        engine.advance(ids, qlens)
    return tuple(steps)


class _Engine:
    """The scheduler's state between steps: waiting, prefilling and decoding requests."""

    def __init__(self, requests: Sequence[Request]):
        self.pending = sorted(requests, key=lambda r: (r.arrival, r.id))
        self.by_id = {r.id: r for r in requests}
        self.prefilled = {r.id: 0 for r in requests}
        self.decoded = {r.id: 0 for r in requests}
        self.running: list[int] = []  # prompt done, decoding
        self.prefilling: list[int] = []  # admitted, prompt partly done

    def arrive(self, step: int) -> None:
        while self.pending and self.pending[0].arrival <= step:
            self.prefilling.append(self.pending.pop(0).id)

    def decodes(self, max_tokens: int, max_reqs: int, spec_tokens: int | None) -> tuple[list, list, list]:
        """(ids, query lengths, context lengths) of the running requests' decodes: 1 token
        each, or up to 1 + `spec_tokens` on a spec step."""
        ids, qlens, ctxs = [], [], []
        for rid in self.running[:max_reqs]:
            req = self.by_id[rid]
            left = req.output_len - self.decoded[rid]
            q = min(1 + spec_tokens, left) if spec_tokens is not None else 1
            if sum(qlens) + q > max_tokens:
                break
            ids.append(rid)
            qlens.append(q)
            ctxs.append(req.prompt_len + self.decoded[rid])
        return ids, qlens, ctxs

    def prefills(self, batch: tuple[list, list, list], max_tokens: int, max_reqs: int, chunk: int) -> None:
        """Add prompt chunks to `batch` in arrival order while it has room."""
        ids, qlens, ctxs = batch
        for rid in self.prefilling:
            budget = max_tokens - sum(qlens)
            if budget <= 0 or len(ids) >= max_reqs:
                break
            q = min(chunk, self.by_id[rid].prompt_len - self.prefilled[rid], budget)
            ids.append(rid)
            qlens.append(q)
            ctxs.append(self.prefilled[rid])

    def advance(self, ids: list, qlens: list) -> None:
        """Count the step's tokens: finished prompts start decoding, finished requests leave."""
        for rid, q in zip(ids, qlens):
            req = self.by_id[rid]
            if rid in self.running:
                self.decoded[rid] += q
                if self.decoded[rid] >= req.output_len:
                    self.running.remove(rid)
            else:
                self.prefilled[rid] += q
                if self.prefilled[rid] >= req.prompt_len:
                    self.prefilling.remove(rid)
                    self.running.append(rid)
