"""Run torchtitan's trainer on the CPU (gloo), for tests and debugging without a GPU.

torchtitan 0.3.0 picks its device once, at import: ``device_type = _get_available_device_type() or "cuda"``, so on
a machine without an accelerator it calls ``torch.cuda.set_device`` and fails. `use_cpu` points that choice at
the CPU before the trainer is imported: ``device_type = "cpu"`` (torch then picks gloo for ``cpu``) and a device
module with the calls the trainer makes (``set_device``, ``current_device``, memory statistics, which the CPU
does not keep and reports as empty).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

__all__ = ["use_cpu"]


class _CpuDeviceModule:
    """The subset of ``torch.cuda``'s interface torchtitan's trainer calls, for the CPU."""

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None) -> SimpleNamespace:
        return SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    is_available = staticmethod(lambda: True)
    manual_seed = staticmethod(torch.manual_seed)
    manual_seed_all = staticmethod(torch.manual_seed)


def use_cpu() -> None:
    """Make torchtitan's trainer run on the CPU in this process (call before building the trainer; idempotent).

    Also rebinds the modules that imported ``device_type`` / ``device_module`` by name already.
    """
    import torchtitan.tools.utils as utils

    module = _CpuDeviceModule()
    utils.device_type, utils.device_module = "cpu", module
    for name, mod in list(sys.modules.items()):
        if name.startswith("torchtitan.") and mod is not None and mod is not utils:
            if isinstance(getattr(mod, "device_type", None), str):
                mod.device_type = "cpu"
            if getattr(mod, "device_module", None) is not None:
                mod.device_module = module
