"""`StateFile`: the registry's JSON state, rewritten in place after every change and never left torn.

The registry saves on every create and kill. Writing a temporary file and renaming it over the old one
costs a new inode, a directory update and a close each time (about 0.15 ms on the dev VM when idle,
0.4 ms under load: a tenth of the server's share of ``create`` + ``kill``). Instead two slot files stay
open, ``<name>.json`` and ``<name>.1.json``; each save overwrites the older slot with one ``pwrite`` of
``{"seq": n, "state": ...}`` and truncates it to that length. A server killed in the middle of a save
leaves that slot unreadable or stale, never the other one, and `load` takes the readable slot with the
highest ``seq``. A plain ``<name>.json`` written by an older server (no ``seq``) is read as sequence 0.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


class StateFile:
    """Two-slot JSON state of one server.

    Args:
        path: the first slot, e.g. ``<state_dir>/sandboxes.json``; the second is ``sandboxes.1.json`` beside it.
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.paths = (self.path, self.path.with_name(f"{self.path.stem}.1{self.path.suffix}"))
        self._fds: list[int] | None = None
        self._seq = 0
        self._lock = threading.Lock()

    def load(self) -> dict | None:
        """The newest readable state (None when no slot holds one); later saves continue its sequence."""
        best: tuple[int, dict] | None = None
        for path in self.paths:
            try:
                raw = json.loads(path.read_bytes())
            except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError):
                continue
            if not isinstance(raw, dict):
                continue
            seq, state = (raw["seq"], raw["state"]) if "seq" in raw and "state" in raw else (0, raw)
            if isinstance(seq, int) and isinstance(state, dict) and (best is None or seq > best[0]):
                best = (seq, state)
        if best is None:
            return None
        self._seq = max(self._seq, best[0])
        return best[1]

    def save(self, state: dict) -> None:
        """Write `state` (JSON-serialisable) to the older slot."""
        with self._lock:
            if self._fds is None:
                self.load()  # continue the sequence of whatever is on disk
                self._fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600) for p in self.paths]
            self._seq += 1
            data = json.dumps({"seq": self._seq, "state": state}, separators=(",", ":")).encode()
            fd = self._fds[self._seq % 2]
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], done)
            os.ftruncate(fd, len(data))

    def close(self) -> None:
        with self._lock:
            for fd in self._fds or ():
                os.close(fd)
            self._fds = None
