"""How bytes move between ranks: `TorchDistTransport` (any torch.distributed backend) and
`moonep.transports.nvlink.NVLinkTransport` (intra-node P2P copies; imported only when asked for)."""

from moonep.transports.torch_dist import TorchDistTransport

__all__ = ["TorchDistTransport"]
