"""MoonEP's runtime errors.

Bad arguments raise `ValueError`/`TypeError` at the public edge; faults of the communication itself (a peer
that died or stalled past the buffer's timeout) raise `CommError` on every surviving rank.
"""

from __future__ import annotations


class CommError(RuntimeError):
    """A collective failed or did not finish within the buffer's timeout (a peer died or stalled).

    The buffer that raised it is unusable afterwards: call `Buffer.destroy()` and rebuild the group.
    """
