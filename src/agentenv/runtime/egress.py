"""Opt-in egress: a veth pair per sandbox, an address from a private range, NAT, and a host-side allow list.

Everything is enforced on the host: the sandbox's root owns its network namespace and may reconfigure it at
will. One nftables table per data directory, ``inet agentenv_<hash>``:

```
map egress_if        iifname -> goto sb_<slot>, one element per sandbox with egress
chain input          (hook input)   packets from a sandbox to this host's own addresses
chain forward        (hook forward) packets from a sandbox to elsewhere; nothing new into a sandbox
chain postrouting    (nat)          masquerade what leaves through another interface
chain sb_<slot>      one sandbox: IPv4 only, its own source address only, replies, allow list, else reject
```
Slot n owns addresses 4n..4n+3 of the range: 4n+1 on the host's veth (``ae<tag><n>``), 4n+2 on the
sandbox's ``eth0``, a /30 with a default route through the host. New connections of slot n carry the
conntrack mark `Slot.mark`, so detaching a slot flushes its conntrack (and NAT) entries through ctnetlink.
Forwarding: if the host had IPv4 forwarding off, the table also drops every forwarded packet that is not
a sandbox's, and forwarding goes back off when the table goes (the last egress sandbox is destroyed).
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agentenv import errors
from agentenv.limits import Network

log = logging.getLogger(__name__)

EGRESS_RANGE = "10.243.0.0/16"
"""Default private range for sandbox veths (a /30 each); `NamespaceBackend(egress_range=...)` changes it."""
TOOLS = {"nft": "nftables", "ip": "iproute2", "nsenter": "util-linux"}
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
MARK_BASE = 0xAE000000


@dataclass(frozen=True)
class Slot:
    """One sandbox's share of the range."""

    index: int
    host_if: str
    """Host-side veth name (the sandbox side is ``eth0``)."""
    host_ip: str
    sandbox_ip: str
    mark: int
    """Conntrack mark of the sandbox's connections."""


