"""FlashKDA forward v2: a prepare kernel (K1) and a recurrence kernel (K2) in Triton Gluon, 32-token chunks (or 16).

Importing this package imports neither Gluon nor the kernels; they load on the first `chunk_kda_fwd_v2` call.
"""

from flashkda.fwd.v2.chunk_fwd import chunk_kda_fwd_v2, supports_v2, v2_unsupported_reason

__all__ = ["chunk_kda_fwd_v2", "supports_v2", "v2_unsupported_reason"]
