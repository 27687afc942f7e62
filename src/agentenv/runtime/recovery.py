"""Garbage collection: reclaim dead, expired and orphaned state, and finish or undo interrupted forks.

A mixin of `agentenv.runtime.local.NamespaceBackend` (uses its store, cgroups, egress and release steps).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from agentenv import errors
from agentenv.limits import Limits
from agentenv.runtime import cgroups
from agentenv.runtime.client import Connection
from agentenv.runtime.store import drain_releases

log = logging.getLogger(__name__)


class Recovery:
    """`gc` and the recovery of forks whose runtime died."""

    def gc(self, *, everything: bool = False) -> dict:
        """Reclaim dead, expired and orphaned state; with `everything`, stop every sandbox and seed too.

        Returns:
            Counts of what was removed: ``records``, ``cgroups``, ``layers``, ``network`` (egress slots).
        """
        removed = {"records": 0, "cgroups": 0, "layers": 0}
        self.settle()
        with self.store.locked():
            removed["forks"] = self._recover_forks()
            for conn in self._pending.values():
                conn.close()
            self._pending.clear()
            now = time.time()
            records = self.store.all_records()
            for rec in sorted(records, key=lambda r: -r.created):
                if self.store.read_record(rec.id) is None:
                    continue  # released with a child above
                expired = rec.kind == "sandbox" and rec.expires_at is not None and rec.expires_at <= now
                if everything or not self._alive(rec):
                    # a dead pid 1 took every sandbox forked below it along; the records go too
                    self._reclaim(rec)
                    removed["records"] += 1
                elif expired or (rec.kind == "retired" and not self._children(rec.id)):
                    self._release(rec)
                    removed["records"] += 1
            self.store.remove_dead_writes()  # a runtime killed inside write_record
            live = {r.id for r in self.store.all_records()}
            for names in cgroups.leftover_groups(self.cgroup_group, self.cgroup_root).values():
                for name in names:
                    if name not in live:
                        self._cgroup(name).destroy()
                        removed["cgroups"] += 1
            in_use = self.store.referenced_layers()
            for layer in self.store.layer_ids():
                if layer not in in_use and (not layer.startswith("i") or layer.startswith(".")):
                    self.store.remove_layer(layer)
                    removed["layers"] += 1
            removed["network"] = self.egress.reconcile({r.net["slot"] for r in self.store.all_records() if r.net})
            for sock in self.store.records.glob("*.sock"):
                if sock.stem not in live:
                    sock.unlink(missing_ok=True)
            drain_releases()  # removed layers' filesystems torn down, their loop devices released
            if not live:
                for controller in cgroups.CONTROLLERS:
                    try:
                        (self.cgroup_root / controller / self.cgroup_group).rmdir()
                    except OSError:  # absent, or a sandbox appeared meanwhile
                        pass
        return removed


    def _recover_forks(self) -> int:
        """Finish or undo the forks whose runtime died midway (see `Store.begin_fork`); returns how many.

        The parent's tool server knows the outcome: ``done``/``moved`` (it answered, and moved onto its new
        layer when asked): the children stay, joined to their cgroups now if the dead runtime had not done it
        yet. Anything else (it killed the children when the runtime vanished, never got the request, or is
        dead itself): the children's records go and the parent's record is put back as before the fork.
        """
        recovered = 0
        for fork_id, writer_alive, parent, child_ids in self.store.pending_forks():
            if writer_alive:
                continue
            live = self.store.read_record(parent.id)
            outcome = "unknown"
            if live is not None and live.kind != "retired" and self._alive(live):
                try:
                    conn = Connection(self.store.sock(parent.id), parent.id)
                    try:
                        outcome = conn.request({"op": "fork_outcome", "fork_id": fork_id}, timeout_s=10.0)[0]["outcome"]
                    finally:
                        conn.close()
                except errors.SandboxError as e:
                    log.warning("fork %s of %s: asking the parent failed: %s", fork_id, parent.id, e)
            for cid in child_ids:
                rec = self.store.read_record(cid)
                if rec is None:
                    self._kill_unrecorded(cid)
                elif outcome in ("done", "moved") and self._alive(rec):
                    cg = self._cgroup(cid)
                    lim = Limits.from_dict(rec.limits)
                    cg.create(cgroups.CgroupLimits(lim.memory_mb << 20, lim.pids, lim.cpus))
                    try:
                        cg.add(rec.pid)
                    except ProcessLookupError:  # it died since `_alive`: reclaimed like any dead sandbox
                        self._reclaim(rec)
                        continue
                    self._adopt_carried(cg, rec.pid, parent.id)
                else:
                    self._reclaim(rec)
            if outcome not in ("done", "moved") and live is not None and live.upper != parent.upper:
                self.store.write_record(dataclasses.replace(live, lowers=parent.lowers, upper=parent.upper))
            self.store.end_fork(fork_id)
            log.info("fork %s of %s, cut short by its runtime's death: %s", fork_id, parent.id,
                     "kept" if outcome in ("done", "moved") else "undone")
            recovered += 1
        return recovered

    def _adopt_carried(self, cg: cgroups.Cgroup, child_pid: int, parent_id: str) -> None:
        """Move into `cg` the processes of the child's pid namespace still in the parent's cgroup: Python kernels
        carried into the fork, which the dead runtime had not moved yet."""
        try:
            child_ns = os.readlink(f"/proc/{child_pid}/ns/pid")
        except OSError:  # gone meanwhile
            return
        for pid in self._cgroup(parent_id).pids():
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") == child_ns:
                    cg.add(pid)
            except OSError:  # exited meanwhile
                continue

    def _kill_unrecorded(self, sid: str) -> None:
        """Kill a tool server that has a socket but no record (cloned, then its runtime died)."""
        path = self.store.sock(sid)
        if not path.exists():
            return
        try:
            conn = Connection(path, sid)
            try:
                os.kill(conn.peer_pid(), 9)
            finally:
                conn.close()
        except (errors.SandboxError, OSError):  # gone meanwhile
            pass
        path.unlink(missing_ok=True)
