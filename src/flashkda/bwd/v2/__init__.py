"""FlashKDA backward v2 (``docs/flashkda-v2-backward.md``): the training entry `chunk_kda_v2` (K1 + F2 forward,
K1 + B2 + B3 backward), its kernels' launchers and the torch emulation they are checked against."""

from flashkda.bwd.v2.train import chunk_kda_v2

__all__ = ["chunk_kda_v2"]
