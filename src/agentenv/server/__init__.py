"""`agentenv serve`: an E2B-compatible HTTP API over the sandbox runtime, so the stock `e2b` and
`e2b-code-interpreter` SDKs drive our sandboxes (plus fork/snapshot/restore/reset/step extensions).

Names resolve lazily: importing the package starts nothing and imports no server module.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Server": "agentenv.server.app",
    "KeyStore": "agentenv.server.auth",
    "Quota": "agentenv.server.auth",
    "document": "agentenv.server.openapi",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentenv.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
