"""Start-up hook that registers FlashKDA with fla, loaded by ``k3_flashkda.pth`` in site-packages.

The interpreter imports this package at start-up, so it must stay cheap: it imports only ``os`` and ``sys``
(already loaded) and installs a duck-typed meta-path finder (importing ``importlib.abc`` alone costs ~25 ms).
The finder wraps the loader of ``fla.ops.kda.chunk``; once that module has executed,
``flashkda.backend.register_with_fla()`` adds our backend to fla's ``chunk_kda`` dispatcher. torch, triton, fla
and flashkda are imported only if the program itself imports fla's KDA ops. ``FLASHKDA_DISPATCH=never`` (or
``FLASHKDA_DISABLE=1``) skips it all.
"""

from __future__ import annotations

import os
import sys

#: The module whose import triggers registration (it defines fla's dispatched ``chunk_kda``).
TARGET = "fla.ops.kda.chunk"


class _RegisteringLoader:
    """Delegates to the real loader, then registers FlashKDA with the freshly executed module."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            from flashkda.backend import register_with_fla

            register_with_fla()
        except Exception:  # never break the caller's `import fla`
            import logging

            logging.getLogger(__name__).warning(
                "flashkda: could not register with fla; fla's own kernels will run", exc_info=True
            )


class FlaKDAFinder:
    """Meta-path finder that only reacts to ``TARGET``; every other import passes straight through."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _RegisteringLoader):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent; no-op with ``FLASHKDA_DISPATCH=never``).

    If fla's KDA module is already imported (e.g. the hook was installed late), register right away.
    """
    if os.environ.get("FLASHKDA_DISABLE") == "1" or os.environ.get("FLASHKDA_DISPATCH", "").strip().lower() == "never":
        return
    if any(isinstance(f, FlaKDAFinder) for f in sys.meta_path):
        return
    if TARGET in sys.modules:
        from flashkda.backend import register_with_fla

        register_with_fla()
        return
    sys.meta_path.insert(0, FlaKDAFinder())
