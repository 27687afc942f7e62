"""AgentEnv demo: a sandbox, its sessions, a fork with interpreter state, a snapshot/restore, one escape attempt,
then a short rollout of the RL task suite with a scripted policy (agentenv.rl.demo).

Needs root and cgroup v1 (as on the dev and CI machines); elsewhere it says so in one row. Uses its own
temporary data directory and leaves nothing behind (checked).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from k3infra.demos import DemoRow


def _ms(start: float) -> str:
    return f"{(time.perf_counter() - start) * 1e3:.1f} ms"


_CONNECT = ("import socket, sys\ns = socket.socket()\ns.settimeout(2)\n"
            "print('open' if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 'blocked')")


def _egress_row(backend) -> DemoRow:
    """Opt-in egress to one local listener: that listener is reachable, another port on the same host is not."""
    import socket

    from agentenv import Limits, Network, Sandbox

    what = "egress allow list (veth, host-side nftables)"
    if shutil.which("nft") is None:
        return DemoRow("env", what, "skipped: nft (nftables) is not installed", True)
    host_ip = backend.egress.allocate(set()).host_ip  # the host side of the next sandbox's veth
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        port = probe.getsockname()[1]
    start = time.perf_counter()
    with Sandbox.create(backend=backend, limits=Limits(network=Network(allow=(f"{host_ip}:{port}",)))) as sb:
        took = _ms(start)
        with socket.create_server((host_ip, port)), socket.create_server((host_ip, 0)) as other:
            allowed = sb.exec(["/usr/bin/python3", "-c", _CONNECT, host_ip, str(port)]).stdout.strip()
            denied = sb.exec(["/usr/bin/python3", "-c", _CONNECT, host_ip, str(other.getsockname()[1])]).stdout.strip()
    return DemoRow("env", what, f"create {took}; allowed {allowed}, other port {denied}",
                   allowed == "open" and denied == "blocked")


def run(device: str) -> list[DemoRow]:
    """Runs on the host CPU whatever ``device`` is."""
    from agentenv import Sandbox
    from agentenv.runtime import cgroups
    from agentenv.runtime.local import NamespaceBackend

    if os.geteuid() != 0 or not cgroups.available():
        return [DemoRow("env", "sandbox runtime", "skipped: needs root and cgroup v1 (memory/pids/cpu/freezer)", True)]
    home = Path(tempfile.mkdtemp(prefix="agentenv-demo-", dir="/tmp"))
    backend = NamespaceBackend(home)
    rows: list[DemoRow] = []
    try:
        Sandbox.create(backend=backend).destroy()  # start the image's seed once
        start = time.perf_counter()
        sb = Sandbox.create(backend=backend)
        rows.append(DemoRow("env", "create sandbox (host image)", _ms(start), True))
        start = time.perf_counter()
        out = sb.exec("echo hello from $(hostname)")
        rows.append(DemoRow("env", "exec `echo`", f"{out.stdout.strip()!r} in {_ms(start)}",
                            out.stdout.startswith("hello from sb-")))
        sb.python.run("import json\nmemo = {'step': 1}")
        sb.shell.run("cd /tmp && export PHASE=explore")
        sb.files.write("/root/plan.txt", "v1")
        start = time.perf_counter()
        kids = sb.fork(4)
        took = _ms(start)
        ok = all(k.python.run("memo['step']").value == "1" and k.shell.run("echo $PHASE $PWD").stdout ==
                 "explore /tmp\n" and k.files.read("/root/plan.txt") == "v1" for k in kids)
        kids[0].files.write("/root/plan.txt", "kid")
        ok = ok and sb.files.read("/root/plan.txt") == "v1" and kids[1].files.read("/root/plan.txt") == "v1"
        rows.append(DemoRow("env", "fork(4): python + shell + files carried, children isolated", took, ok))
        start = time.perf_counter()
        snap = sb.snapshot()
        took = _ms(start)
        sb.python.run("memo['step'] = 2")
        start = time.perf_counter()
        back = Sandbox.restore(snap, backend=backend)
        ok = back.python.run("memo['step']").value == "1"
        rows.append(DemoRow("env", "snapshot / restore (state as at snapshot)", f"{took} / {_ms(start)}", ok))
        escaped = sb.exec("cat /proc/1/root/etc/shadow /work 2>&1; mount -t tmpfs x /mnt 2>&1").exit_code == 0
        rows.append(DemoRow("env", "escape attempt (host files, mount)", "blocked" if not escaped else "ESCAPED",
                            not escaped))
        for s in [*kids, back, sb]:
            s.destroy()
        backend.destroy(snap)
        rows.append(_egress_row(backend))
    finally:
        backend.gc(everything=True)
        leftover = [p.name for p in (home / "layers").iterdir() if not p.name.startswith("i")]
        shutil.rmtree(home, ignore_errors=True)
    rows.append(DemoRow("env", "cleanup (gc): no layers, cgroups or processes left", "clean" if not leftover
                        else f"left {leftover}", not leftover))
    from agentenv.rl.demo import run_demo

    rows.extend(run_demo(device))  # a short scripted rollout of the task suite
    return rows
