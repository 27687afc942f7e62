"""Fork as a zygote: the tool server's side of `fork` (children cloned into fresh namespaces, then moved).

A mixin of `agentenv.runtime.toolserver.ToolServer`. The tool server `fork()`s once per child straight into
fresh user, mount, pid, net, uts, ipc and cgroup namespaces (`syscalls.fork_into_namespaces`); each child
mounts the root the host prepared and serves its own listener, the live Python kernels put a copy of
themselves into it (`kernels.Kernels.carry`), and the parent, when asked, moves onto a new writable layer
right after answering. Stdlib only.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import time

from agentenv import protocol
from agentenv.runtime import kernels, rootfs
from agentenv.runtime import syscalls as sc

NS_SANDBOX = sc.CLONE_NEWNS | sc.CLONE_NEWPID | sc.CLONE_NEWNET | sc.CLONE_NEWUTS | sc.CLONE_NEWIPC | sc.CLONE_NEWCGROUP
FORK_OWNER_UID = 65533
"""Owner (in our user namespace) of each forked child's user namespace; no process of ours runs as it."""
ROLL_BACK_TIMEOUT_S = 30.0
"""Longest wait for the killed children of an undone fork to exit."""


class RequestError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Zygote:
    """`op_fork`, the move after it, and what became of a fork (`op_fork_outcome`)."""

    def op_fork(self, conn, req, blob, fds):
        """Fork one sandbox per entry of `children`, then (if `rebase`) move onto a new writable layer.

        fds: per child its root mount (unless the child's ``own_root`` is false) and its listening socket;
        with `rebase`, the host sends our own new root in a ``move`` frame after our answer (it builds
        that root while we clone). Children are cloned before the parent moves, so a child without its own
        root (a snapshot: it never serves agents, only forks) keeps the sealed root it was cloned in, and no
        agent of the parent runs meanwhile to change it. We answer once every child is ready (or failed:
        ``failed``) and move right after answering (`_finish_move`), before any further request; the
        reply's ``previous_move_ms`` is how long the last move took.
        """
        rebase = bool(req.get("rebase"))
        children = req["children"]
        clock = [time.perf_counter()]
        phases = {}

        def mark(name: str) -> None:
            now = time.perf_counter()
            phases[name] = (now - clock[0]) * 1e3
            clock[0] = now

        started: list[tuple[int, int, dict]] = []
        channels: list = []
        namespaces: list[list[int]] = []
        pids: list[int] = []
        # from the first clone on, a failure (the host gone while we tell it a child's or kernel's pid) kills
        # every child cloned so far: only an answered fork may be kept (`fork_outcome` says which it was)
        self._fork = (req.get("fork_id"), pids)
        try:
            self.shell.dump_state()
            self.shell.close()
            if rebase:
                self.kill_agents()
            mark("shell_ms")
            channels = self.kernels.channels_for(len(children))
            at = 0
            for index, child in enumerate(children):
                root_fd = None
                if child.get("own_root", True):
                    root_fd = fds[at]
                    at += 1
                listen_fd = fds[at]
                at += 1
                started.append(self._clone_child(index, child, root_fd, listen_fd, req["usr_bind"], conn, fds,
                                                 [r for _, r, _ in started], channels, namespaces))
            mark("children_ms")
            failures = []
            while started:
                failures.append(self._await_child(*started.pop(0)))
            mark("ready_ms")
            for index, child in enumerate(children):
                carried = self.kernels.carry(channels[index], namespaces[index], child.get("memory_bytes"),
                                             child.get("nproc"))
                for kernel_pid in carried:  # the host moves it into the child's cgroup
                    protocol.send_msg(conn, {"ev": "kernel", "index": index}, creds_pid=kernel_pid)
            channels = []
            mark("kernels_ms")
            phases["previous_move_ms"] = self.last_move_ms
            phases["last_child"] = getattr(self, "last_child_phases", {})
            phases["last_kernel"] = self.kernels.last_carry_phases
            if rebase:
                self._pending_move = (conn, bool(req["usr_bind"]))
        except BaseException:
            self._pending_move = None
            self._roll_back_fork()
            raise
        finally:
            for fd in fds:
                os.close(fd)
            for _, r_ready, _ in started:
                os.close(r_ready)
            for pairs in channels:
                for _, ours, theirs in pairs:
                    ours.close()
                    theirs.close()
            for ns_fds in namespaces:
                for fd in ns_fds:
                    os.close(fd)
        # we move after answering (if asked to): failed children are reported, not raised, so the host knows
        failed = [f"child {children[i]['id']} failed: {f}" for i, f in enumerate(failures) if f]
        return {"pids": pids, "phases": phases, "failed": failed}, b""

    def _clone_child(self, index, child, root_fd, listen_fd, usr_bind, conn, all_fds, siblings, channels,
                     namespaces) -> tuple:
        """Clone one child into fresh namespaces, write its id maps, name it to the host.

        Returns:
            ``(pid, ready_fd, timings)``; `_await_child` reads the child's readiness from ``ready_fd``.
        """
        r_map, w_map = os.pipe()
        r_ready, w_ready = os.pipe()
        t0 = time.perf_counter()
        pid = -1
        try:
            # the child must be dumpable while we write its uid map (else its /proc files belong to the host's
            # root); otherwise tool servers stay non-dumpable, so agents cannot open /proc/1/mem or /proc/1/fd
            # the child's user namespace is owned by FORK_OWNER_UID, not by our root, so its processes count
            # against that user's RLIMIT_NPROC here (the kernel charges every process up the namespace chain to
            # each namespace's owner): a fork bomb in the child leaves our agents their own share
            os.setresuid(-1, FORK_OWNER_UID, -1)  # effective caps drop; permitted stay (uid and saved uid are 0)
            sc.prctl(sc.PR_SET_DUMPABLE, 1)
            try:
                pid = sc.fork_into_namespaces(sc.CLONE_NEWUSER | NS_SANDBOX)
            finally:
                if pid != 0:
                    os.setresuid(-1, 0, -1)  # effective caps back from the permitted set
                    sc.prctl(sc.PR_SET_DUMPABLE, 1)
        except OSError as e:
            sc.prctl(sc.PR_SET_DUMPABLE, 0)
            os.close(r_map)
            os.close(w_map)
            os.close(r_ready)
            os.close(w_ready)
            if e.errno in (errno.ENOSPC, errno.EUSERS):
                raise RequestError("invalid", "fork depth limit: forked sandboxes nest their user and pid "
                                   "namespaces (at most 32 levels); fork from an earlier generation instead") from e
            raise
        if pid == 0:  # child: pid 1 of fresh user, mount, pid, net, uts, ipc and cgroup namespaces
            code = 1
            try:
                t1 = time.perf_counter()
                os.close(w_map)
                os.close(r_ready)
                for fd in siblings:  # earlier siblings' readiness pipes
                    os.close(fd)
                for ns_fds in namespaces:
                    for fd in ns_fds:
                        os.close(fd)
                if os.read(r_map, 1) != b"m":
                    os._exit(1)
                os.setresuid(0, 0, 0)  # root of our namespace (we were cloned as FORK_OWNER_UID, see above)
                sc.prctl(sc.PR_SET_DUMPABLE, 0)
                t2 = time.perf_counter()
                if root_fd is not None:
                    rootfs.enter_root(root_fd, usr_bind=usr_bind, hostname=child["id"][:63])
                else:  # the parent's /proc shows the parent's pid namespace; ours is needed to map our children
                    sc.mount("proc", "/proc", "proc", sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC)
                t3 = time.perf_counter()
                if root_fd is not None:
                    rootfs.loopback_up()
                t4 = time.perf_counter()
                listener = socket.socket(fileno=listen_fd)
                for fd in all_fds:
                    if fd != listen_fd:
                        os.close(fd)
                conn.close()
                self.listener.close()
                for c in self.conns:
                    c.close()
                self.conns = []
                self.spawner.forget()  # the parent's launcher is not ours (nor visible) in the new pid namespace
                self.spawner.nproc = child.get("nproc")
                self.kernels.enter_child(index, channels)
                self.kernels.memory_bytes = child.get("memory_bytes")
                self.kernels.nproc = child.get("nproc")
                self.id = child["id"]
                self.deadline = child.get("deadline")
                self.listener = listener
                self.own_pidns = os.readlink("/proc/self/ns/pid")
                self.retired = False
                self._fork = None  # the parent's fork, not ours
                # child_ms: from before the clone until the child runs (page tables, namespaces, scheduling)
                phases = {"child_ms": (t1 - t0) * 1e3, "map_ms": (t2 - t1) * 1e3, "root_ms": (t3 - t2) * 1e3,
                          "lo_ms": (t4 - t3) * 1e3, "setup_ms": (time.perf_counter() - t4) * 1e3}
                os.write(w_ready, b"r" + json.dumps(phases).encode())
                os.close(w_ready)
                self.serve()
            except BaseException as e:  # report to the parent; never return into its loop
                try:
                    os.write(w_ready, f"E{type(e).__name__}: {e}".encode()[:4000])
                except OSError:
                    pass
            os._exit(code)
        t_clone = time.perf_counter()
        self._fork[1].append(pid)
        os.close(r_map)
        os.close(w_ready)
        try:
            for name, line in (("uid_map", "0 0 65536\n"), ("gid_map", "0 0 65536\n")):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(line)
            # our kernels join the child's namespaces later, by these (opened while the child is dumpable)
            namespaces.append(kernels.open_namespaces(pid) if channels[index] else [])
            sc.prctl(sc.PR_SET_DUMPABLE, 0)
            os.write(w_map, b"m")
            # tell the host the child's pid now (translated by the kernel), so it can move the child into its
            # cgroup while the child mounts its root
            protocol.send_msg(conn, {"ev": "child", "index": index}, creds_pid=pid)
        except BaseException:
            os.close(r_ready)
            raise
        finally:
            os.close(w_map)
        t_sent = time.perf_counter()
        return pid, r_ready, {"clone_ms": (t_clone - t0) * 1e3, "maps_ms": (t_sent - t_clone) * 1e3, "sent": t_sent}

    def _await_child(self, pid: int, r_ready: int, timings: dict) -> str:
        """Wait for a cloned child to serve (closes `r_ready`); returns its error message, or "" when ready."""
        try:
            status = os.read(r_ready, 4096)
        finally:
            os.close(r_ready)
        if status[:1] != b"r":
            return status[1:].decode(errors="replace") or f"child {pid} exited during setup"
        sent = timings.pop("sent")
        self.last_child_phases = {**json.loads(status[1:] or b"{}"), **timings,
                                  "wait_ms": (time.perf_counter() - sent) * 1e3}
        return ""

    def _finish_move(self) -> None:
        """After answering a fork: read the host's ``move`` (our new root) on that connection and enter it.

        Nothing of ours runs meanwhile (agents were killed for the fork, and no other request is read
        first), so every request after a fork or snapshot sees the new writable layer. If the move does
        not come or fails, we stop serving for good rather than write to the sealed layer.
        """
        conn, usr_bind = self._pending_move
        self._pending_move = None
        start = time.perf_counter()
        fds: list[int] = []
        try:
            try:
                req, _, fds = protocol.recv_msg(conn)
            except (protocol.ConnectionClosed, OSError):
                # the host is gone before sending our new root: undo the fork (its children die, we stay on
                # our layer, which nothing else reads then)
                self._roll_back_fork()
                return
            if req.get("op") != "move" or len(fds) != 1:
                raise RequestError("invalid", f"expected the move after a fork, got {req.get('op')!r}")
            rootfs.enter_root(fds[0], usr_bind=usr_bind, hostname=None)
            self._settle_fork("moved")
            self.kernels.after_move()
        except BaseException:
            # still on the sealed layer, which the forks and snapshots now read: never write to it again
            self.broken = True
            self._expire(self._sel)
        finally:
            for fd in fds:
                os.close(fd)
        self.last_move_ms = (time.perf_counter() - start) * 1e3

    def _settle_fork(self, outcome: str) -> None:
        fork_id, _ = self._fork
        self._fork = None
        if fork_id:
            self.fork_outcomes[fork_id] = outcome
            while len(self.fork_outcomes) > 64:
                self.fork_outcomes.pop(next(iter(self.fork_outcomes)))

    def _roll_back_fork(self) -> None:
        """Kill the children of the fork in progress (each is pid 1 of its namespaces: all of it dies).

        A killed pid 1 exits only once every process of its pid namespace is reaped, and the copies of our
        kernels carried into a child are our children (the middle process that forked them exited), so we
        reap whatever exits until the children are gone: waiting on a child's pid alone would wait forever.
        """
        _, pids = self._fork
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        left = set(pids)
        deadline = time.monotonic() + ROLL_BACK_TIMEOUT_S
        while left:
            self._reap()
            left = {pid for pid in left if os.path.exists(f"/proc/{pid}")}
            if not left or time.monotonic() > deadline:  # past it: gone from our view; the host's gc kills the rest
                break
            time.sleep(0.001)
        self._settle_fork("rolled_back")

    def op_fork_outcome(self, conn, req, blob, fds):
        """What became of fork `fork_id`: ``done`` (answered), ``moved`` (answered and moved onto the new
        layer), ``rolled_back`` (the host vanished first: its children were killed) or ``unknown``."""
        return {"outcome": self.fork_outcomes.get(str(req.get("fork_id")), "unknown")}, b""