class Egress:
    """Host-side network plumbing of one data directory.

    Args:
        group: the data directory's cgroup group name (``agentenv-<12 hex>``); names the table and veths.
        home: the data directory (holds the flag that says we turned IPv4 forwarding on).
        cidr: the private IPv4 range sandboxes get their /30s from.
    """

    def __init__(self, group: str, home: Path, cidr: str = EGRESS_RANGE):
        digest = group.rsplit("-", 1)[-1]
        self.table = f"agentenv_{digest}"
        self.prefix = f"ae{digest[:4]}"
        self.tag = int(digest[:2], 16)
        try:
            self.range = ipaddress.IPv4Network(cidr)
        except ValueError as e:
            raise ValueError(f"egress_range must be an IPv4 CIDR, got {cidr!r}: {e}") from None
        if self.range.prefixlen > 28 or not self.range.is_private:
            raise ValueError(f"egress_range must be a private IPv4 range of /28 or larger, got {cidr!r}")
        self.flag = Path(home) / "egress-forwarding"

    # ---- naming -----------------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        return min(self.range.num_addresses // 4, 1 << 16)

    def slot(self, index: int) -> Slot:
        base = self.range.network_address + 4 * index
        return Slot(index, f"{self.prefix}{index:05x}", str(base + 1), str(base + 2),
                    MARK_BASE | self.tag << 16 | index)

    def check(self) -> None:
        """Raise SandboxError naming the package when a host tool egress needs is missing."""
        missing = [f"{tool} (apt-get install {pkg})" for tool, pkg in TOOLS.items() if shutil.which(tool) is None]
        if missing:
            raise errors.SandboxError(f"network egress was asked for, but the host lacks {', '.join(missing)}; install "
                                      "it, or create the sandbox with the default Network() (loopback only)")

    def allocate(self, used: set[int]) -> Slot:
        """The first free slot: not in `used`, no interface of that name, its host address not on this host."""
        for index in range(self.slots):
            if index in used:
                continue
            slot = self.slot(index)
            if not os.path.exists(f"/sys/class/net/{slot.host_if}") and not _is_local(slot.host_ip):
                return slot
        raise errors.SandboxError(f"egress range {self.range} is exhausted ({self.slots} sandboxes with egress)")

    # ---- attach / detach --------------------------------------------------------------------------------
    def attach(self, slot: Slot, pid: int, network: Network) -> None:
        """Give the sandbox whose tool server is host `pid` its veth, address, route and allow list."""
        self._ensure_table()
        t, chain = self.table, f"sb_{slot.index}"
        lines = [f"add chain inet {t} {chain}",
                 f"add rule inet {t} {chain} meta nfproto != ipv4 drop",
                 f"add rule inet {t} {chain} ip saddr != {slot.sandbox_ip} drop",
                 f"add rule inet {t} {chain} ct state established,related accept",
                 f"add rule inet {t} {chain} ct mark set {slot.mark:#x}"]
        for rule in network.rules():
            port = "" if rule.port is None else f" meta l4proto {{ tcp, udp }} th dport {rule.port}"
            lines.append(f"add rule inet {t} {chain} ip daddr {rule.net}{port} accept")
        # refuse rather than drop, so a blocked connect fails at once instead of after the agent's timeout
        lines += [f"add rule inet {t} {chain} reject with icmpx type admin-prohibited",
                  f'add element inet {t} egress_if {{ "{slot.host_if}" : goto {chain} }}']
        try:
            _run(["nft", "-f", "-"], "\n".join(lines))
            _run(["ip", "-batch", "-"], f"link add {slot.host_if} type veth peer name eth0 netns {pid}\n"
                                        f"addr add {slot.host_ip}/30 dev {slot.host_if}\n"
                                        f"link set {slot.host_if} up\n")
            _run(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-batch", "-"],
                 f"addr add {slot.sandbox_ip}/30 dev eth0\nlink set eth0 up\nroute add default via {slot.host_ip}\n")
        except BaseException:
            self.detach(slot.index)
            raise

    def detach(self, index: int) -> None:
        """Remove slot `index`'s veth, chain, map element and conntrack entries (idempotent)."""
        slot = self.slot(index)
        if os.path.exists(f"/sys/class/net/{slot.host_if}"):
            _run(["ip", "link", "del", slot.host_if], check=False)
        if shutil.which("nft") is not None:
            t, chain = self.table, f"sb_{index}"
            script = (f'delete element inet {t} egress_if {{ "{slot.host_if}" }}\n'
                      f"flush chain inet {t} {chain}\ndelete chain inet {t} {chain}\n")
            if _run(["nft", "-f", "-"], script, check=False) != 0:  # partly gone already: one by one
                for line in script.splitlines():
                    _run(["nft", line], check=False)
        try:
            flush_conntrack(slot.mark)
        except OSError as e:  # no conntrack in this kernel: nothing to flush
            log.warning("could not flush conntrack entries of %s: %s", slot.host_if, e)

    def teardown(self) -> None:
        """Delete the table (no sandbox has egress any more) and turn forwarding back off if we turned it on."""
        if shutil.which("nft") is not None and self._table_exists():
            _run(["nft", "delete", "table", "inet", self.table], check=False)
        if self.flag.exists():
            others = shutil.which("nft") is not None and "agentenv_" in _output(["nft", "list", "tables"])
            if not others:
                IP_FORWARD.write_text("0")
            self.flag.unlink(missing_ok=True)

    def reconcile(self, live: set[int]) -> int:
        """Remove the veths, chains and conntrack entries of slots not in `live`; the table too if none is.

        Returns:
            How many slots were cleaned.
        """
        stale: set[int] = set()
        if os.path.isdir("/sys/class/net"):
            for name in os.listdir("/sys/class/net"):
                if name.startswith(self.prefix) and len(name) == len(self.prefix) + 5:
                    stale.add(int(name[len(self.prefix):], 16))
        if shutil.which("nft") is not None and self._table_exists():
            table = json.loads(_output(["nft", "-j", "list", "table", "inet", self.table]))
            for item in table.get("nftables", []):
                name = item.get("chain", {}).get("name", "")
                if name.startswith("sb_") and name[3:].isdigit():
                    stale.add(int(name[3:]))
        stale -= live
        for index in sorted(stale):
            self.detach(index)
        if not live:
            self.teardown()
        return len(stale)

    # ---- the table --------------------------------------------------------------------------------------
    def _table_exists(self) -> bool:
        return _run(["nft", "list", "table", "inet", self.table], check=False) == 0

    def _ensure_table(self) -> None:
        if self._table_exists():
            return
        t, ours = self.table, f'"{self.prefix}*"'
        enable_forwarding = IP_FORWARD.read_text().strip() == "0"
        # our flag without our table: a teardown cut short after deleting the table left forwarding on for us
        guard = enable_forwarding or self.flag.exists()
        lines = [f"add table inet {t}",
                 f"add map inet {t} egress_if {{ type ifname : verdict ; }}",
                 f"add chain inet {t} input {{ type filter hook input priority -5 ; policy accept ; }}",
                 f"add chain inet {t} forward {{ type filter hook forward priority -5 ; policy accept ; }}",
                 f"add chain inet {t} postrouting {{ type nat hook postrouting priority 100 ; policy accept ; }}",
                 f"add rule inet {t} input iifname vmap @egress_if",
                 f"add rule inet {t} input iifname {ours} drop",
                 f"add rule inet {t} forward oifname {ours} ct state != {{ established, related }} drop",
                 f"add rule inet {t} forward iifname vmap @egress_if",
                 f"add rule inet {t} forward iifname {ours} drop",
                 f"add rule inet {t} postrouting ip saddr {self.range} oifname != {ours} masquerade"]
        if guard:
            # forwarding was off: keep it off for everything but sandboxes (of any agentenv data directory)
            lines.append(f'add rule inet {t} forward iifname != "ae*" oifname != "ae*" drop')
        _run(["nft", "-f", "-"], "\n".join(lines))
        if enable_forwarding:
            self.flag.touch()
            IP_FORWARD.write_text("1")


