"""Reading a sandbox file safely: regular files only, never blocking on a FIFO, with a size cap.

Stdlib only and self-contained: the tool server imports it, and the host sends its source to the in-sandbox
envd agent ahead of `agentenv.server.watch` (see `agentenv.server.agents`).
"""

from __future__ import annotations

import os
import stat

READ_CHUNK = 1 << 20


def read_regular(path: str, cap: int) -> bytes:
    """The contents of the regular file at `path`, read in chunks, at most `cap` bytes.

    Opened non-blocking, so a FIFO with no writer cannot hang the caller; devices, FIFOs and sockets are
    refused before any byte is read, and a file that grows past `cap` while read is refused too.

    Raises:
        FileNotFoundError / IsADirectoryError / PermissionError: as `open`.
        ValueError: not a regular file, or larger than `cap` bytes (the message says which).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(f"{path!r} is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path!r} is not a regular file (a device, FIFO or socket); refusing to read it")
        if st.st_size > cap:
            raise ValueError(f"file {path!r} is larger than {cap} bytes")
        parts, total = [], 0
        while chunk := os.read(fd, min(READ_CHUNK, cap + 1 - total)):
            parts.append(chunk)
            total += len(chunk)
            if total > cap:
                raise ValueError(f"file {path!r} grew past {cap} bytes while read")
        return b"".join(parts)
    finally:
        os.close(fd)
