"""FlashKDA: Triton kernels for Kimi Delta Attention, a drop-in backend for fla's chunk_kda."""

__version__ = "0.1.0"
