"""K3 Infra: the `k3infra` command (demo, benchmarks, info) and shared helpers.

The three libraries live in their own import packages: `flashkda`, `moonep`, `agentenv`.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
