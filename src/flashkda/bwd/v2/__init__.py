"""FlashKDA backward v2: the torch emulation of the planned kernels (``docs/flashkda-v2-backward.md``)."""
