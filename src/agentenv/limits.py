"""Per-sandbox resource limits and network policy, with safe defaults."""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class AllowRule:
    """One parsed `Network.allow` entry: IPv4 destinations and an optional port (TCP and UDP)."""

    net: ipaddress.IPv4Network
    port: int | None


@dataclass(frozen=True)
class Network:
    """Network policy of one sandbox: its own loopback only (the default), or egress to an allow list.

    With a non-empty `allow`, the sandbox gets a veth pair (``eth0`` inside, an address from the runtime's
    private range, a default route through the host), the host NATs what leaves the machine, and the host
    (never the sandbox, whose root may reconfigure its own network namespace at will) drops every packet
    from the sandbox that no entry allows, every packet with a source address other than its own, all of
    its IPv6, and new connections into it.

    Entries are IPv4 destinations, each with an optional port that then applies to TCP and UDP:
    ``"10.1.0.0/16"``, ``"192.0.2.7"``, ``"192.0.2.7:8080"``, ``"10.0.0.0/8:443"``. Host names are refused
    (resolve them first; DNS from inside the sandbox needs its resolver allowed, e.g. ``"192.0.2.53:53"``).

    Example::

        >>> Network(allow=("192.0.2.7:8080",)).rules()[0].port
        8080
        >>> Network().egress
        False
    """

    allow: tuple[str, ...] = ()
    """Allowed destinations (see above); empty means no veth at all: the sandbox has its loopback only."""

    def __post_init__(self) -> None:
        allow = self.allow
        if isinstance(allow, str) or not isinstance(allow, (list, tuple)):
            raise ValueError(f"network.allow must be a list of 'CIDR' or 'address:port' strings, got {allow!r}")
        object.__setattr__(self, "allow", tuple(allow))
        self.rules()  # validates every entry

    @property
    def egress(self) -> bool:
        """Whether the sandbox gets a veth (some destination is allowed)."""
        return bool(self.allow)

    def rules(self) -> list[AllowRule]:
        """The entries parsed; raises ValueError naming the first bad one."""
        return [_parse_rule(entry) for entry in self.allow]

    @classmethod
    def from_dict(cls, data: dict | Network | None) -> Network:
        if isinstance(data, Network):
            return data
        return cls(**(data or {}))


def _parse_rule(entry: object) -> AllowRule:
    if not isinstance(entry, str):
        raise ValueError(f"network.allow entries must be strings, got {entry!r}")
    host, port = entry, None
    if entry.count(":") == 1:  # more than one is an IPv6 address, refused below
        host, _, port_text = entry.rpartition(":")
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"network.allow entry {entry!r}: port must be in [1, 65535]")
        port = int(port_text)
    try:
        net = ipaddress.ip_network(host, strict=False)
    except ValueError:
        raise ValueError(f"network.allow entry {entry!r}: not an IPv4 address or CIDR with an optional ':port' "
                         "(host names are not resolved; resolve them before creating the sandbox)") from None
    if net.version != 4:
        raise ValueError(f"network.allow entry {entry!r}: IPv6 egress is not supported (IPv4 only)")
    return AllowRule(net, port)


@dataclass(frozen=True)
class Limits:
    """Resource limits and network policy of one sandbox (cgroup v1, the writable layer's size, egress).

    Example::

        >>> Limits(memory_mb=256, pids=64).memory_mb
        256
        >>> Limits(network=Network(allow=("192.0.2.7:8080",))).network.egress
        True
    """

    memory_mb: int = 512
    """Memory limit in MiB: processes and page cache (and the writable layer's files with `disk_in_memory`)."""
    pids: int = 256
    """Maximum number of tasks (processes + threads), which contains fork bombs."""
    cpus: float = 1.0
    """CPU quota in cores (CFS quota over a 100 ms period); 0 disables the quota."""
    disk_mb: int = 1024
    """Size of the writable layer (what the sandbox may add or change on top of its image), in MiB: writing
    past it fails with ENOSPC. The layer is its own ext4 on disk, so it never counts against `memory_mb`."""
    disk_in_memory: bool = False
    """Keep the writable layer in RAM (a tmpfs of `disk_mb`) instead: its files then count against
    `memory_mb` (filling it can OOM-kill the sandbox), in exchange for creating and forking a little faster."""
    network: Network = Network()
    """Loopback only by default; `Network(allow=...)` opts into egress (needs `nft` on the host)."""

    def __post_init__(self) -> None:
        for name, low, high in (("memory_mb", 16, 1 << 20), ("pids", 8, 1 << 22), ("disk_mb", 1, 1 << 24)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
        if isinstance(self.cpus, bool) or not isinstance(self.cpus, (int, float)) or not 0 <= self.cpus <= 1024:
            raise ValueError(f"cpus must be a number in [0, 1024] (0 = unlimited), got {self.cpus!r}")
        if not isinstance(self.disk_in_memory, bool):
            raise ValueError(f"disk_in_memory must be a bool, got {self.disk_in_memory!r}")
        if not isinstance(self.network, Network):
            raise ValueError(f"network must be an agentenv.Network, got {type(self.network).__name__}")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["network"] = {"allow": list(self.network.allow)}
        return out

    @classmethod
    def from_dict(cls, data: dict | None) -> Limits:
        data = dict(data or {})
        if "network" in data:
            data["network"] = Network.from_dict(data["network"])
        return cls(**data)
