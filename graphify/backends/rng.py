"""Random number generators as a capture found them.

A capture runs the function more than once (warm-ups, the capture run), and each run
draws from the generators it uses; eager would have drawn once. So that a capturing call,
and every call after it, sees the random numbers eager would, `RandomStates.take` keeps the
states of the default generators (the CPU's and the capture device's) and of generators the
function reaches, and `restore()` puts them back after the capture: the graph replay that
answers the call then draws exactly what eager would have drawn, and leaves the generators
where eager would.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["RandomStates"]


class RandomStates:
    """Generators and their states, as taken."""

    def __init__(self, states: list):
        self.states = states  # (generator or None for the CUDA default of a device, device, state)

    @classmethod
    def take(cls, device: torch.device | None, generators: Iterable[torch.Generator] = ()) -> "RandomStates":
        states = [(torch.default_generator, None, torch.default_generator.get_state())]
        if device is not None and device.type == "cuda":
            states.append((None, device, torch.cuda.get_rng_state(device)))
        seen = {id(torch.default_generator)}
        for g in generators:
            if id(g) not in seen:
                seen.add(id(g))
                states.append((g, None, g.get_state()))
        return cls(states)

    def restore(self) -> bool:
        """Put back the states that moved (one left alone is not rewound over another thread's
        draws meanwhile); whether any had."""
        moved = False
        for generator, device, state in self.states:
            now = torch.cuda.get_rng_state(device) if generator is None else generator.get_state()
            if torch.equal(now, state):
                continue
            moved = True
            if generator is None:
                torch.cuda.set_rng_state(state, device)
            else:
                generator.set_state(state)
        return moved