def _is_local(address: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def _run(argv: list[str], stdin: str = "", *, check: bool = True) -> int:
    proc = subprocess.run(argv, input=stdin.encode(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if check and proc.returncode != 0:
        raise errors.SandboxError(f"egress setup: {' '.join(argv)} failed ({proc.returncode}): "
                                  f"{proc.stderr.decode(errors='replace').strip()[-2000:]}")
    if proc.returncode != 0:
        log.debug("%s: %s", " ".join(argv), proc.stderr.decode(errors="replace").strip())
    return proc.returncode


def _output(argv: list[str]) -> str:
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout.decode()


def flush_conntrack(mark: int) -> None:
    """Delete every IPv4 conntrack entry (NAT state included) whose mark is `mark`, through ctnetlink."""
    ipctnl_msg_ct_delete, nfnl_subsys_ctnetlink = 2, 1
    cta_mark, cta_mark_mask = 8, 21
    nlm_f_request, nlm_f_ack, nlmsg_error = 0x1, 0x4, 0x2
    netlink_netfilter = 12  # not in Python's socket module

    def attr(kind: int, value: bytes) -> bytes:
        return struct.pack("=HH", 4 + len(value), kind) + value

    body = struct.pack("=BBH", socket.AF_INET, 0, 0) + attr(cta_mark, struct.pack("!I", mark)) \
        + attr(cta_mark_mask, struct.pack("!I", 0xFFFFFFFF))
    header = struct.pack("=IHHII", 16 + len(body), nfnl_subsys_ctnetlink << 8 | ipctnl_msg_ct_delete,
                         nlm_f_request | nlm_f_ack, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, netlink_netfilter) as s:
        s.settimeout(5.0)
        s.send(header + body)
        reply = s.recv(4096)
    _, kind = struct.unpack_from("=IH", reply)
    if kind == nlmsg_error:
        code = -struct.unpack_from("=i", reply, 16)[0]
        if code not in (0, errno.ENOENT):
            raise OSError(code, f"conntrack flush of mark {mark:#x}: {os.strerror(code)}")
