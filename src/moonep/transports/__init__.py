"""How bytes move between ranks: `TorchDistTransport` (any torch.distributed backend)."""

from moonep.transports.torch_dist import TorchDistTransport

__all__ = ["TorchDistTransport"]
