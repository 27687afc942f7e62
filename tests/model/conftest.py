"""Fixtures of the model tests."""

import pytest


@pytest.fixture
def fused_on(monkeypatch):
    """`fused.MODE = "on"`: the fused kernels also on CPU tensors (Triton's interpreter, set by tests/conftest.py)."""
    from k3infra.model import fused

    monkeypatch.setattr(fused, "MODE", "on")
