"""Ships ``k3_flashkda.pth`` at the root of site-packages (regular and editable installs), so fla's chunk_kda
dispatches to FlashKDA without the caller importing it. Everything else is configured in pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = os.path.join("src", "flashkda_hook", "k3_flashkda.pth")
PTH_NAME = os.path.basename(PTH)


class BuildPyWithPth(build_py):
    """build_py that also places the start-up hook's .pth file at the root of the wheel (= site-packages)."""

    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH_NAME), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH_NAME)]


class _StrategyWithPth:
    """Wraps setuptools' editable strategy (which only writes its own path .pth) to add ours as well.

    ``__editable__.*.pth`` sorts before ``k3_flashkda.pth``, so ``src`` is on sys.path when our line runs.
    """

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, wheel, files, mapping):
        self.inner(wheel, files, mapping)
        with open(PTH, "rb") as f:
            wheel.writestr(PTH_NAME, f.read())

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class EditableWheelWithPth(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        return _StrategyWithPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
