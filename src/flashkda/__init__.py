"""FlashKDA: Triton kernels for Kimi Delta Attention, a drop-in backend for fla's chunk_kda.

Public API: ``chunk_kda`` (prefill, fla-core 0.6.0 signature), ``fused_recurrent_kda`` (decode), ``fwd``
(MoonshotAI FlashKDA signature), ``KimiDeltaAttention`` (the trainable layer with a decode cache), ``dispatch_report`` (which backend serves
fla's ``chunk_kda`` per shape, and why) and ``reference`` (fp64 oracles). Importing this package does no work: no device
probes, no kernel compilation, no fla import.
"""

from flashkda import reference
from flashkda.chunk import chunk_kda
from flashkda.compat import fwd
from flashkda.decode import fused_recurrent_kda
from flashkda.dispatch import dispatch_report
from flashkda.layer import KDACache, KimiDeltaAttention

__version__ = "0.1.0"

__all__ = ["KDACache", "KimiDeltaAttention", "chunk_kda", "dispatch_report", "fused_recurrent_kda", "fwd", "reference"]
