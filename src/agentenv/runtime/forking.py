"""The host's side of a fork (create, fork, snapshot and restore are all forks of a tool server).

A mixin of `agentenv.runtime.local.NamespaceBackend`. Each fork is journaled first (`Store.begin_fork`), so a
runtime that dies midway leaves what `Recovery.gc` needs to finish or undo it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time

from agentenv import errors
from agentenv.limits import Limits
from agentenv.runtime import cgroups, spawner
from agentenv.runtime.client import Connection
from agentenv.runtime.store import Record, proc_start_time

log = logging.getLogger(__name__)

SNAPSHOT_LAYER_BYTES = 1 << 20
"""Writable layer of a snapshot's tool server: it serves only forks, so nothing is written there."""


def _new_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(6).hex()}"


class Forking:
    """`_fork`: clone a tool server into children over new layers, with the records, cgroups and network."""

    def _fork(self, parent: Record, kinds: list[str], limits: Limits, *, rebase: bool, ttl_s: float | None,
              image: str | None = None) -> list[Record]:
        ids = [_new_id("snap" if kind == "snapshot" else "sb") for kind in kinds]
        fork_id = os.urandom(8).hex()
        journal = self.store.begin_fork(fork_id, parent, ids)
        try:
            return self._fork_journaled(fork_id, parent, kinds, ids, limits, rebase=rebase, ttl_s=ttl_s, image=image)
        finally:
            journal.unlink(missing_ok=True)

    def _fork_journaled(self, fork_id: str, parent: Record, kinds: list[str], ids: list[str], limits: Limits, *,
                        rebase: bool, ttl_s: float | None, image: str | None) -> list[Record]:
        store = self.store
        clock = _Clock()
        before = dataclasses.replace(parent)
        lowers = list(parent.lowers)
        with_net = limits.network.egress and "sandbox" in kinds
        if with_net:
            self.egress.check()  # before anything is made
        # moving: the parent's writable layer is sealed (becomes the top lower of every child) and the parent
        # moves onto a new one, which the host prepares while the tool server clones (see `move` below)
        moving = rebase and not store.is_empty(parent.upper)
        if moving:
            lowers = [parent.upper, *lowers]
        new_parent_upper: str | None = None
        now = time.time()
        children: list[Record] = []
        listeners: list[socket.socket] = []
        opened: list[int] = []
        conns: dict[str, Connection] = {}
        sent_move = False
        try:
            for kind, cid in zip(kinds, ids):
                if kind == "snapshot":  # runs no agents, so writes nothing: a token tmpfs, not a disk
                    upper = store.new_writable_layer(SNAPSHOT_LAYER_BYTES, in_memory=True)
                else:
                    upper = store.new_writable_layer(limits.disk_mb << 20, in_memory=limits.disk_in_memory)
                children.append(Record(cid, kind, image or parent.image, 0, 0, parent.id, lowers, upper,
                                       parent.usr_bind, limits.to_dict(), now,
                                       None if ttl_s is None else now + ttl_s, owner=self.owner))
                listeners.append(self._listener(cid))
            cg_limits = cgroups.CgroupLimits(limits.memory_mb << 20, limits.pids, limits.cpus)
            self._prepare_later([self._cgroup(c.id) for c in children], cg_limits)
            clock.mark("layers_ms")

            def root(upper: str) -> int:
                fd = self._overlay(lowers, upper)
                opened.append(fd)
                return fd

            # a snapshot cloned before its parent moves off the sealed layer stays in the sealed root
            own_root = [c.kind == "sandbox" or not moving for c in children]
            fds: list[int] = []
            for child, listener, own in zip(children, listeners, own_root):
                fds += [root(child.upper), listener.fileno()] if own else [listener.fileno()]
            clock.mark("overlays_ms")
            move_fd = -1

            def prepare_move() -> None:
                nonlocal new_parent_upper, move_fd
                new_parent_upper = store.new_writable_layer(int(parent.limits.get("disk_mb", 1024)) << 20,
                                                            in_memory=bool(parent.limits.get("disk_in_memory")))
                move_fd = root(new_parent_upper)
                # written now, reverted below if the tool server does not answer the fork
                store.write_record(dataclasses.replace(parent, lowers=lowers, upper=new_parent_upper))

            conn = Connection(store.sock(parent.id), parent.id)
            try:
                # the host's bookkeeping runs here, while the tool server sets its children up
                def on_child(event: dict, pid: int | None) -> None:
                    child = children[int(event["index"])]
                    if pid is None:
                        raise errors.SandboxError(f"fork of {parent.id}: no pid for child {child.id}")
                    if event["ev"] == "kernel":  # a Python kernel carried into the child: into its cgroup too
                        self._add_later(self._cgroup(child.id), pid)
                        return
                    child.pid = pid
                    child.start_time = proc_start_time(pid) or 0
                    self._attach_later(self._cgroup(child.id), pid, cg_limits)
                    store.write_record(child)
                    conns[child.id] = Connection(store.sock(child.id), child.id)
                    if moving and new_parent_upper is None:
                        prepare_move()

                reply, _ = conn.request({"op": "fork", "fork_id": fork_id, "rebase": moving,
                                         "usr_bind": parent.usr_bind,
                                         "children": [{"id": c.id, "deadline": c.expires_at, "own_root": own,
                                                       "nproc": spawner.nproc_for(limits.pids),
                                                       "memory_bytes": limits.memory_mb << 20}
                                                      for c, own in zip(children, own_root)]},
                                        fds=fds, timeout_s=30.0, on_child=on_child)
                if moving:
                    if new_parent_upper is None:
                        prepare_move()
                    # the tool server reads this before any other request and moves onto the new layer; without
                    # it (we fail or die first) it kills the children and stays where it is
                    conn.send({"op": "move"}, fds=[move_fd])
                    sent_move = True
            finally:
                conn.close()
            clock.mark("request_ms")
            if moving:
                parent.lowers, parent.upper = lowers, new_parent_upper
            if reply.get("failed"):  # the parent moves, but some children did not come up
                raise errors.SandboxError(f"fork of {parent.id}: {'; '.join(reply['failed'])}")
            used = {r.net["slot"] for r in store.all_records() if r.net} if with_net else set()
            for child in children:
                cconn = conns.pop(child.id, None) or Connection(store.sock(child.id), child.id)
                if not child.pid:  # a tool server that sent no child event: ask the child itself
                    child.pid = cconn.peer_pid()
                    child.start_time = proc_start_time(child.pid) or 0
                    self._attach_later(self._cgroup(child.id), child.pid, cg_limits)
                    store.write_record(child)
                if with_net and child.kind == "sandbox":
                    slot = self.egress.allocate(used)
                    used.add(slot.index)
                    child.net = {"slot": slot.index}
                    store.write_record(child)  # before the veth exists, so gc finds the slot if we die
                    self.egress.attach(slot, child.pid, limits.network)
                if child.kind == "sandbox":
                    self._pending[child.id] = cconn
                else:
                    cconn.close()
            clock.mark("records_ms")
            for child in children:
                self.settle(child.id)
            clock.mark("settle_ms")
            self.last_fork_phases = {**clock.phases, "tool_server": reply.get("phases")}
            log.debug("fork of %s (%d lower layers): %s", parent.id, len(lowers), self.last_fork_phases)
        except BaseException:
            for cconn in conns.values():
                cconn.close()
            for child in children:  # children handed to _pending before a later child failed (egress, settle)
                pending = self._pending.pop(child.id, None)
                if pending is not None:
                    pending.close()
                self._reclaim(child)
            if new_parent_upper is not None and not sent_move:
                store.write_record(before)  # the parent did not move: its record as before the fork
                store.remove_layer(new_parent_upper)
            raise
        finally:
            for fd in opened:
                os.close(fd)
            for listener in listeners:
                listener.close()
        return children


class _Clock:
    """Milliseconds between successive `mark` calls."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round((now - self._last) * 1e3, 3)
        self._last = now
