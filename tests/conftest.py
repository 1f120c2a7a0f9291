"""Shared fixtures: the backend matrix (sim on CPU everywhere, cuda where a GPU exists)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=600)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

BACKENDS = [
    pytest.param(("sim", "cpu"), id="sim-cpu"),
    pytest.param(("cuda", "cuda"), id="cuda", marks=[pytest.mark.cuda, requires_cuda]),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """(backend name, device) for behavioural tests that must hold on every backend."""
    return request.param


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)
