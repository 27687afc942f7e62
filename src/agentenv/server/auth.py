"""API keys and their quotas, stored hashed in ``<state_dir>/keys.json``.

A key is shown once, when it is created (`agentenv keys create`); the server keeps only its SHA-256. Every
control-plane request carries it in ``X-API-Key`` (or ``Authorization: Bearer``). Each sandbox gets its own
access token at creation, which the SDK sends to the in-sandbox services as ``X-Access-Token``.

Example::

    store = KeyStore(Path("/var/lib/agentenv/server"))
    key, info = store.create("rollouts", Quota(max_sandboxes=256))
    assert store.verify(key).id == info.id
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

KEY_PREFIX = "e2b_"


@dataclass(frozen=True)
class Quota:
    """Per-key limits; 0 means unlimited."""

    max_sandboxes: int = 64
    """Live (running or paused) sandboxes at once."""
    max_cpus: float = 0
    """Sum of the CPU quotas (cores) of the key's live sandboxes."""
    max_memory_mb: int = 0
    """Sum of the memory limits (MiB) of the key's live sandboxes."""

    def __post_init__(self) -> None:
        for name in ("max_sandboxes", "max_memory_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int (0 = unlimited), got {value!r}")
        if isinstance(self.max_cpus, bool) or not isinstance(self.max_cpus, (int, float)) or self.max_cpus < 0:
            raise ValueError(f"max_cpus must be a non-negative number (0 = unlimited), got {self.max_cpus!r}")


@dataclass
class KeyInfo:
    """What the server stores about a key (never the key itself)."""

    id: str
    name: str
    digest: str
    created: float
    quota: Quota = field(default_factory=Quota)
    revoked: bool = False


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@functools.lru_cache(maxsize=1024)
def _cached_digest(key: str) -> str:
    """`_digest` of a key presented again (every request presents one; a few keys present it thousands of times)."""
    return _digest(key)


class KeyStore:
    """The keys of one server (a JSON file under `state_dir`, rewritten atomically on change).

    Args:
        state_dir: the server's state directory (created if missing).
    """

    def __init__(self, state_dir: Path | str):
        self.path = Path(state_dir) / "keys.json"
        self._path_str = str(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._keys: dict[str, KeyInfo] = {}
        self._mtime = -1.0
        self._load()

    def _load(self) -> None:
        try:
            mtime = os.stat(self._path_str).st_mtime
        except FileNotFoundError:
            self._keys, self._mtime = {}, -1.0
            return
        if mtime == self._mtime:
            return
        raw = json.loads(self.path.read_text() or "{}")
        self._keys = {k: KeyInfo(**{**v, "quota": Quota(**v.get("quota", {}))}) for k, v in raw.items()}
        self._mtime = mtime

    def _save(self) -> None:
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({k: asdict(v) for k, v in self._keys.items()}, indent=1))
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)
        self._mtime = self.path.stat().st_mtime

    def create(self, name: str, quota: Quota | None = None) -> tuple[str, KeyInfo]:
        """A new key; returns ``(key, info)``. The key is not stored and cannot be shown again."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if quota is not None and not isinstance(quota, Quota):
            raise ValueError(f"quota must be an agentenv.server.auth.Quota, got {type(quota).__name__}")
        key = KEY_PREFIX + secrets.token_hex(20)
        info = KeyInfo("key-" + secrets.token_hex(4), name.strip(), _digest(key), time.time(), quota or Quota())
        with self._lock:
            self._load()
            self._keys[info.id] = info
            self._save()
        return key, info

    def revoke(self, key_or_id: str) -> KeyInfo:
        """Revoke by key id (``key-...``) or by the key itself. Raises `KeyError` if unknown."""
        with self._lock:
            self._load()
            info = self._keys.get(key_or_id) or next(
                (k for k in self._keys.values() if hmac.compare_digest(k.digest, _digest(key_or_id))), None)
            if info is None:
                raise KeyError(f"no key {key_or_id!r} (see `agentenv keys list`)")
            info.revoked = True
            self._save()
            return info

    def list(self) -> list[KeyInfo]:
        with self._lock:
            self._load()
            return sorted(self._keys.values(), key=lambda k: k.created)

    def verify(self, key: str | None) -> KeyInfo | None:
        """The live key's info, or None for a missing, unknown or revoked key."""
        if not key or not isinstance(key, str):
            return None
        digest = _cached_digest(key)
        with self._lock:
            self._load()  # keys created or revoked by the CLI take effect without a restart
            for info in self._keys.values():
                if hmac.compare_digest(info.digest, digest):
                    return None if info.revoked else info
        return None


def new_access_token() -> str:
    """A per-sandbox access token for the in-sandbox services."""
    return secrets.token_urlsafe(24)
