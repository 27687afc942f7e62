"""Suite-wide configuration: device markers and Triton's CPU interpreter.

Without a CUDA device, Triton kernels run under `TRITON_INTERPRET=1` on CPU tensors at small shapes; this
must be set before triton is first imported, hence here. Tests marked `gpu` are skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None


def _cuda_available() -> bool:
    if not HAS_TORCH:
        return False
    import torch

    return torch.cuda.is_available()


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> str:
    """`cuda` where a GPU is visible, else `cpu` (kernels then run in Triton's interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"
