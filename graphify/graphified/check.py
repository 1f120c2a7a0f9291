"""`g.check()`: the captured callable against eager, on fresh random batches.

Padding is a contract: padded rows run through the graph, so a function that mixes rows
(a mean over the batch added back to each row, a batch norm in training mode) gives other
values for the real rows when it is padded. `check` finds that out before production: at
every captured size (no padding: the graph must equal eager), between sizes (padded) and
above the largest (eager), per output, in one table. Outside state the eager runs write is
put back (`StateKeeper`), so a check leaves caches as it found them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from graphify.base.axes import Kind
from graphify.backends.tensor_writes import StateKeeper
from graphify.base.modes import Mode
from graphify.call.runtime import Miss
from graphify.plan.stats import Stats

__all__ = ["CheckRow", "CheckReport", "check_table", "check_sizes", "check_callable"]


@attrs.frozen
class CheckRow:
    """One output at one batch size: how the graphified call compares with eager."""

    num_tokens: int
    where: str  # "captured", "between" (padded) or "above" (eager)
    mode: str  # the runtime mode the call dispatched to
    padded_to: int | None
    output: int
    max_err: float
    match: bool

    @property
    def verdict(self) -> str:
        if self.match:
            return "ok"
        if self.padded_to is not None and self.padded_to != self.num_tokens:
            return "padding changes real rows (the function mixes rows across the batch)"
        return "differs from eager without padding"


@attrs.frozen
class CheckReport:
    """Every row of a check; `ok` when every real row matched eager."""

    label: str
    rows: tuple[CheckRow, ...]

    @property
    def ok(self) -> bool:
        return all(r.match for r in self.rows)

    def table(self) -> str:
        head = "| tokens | where | ran as | padded to | output | max err | real rows match | verdict |\n|---|---|---|---|---|---|---|---|"
        body = [
            f"| {r.num_tokens} | {r.where} | {r.mode} | {r.padded_to if r.padded_to is not None else '-'} | "
            f"{r.output} | {r.max_err:.3g} | {'yes' if r.match else 'NO'} | {r.verdict} |"
            for r in self.rows
        ]
        return "\n".join([f"{self.label}.check(): {'all real rows match eager' if self.ok else 'MISMATCHES'}", head, *body])

    def __str__(self) -> str:
        return self.table()


def check_sizes(captured: Sequence[int]) -> list[tuple[int, str]]:
    """Every captured size, one size between each pair of neighbours, and one above."""
    sizes = sorted(set(captured))
    out, prev = [], 0
    for s in sizes:
        if s - prev > 1:
            out.append(((prev + s) // 2 if (prev + s) // 2 > prev else prev + 1, "between"))
        out.append((s, "captured"))
        prev = s
    out.append((sizes[-1] + 1, "above"))
    return out


def _random_args(runtime, examples: Sequence[Any], n: int, gen: torch.Generator) -> tuple:
    """Arguments for `n` tokens: float rows drawn like the example's, integer and bool rows
    resampled from the example (so indices stay valid); the rest as captured."""
    table = runtime.table
    args = []
    for b, spec in enumerate(table.specs):  # (padded slots: rows drawn here; `n` may be past every key)
        arg = None if spec.axis.kind.padded else table.static.unpadded(b, spec)
        example = examples[b]
        if spec.axis.kind is Kind.TOKENS:
            if example.is_floating_point() or example.is_complex():
                scale = example.float().std().nan_to_num(1.0).clamp_min(1e-3).item() if example.numel() > 1 else 1.0
                x = torch.randn((n, *spec.trailing), generator=gen) * scale
                args.append(x.to(device=spec.device, dtype=spec.dtype))
            else:
                rows = torch.randint(0, example.shape[0], (n,), generator=gen).to(example.device)
                args.append(example[rows].clone())
        elif spec.axis.kind is Kind.FIXED:
            args.append(arg.clone())
        elif spec.axis.kind is Kind.REQS:
            args.append(spec.value)  # request rows need the caller's make_batch
        else:
            args.append(arg)
    return tuple(args)


def check_table(
    label: str,
    runtime,
    examples: Sequence[Any],
    make_batch: Callable[[int], Sequence[Any]] | None,
    sizes: Sequence[tuple[int, str]],
    *,
    rtol: float,
    atol: float,
    seed: int,
) -> CheckReport:
    """Run the check; see the module docstring. `make_batch(n)` returns argument slots."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n, where in sizes:
        args = tuple(make_batch(n)) if make_batch is not None else _random_args(runtime, examples, n, gen)
        keeper, stats = StateKeeper(), Stats()
        with torch.no_grad():
            want = keeper.record_writes(runtime.fn, *args)
            want = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, want)
            keeper.restore()
            got = runtime.run(args, stats)
            if type(got) is Miss:  # first use: no graph for this size yet, and a check never captures
                stats.record(Mode.NONE, got.tokens, None)
                got = runtime.fn(*args)
            keeper.restore()
        ran = stats.rows()[0]  # what this call really dispatched to (its uniform, LoRA and FULL flags too)
        mode, padded = ran.mode.value, ran.padded_to
        got_flat, want_flat = pytree.tree_leaves(got), pytree.tree_leaves(want)
        for i, (a, b) in enumerate(zip(got_flat, want_flat)):
            if isinstance(b, torch.Tensor):
                same_shape = isinstance(a, torch.Tensor) and a.shape == b.shape
                err = (a.double() - b.double()).abs().max().item() if same_shape and b.numel() else (0.0 if same_shape else float("inf"))
                match = same_shape and torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol)
            else:
                err, match = 0.0, a == b
            rows.append(CheckRow(n, where, mode, padded, i, err, bool(match)))
        if len(got_flat) != len(want_flat):
            rows.append(CheckRow(n, where, mode, padded, len(want_flat), float("inf"), False))
    return CheckReport(label, tuple(rows))


def check_callable(label: str, runtime, make_batch, sizes, *, rtol: float, atol: float, seed: int) -> CheckReport:
    """`Graphified.check` (see there) over `runtime`: a captured callable's, or on first use
    the most recently used structure's (None: nothing captured yet)."""
    table = runtime.table if runtime is not None else None
    if runtime is None or not len(table):
        raise ValueError(f"{label}.check: capture first; check compares the graphs with eager")
    if make_batch is None and runtime.checks.req_idx:
        raise ValueError(
            f"{label}.check: request-axis arguments must agree with the token ones, which random rows "
            "cannot guess: pass make_batch(num_tokens) returning a call's arguments"
        )
    def bound_batch(n):
        """`make_batch(n)` (arguments, keywords, or both) bound to the table's slots."""
        batch = make_batch(n)
        if isinstance(batch, dict):
            return table.layout.bind((), batch)
        if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[1], dict):
            return table.layout.bind(batch[0], batch[1])
        return table.layout.bind(tuple(batch), {})

    captured = {k.num_tokens for k in table.keys.full | table.keys.piecewise}
    if sizes is None:
        sizes = check_sizes(captured)
    else:
        top = max(captured)
        sizes = [(n, "captured" if n in captured else "above" if n > top else "between") for n in sizes]
    make = bound_batch if make_batch is not None else None
    return check_table(label, runtime, table.examples or (), make, sizes, rtol=rtol, atol=atol, seed=seed)
