"""Opt-in egress: a veth with a host-side allow list. Only local listeners; no packet leaves the machine."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from agentenv import Limits, Network, Sandbox, SandboxError
from agentenv.runtime.local import NamespaceBackend

PY = "/usr/bin/python3"
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
pytestmark = pytest.mark.skipif(shutil.which("nft") is None, reason="nft (nftables) is not installed")


def _connect(sb: Sandbox, host: str, port: int) -> str:
    """'CONNECTED' or 'blocked <errno>' for a TCP connect from inside `sb`."""
    code = (f"import socket\ns = socket.socket()\ns.settimeout(2)\n"
            f"try:\n    s.connect(({host!r}, {port}))\n    print('CONNECTED')\n"
            f"except OSError as e:\n    print('blocked', e.errno)")
    return sb.exec([PY, "-c", code]).stdout.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def _host_addresses() -> list[str]:
    """This host's own IPv4 addresses outside loopback and our range (listeners there are local)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    found = [line.split()[3].split("/")[0] for line in out.splitlines()]
    return [ip for ip in found if not ip.startswith("127.") and not ip.startswith("10.243.")]


def _tracked(address: str) -> list[str]:
    """Conntrack entries that name `address` (for failure messages)."""
    conntrack = Path("/proc/net/nf_conntrack")
    return [line for line in (conntrack.read_text() if conntrack.exists() else "").splitlines() if address in line]


def _state(backend: NamespaceBackend, index: int) -> dict:
    """Which of slot `index`'s host-side pieces exist."""
    slot = backend.egress.slot(index)
    rules = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
    conntrack = Path("/proc/net/nf_conntrack")
    tracked = conntrack.read_text() if conntrack.exists() else ""
    return {"veth": os.path.exists(f"/sys/class/net/{slot.host_if}"), "chain": f"chain sb_{index} " in rules,
            "element": f'"{slot.host_if}"' in rules, "conntrack": f"src={slot.sandbox_ip} " in tracked,
            "table": backend.egress.table in rules}


@pytest.fixture
def egress_backend(leak_report):
    home = Path(tempfile.mkdtemp(prefix="agentenv-egress-", dir="/tmp"))
    backend = NamespaceBackend(home)
    forward_before = IP_FORWARD.read_text()
    yield backend
    backend.gc(everything=True)
    left = leak_report(home)
    assert not any(left.values()), f"leaked: {left}"
    rules = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
    assert backend.egress.table not in rules
    assert not [n for n in os.listdir("/sys/class/net") if n.startswith(backend.egress.prefix)]
    assert IP_FORWARD.read_text() == forward_before
    shutil.rmtree(home, ignore_errors=True)


def _egress_sandbox(backend: NamespaceBackend, allow: list[str]) -> tuple[Sandbox, int]:
    sb = Sandbox.create(backend=backend, limits=Limits(network=Network(allow=allow)))
    return sb, backend.store.read_record(sb.id).net["slot"]


def _sandbox_allowed_one_port(backend: NamespaceBackend) -> tuple[Sandbox, int, str, int]:
    """A sandbox allowed to reach one free port on the host side of the veth it gets: (sandbox, slot, ip, port)."""
    host_ip = backend.egress.allocate(set()).host_ip  # the host side of the veth the next sandbox gets
    port = _free_port()
    sb, index = _egress_sandbox(backend, [f"{host_ip}:{port}"])
    return sb, index, host_ip, port


def test_allowed_listener_is_reachable_and_nothing_else(egress_backend):
    backend = egress_backend
    sb, index, host_ip, port = _sandbox_allowed_one_port(backend)
    listeners = []
    try:
        assert backend.egress.slot(index).host_ip == host_ip
        allowed = socket.create_server((host_ip, port))
        other = socket.create_server((host_ip, 0))
        any_addr = socket.create_server(("0.0.0.0", 0))
        listeners += [allowed, other, any_addr]
        assert _connect(sb, host_ip, port) == "CONNECTED"
        assert _connect(sb, host_ip, other.getsockname()[1]).startswith("blocked")
        assert _connect(sb, host_ip, any_addr.getsockname()[1]).startswith("blocked")
        for ip in _host_addresses():
            assert _connect(sb, ip, any_addr.getsockname()[1]).startswith("blocked"), ip
        assert _connect(sb, "127.0.0.1", any_addr.getsockname()[1]).startswith("blocked")  # its own loopback
        # root inside may re-address its eth0: the host still lets only the assigned source address through
        spoof = backend.egress.slot(index + 1).sandbox_ip
        changed = sb.exec(f"ip addr flush dev eth0 && ip addr add {spoof}/16 dev eth0 && "
                          f"ip route replace default dev eth0")
        assert changed.exit_code == 0, changed.stderr
        assert _connect(sb, host_ip, port).startswith("blocked")
    finally:
        for s in listeners:
            s.close()
        sb.destroy()


def test_default_policy_has_no_route_to_an_egress_veth(egress_backend):
    backend = egress_backend
    sb, _, host_ip, port = _sandbox_allowed_one_port(backend)
    plain = Sandbox.create(backend=backend)
    try:
        with socket.create_server((host_ip, port)), socket.create_server(("0.0.0.0", 0)) as any_addr:
            assert _connect(sb, host_ip, port) == "CONNECTED"
            assert "eth0" not in plain.exec("cat /proc/net/dev").stdout
            for ip in (host_ip, *_host_addresses()):
                assert _connect(plain, ip, port).startswith("blocked"), ip
                assert _connect(plain, ip, any_addr.getsockname()[1]).startswith("blocked"), ip
    finally:
        plain.destroy()
        sb.destroy()


