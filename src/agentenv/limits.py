"""Per-sandbox resource limits with safe defaults."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox (cgroup v1 + the writable layer's tmpfs size).

    Example::

        >>> Limits(memory_mb=256, pids=64).memory_mb
        256
    """

    memory_mb: int = 512
    """Memory limit in MiB: processes, page cache and the writable layer's files (it lives in tmpfs)."""
    pids: int = 256
    """Maximum number of tasks (processes + threads), which contains fork bombs."""
    cpus: float = 1.0
    """CPU quota in cores (CFS quota over a 100 ms period); 0 disables the quota."""
    disk_mb: int = 1024
    """Size of the writable layer (what the sandbox may add or change on top of its image), in MiB."""

    def __post_init__(self) -> None:
        for name, low, high in (("memory_mb", 16, 1 << 20), ("pids", 8, 1 << 22), ("disk_mb", 1, 1 << 24)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
        if isinstance(self.cpus, bool) or not isinstance(self.cpus, (int, float)) or not 0 <= self.cpus <= 1024:
            raise ValueError(f"cpus must be a number in [0, 1024] (0 = unlimited), got {self.cpus!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> Limits:
        return cls(**(data or {}))
