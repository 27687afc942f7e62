"""Seeds: one pristine tool server per image, started on the host, that new sandboxes are forked from.

A mixin of `agentenv.runtime.local.NamespaceBackend` (uses its store, cgroups, listeners and overlays).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

from agentenv import errors
from agentenv.limits import Limits
from agentenv.runtime import cgroups, images
from agentenv.runtime.client import Connection
from agentenv.runtime.store import HOST_UID, UID_RANGE, Record, proc_start_time

# A new sandbox is cloned inside its seed's cgroup and moved to its own right after; what the kernel charged
# meanwhile (page tables, namespace objects: about 1 MB a sandbox here) stays on the seed's memory cgroup for
# the sandbox's lifetime, so the seed gets no memory limit: an OOM kill there would take every sandbox along
# (their pid namespaces nest in the seed's).
SEED_LIMITS = Limits(memory_mb=1 << 20, pids=4096, cpus=0, disk_mb=16, disk_in_memory=True)
SEED_START_TIMEOUT_S = 20.0
HOST_PYTHON = "/usr/bin/python3"
_SRC = str(Path(__file__).resolve().parents[2])
_BOOT = "import sys; sys.path.insert(0, {src!r}); from agentenv.runtime.toolserver import bootstrap; import json; " \
        "bootstrap(json.loads(sys.argv[1]))"


class Seeds:
    """Finding images and starting their seeds."""

    # ---- seeds ----------------------------------------------------------------------------------------
    def _image(self, name: str) -> dict:
        manifest = self.store.load_image(name)
        if manifest is None and name == "host":
            manifest = images.build_host(self.store)
        if manifest is None:
            known = ", ".join(self.store.image_names()) or "none"
            raise errors.SandboxNotFoundError(
                f"unknown image {name!r} (built: {known}); build one with `agentenv image build NAME --from PATH`"
            )
        return manifest

    def _seed(self, image: str) -> Record:
        sid = f"seed-{image}"
        rec = self.store.read_record(sid)
        if rec is not None and self._alive(rec):
            return rec
        if rec is not None:
            self._reclaim(rec)
        return self._start_seed(sid, image, self._image(image))

    def _start_seed(self, sid: str, image: str, manifest: dict) -> Record:
        upper = self.store.new_writable_layer(SEED_LIMITS.disk_mb << 20, in_memory=SEED_LIMITS.disk_in_memory)
        cg = self._cgroup(sid)
        listener = sync_host = sync_child = proc = None
        root_fd = -1
        try:
            cg.create(cgroups.CgroupLimits(SEED_LIMITS.memory_mb << 20, SEED_LIMITS.pids, SEED_LIMITS.cpus))
            listener = self._listener(sid)
            sync_host, sync_child = socket.socketpair()
            root_fd = self._overlay(manifest["layers"], upper)
            config = {
                "id": sid,
                "root_fd": root_fd,
                "usr_bind": bool(manifest.get("usr_bind")),
                "sync_fd": sync_child.fileno(),
                "listen_fd": listener.fileno(),
            }
            proc = subprocess.Popen(
                [HOST_PYTHON, "-I", "-S", "-c", _BOOT.format(src=_SRC), json.dumps(config)],
                pass_fds=(sync_child.fileno(), listener.fileno(), root_fd),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                preexec_fn=lambda: cg.add(os.getpid()),
                env={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
            )
            sync_child.close()
            listener.close()
            sync_host.settimeout(SEED_START_TIMEOUT_S)
            if sync_host.recv(1) != b"u":
                raise errors.SandboxError(f"seed for {image!r} died at start: {proc.stderr.read().decode()[-2000:]}")
            for name in ("uid_map", "gid_map"):
                Path(f"/proc/{proc.pid}/{name}").write_text(f"0 {HOST_UID} {UID_RANGE}\n")
            sync_host.sendall(b"m")
            status = sync_host.recv(4096)
            proc.wait(timeout=SEED_START_TIMEOUT_S)
            if status != b"r":
                raise errors.SandboxError(f"seed for {image!r} failed to start: {status[1:].decode(errors='replace')}")
            conn = Connection(self.store.sock(sid), sid)
            pid = conn.peer_pid()
            conn.close()
            rec = Record(sid, "seed", image, pid, proc_start_time(pid) or 0, None, list(manifest["layers"]), upper,
                         bool(manifest.get("usr_bind")), SEED_LIMITS.to_dict(), time.time(), None)
            self.store.write_record(rec)
            return rec
        except BaseException:
            cg.destroy()
            self.store.remove_layer(upper)
            self.store.delete_record(sid)
            raise
        finally:
            if root_fd >= 0:
                os.close(root_fd)
            for s in (sync_host, sync_child, listener):
                if s is not None:
                    s.close()
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if proc.stderr is not None:
                    proc.stderr.close()