def test_fork_and_restore_get_their_own_veth_and_the_same_policy(egress_backend):
    backend = egress_backend
    sb, index, host_ip, port = _sandbox_allowed_one_port(backend)
    made = [sb]
    try:
        (kid,) = sb.fork(1)
        made.append(kid)
        snap = sb.snapshot()
        restored = Sandbox.restore(snap, backend=backend)
        made.append(restored)
        backend.destroy(snap)
        slots = {backend.store.read_record(s.id).net["slot"] for s in made}
        assert len(slots) == 3
        with socket.create_server((host_ip, port)):
            for each in made:  # the same allow list, each through its own veth and source address
                assert _connect(each, host_ip, port) == "CONNECTED"
            for other in (kid, restored):
                rec = backend.store.read_record(other.id)
                theirs = backend.egress.slot(rec.net["slot"])
                assert f"inet {theirs.sandbox_ip}/30" in other.exec("ip -4 addr show eth0").stdout
                with socket.create_server((theirs.host_ip, port)):  # not on the allow list
                    assert _connect(other, theirs.host_ip, port).startswith("blocked")
    finally:
        for s in reversed(made):
            s.destroy()


def test_destroy_and_gc_remove_veth_rules_and_conntrack(egress_backend):
    backend = egress_backend
    sb, index, host_ip, port = _sandbox_allowed_one_port(backend)
    with socket.create_server((host_ip, port)):
        assert _connect(sb, host_ip, port) == "CONNECTED"
        assert _state(backend, index) == {"veth": True, "chain": True, "element": True, "conntrack": True,
                                          "table": True}
        sb.destroy()
    # the last egress sandbox also took the table along
    assert not any(_state(backend, index).values()), _tracked(backend.egress.slot(index).sandbox_ip)

    # a runtime that died half-way: the record is gone, the veth and rules are not; then a killed tool server
    lost, lost_index = _egress_sandbox(backend, [f"{host_ip}:{port}"])
    dead, dead_index = _egress_sandbox(backend, ["192.0.2.0/24"])
    backend.store.delete_record(lost.id)
    os.kill(backend.store.read_record(dead.id).pid, signal.SIGKILL)
    time.sleep(0.2)
    assert _state(backend, lost_index)["veth"] and _state(backend, dead_index)["chain"]
    backend.gc()
    assert not any(_state(backend, lost_index).values()), _tracked(backend.egress.slot(lost_index).sandbox_ip)
    assert not any(_state(backend, dead_index).values()), _tracked(backend.egress.slot(dead_index).sandbox_ip)


def test_egress_without_nft_fails_clearly_and_leaves_nothing(egress_backend, monkeypatch, tmp_path, leak_report):
    (tmp_path / "bin").mkdir()
    for tool in ("ip", "nsenter"):
        os.symlink(shutil.which(tool), tmp_path / "bin" / tool)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(SandboxError, match="nftables"):
        Sandbox.create(backend=egress_backend, limits=Limits(network=Network(allow=["192.0.2.0/24"])))
    monkeypatch.undo()
    left = leak_report(egress_backend.store.home)
    assert [r for r in left["records"] if not r.startswith("seed-")] == []


def test_fork_past_the_range_reclaims_every_child_and_its_connection(egress_backend):
    # a /28 holds 4 slots: the parent takes one, so the fourth child of fork(4) finds the range exhausted
    backend = NamespaceBackend(egress_backend.store.home, egress_range="10.243.255.240/28")
    sb = Sandbox.create(backend=backend, limits=Limits(network=Network(allow=["192.0.2.0/24"])))
    try:
        before = {r.id for r in backend.store.all_records()}
        with pytest.raises(SandboxError, match="exhausted"):
            sb.fork(4)
        assert backend._pending == {}  # the children handed out before the failure are closed, not kept
        assert {r.id for r in backend.store.all_records() if r.kind == "sandbox"} <= before
        assert [r.net for r in backend.store.all_records() if r.net] == [{"slot": 0}]
    finally:
        sb.destroy()


def test_table_rebuilt_after_a_cut_teardown_still_guards_forwarding(egress_backend):
    backend = egress_backend
    guard = 'iifname != "ae*" oifname != "ae*" drop'
    if IP_FORWARD.read_text().strip() != "0":
        pytest.skip("IPv4 forwarding is already on here: the runtime neither turns it on nor guards it")
    sb, _ = _egress_sandbox(backend, ["192.0.2.0/24"])
    try:
        assert backend.egress.flag.exists()
        # a teardown cut short after deleting the table: forwarding still on, our flag still there
        subprocess.run(["nft", "delete", "table", "inet", backend.egress.table], check=True)
        again, _ = _egress_sandbox(backend, ["192.0.2.0/24"])
        again.destroy()  # not the last egress sandbox: the table stays
        rules = subprocess.run(["nft", "list", "table", "inet", backend.egress.table], capture_output=True,
                               text=True).stdout
        assert guard in rules
    finally:
        sb.destroy()


def test_destroyed_parent_with_live_forks_gives_up_its_veth(egress_backend):
    backend = egress_backend
    sb, index = _egress_sandbox(backend, ["192.0.2.0/24"])
    (kid,) = sb.fork(1)
    try:
        kid_index = backend.store.read_record(kid.id).net["slot"]
        sb.destroy()  # retired: its tool server stays while the fork nests below it
        assert backend.store.read_record(sb.id).kind == "retired"
        left = _state(backend, index)
        assert not left["veth"] and not left["chain"] and not left["element"], left
        assert _state(backend, kid_index)["veth"] and _state(backend, kid_index)["chain"]
    finally:
        kid.destroy()
    assert not any(_state(backend, kid_index).values())
