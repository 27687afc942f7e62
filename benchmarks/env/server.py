"""AgentEnv server benchmark: the stock E2B SDK through `agentenv serve` vs our in-process SDK, same run.

Latency rows (p50 and p99 over `--server-reps` calls): create (+kill), ``commands.run("true")``, 1 MB file
write and read, ``run_code("1 + 1")``. The baseline is the same operation through `agentenv.Sandbox` in this
process. ``commands.run`` in the SDK is ``/bin/bash -l -c true``, so the in-process baseline runs that exact
argv (the ``/bin/sh -c true`` that `Sandbox.exec("true")` runs is reported beside it). Throughput rows: C
concurrent clients (threads spread over worker processes, each a stock `e2b.Sandbox`) loop
``commands.run("true")`` over a pool of sandboxes for `--server-seconds`; we report requests/s, errors and
latency quantiles. The server runs in its own process on 127.0.0.1; clients and server share this machine.
Two more rows time create+kill and the 1 MB upload as bare `http.client` requests (`RawClient`): what the
server and HTTP cost without the SDK's own work. Two rows without an in-process counterpart time a PTY
keystroke round trip (``pty.send_stdin`` → the shell's echo seen) and a watch (``files.write`` → its event
seen). Each throughput row also gives the rate its CPU per call allows on this host's cores
(``ceiling_req_per_s``) and the rate left if the server and agent cost nothing
(``ceiling_without_ours_req_per_s``: the stock SDK client and the command itself only).

Usage: ``python -m benchmarks.env.server [--server-reps N] [--server-clients 64 256] [--server-seconds S]
[--no-write]``; the env runner calls `run_server_bench(args)` for ``k3infra bench env --server``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks.harness import Row, Timing, time_fn, write_results

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20


@dataclass
class LoadResult:
    """Outcome of a load run."""

    clients: int
    seconds: float
    ok: int
    errors: int
    error_samples: list[str]
    latency: Timing | None
    cpu_s: dict[str, float] | None = None
    """CPU seconds spent while the clients issued calls: ``sdk_clients`` (the stock SDK worker processes),
    ``server``, ``agents`` (the in-sandbox envd agents), ``commands`` (their children: the commands run),
    ``machine`` (every CPU of the host, other jobs included)."""

    @property
    def rps(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0


@dataclass
class ServerHandle:
    url: str
    api_key: str
    proc: subprocess.Popen
    home: Path

    def sdk_opts(self) -> dict:
        return {"api_url": self.url, "sandbox_url": self.url, "api_key": self.api_key}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(home: Path, src: Path = ROOT / "src", key_name: str = "bench", *, runtime_home: Path | None = None,
                 serve_args: tuple[str, ...] = ()) -> ServerHandle:
    """`agentenv serve` from source tree `src` on a free loopback port with a fresh key; sandboxes die with it.

    The server keeps its state in ``home/server`` and its sandboxes' runtime in `runtime_home` (default `home`);
    `serve_args` are further ``agentenv serve`` options.
    """
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "agentenv.server", "--home", str(runtime_home or home), "serve",
                             "--port", "0", "--exit-with-parent", "--state-dir", str(home / "server"), "--kill-on-exit",
                             "--create-key", key_name, *serve_args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    key = json.loads(proc.stdout.readline())["api_key"]
    url = json.loads(proc.stdout.readline())["url"]
    return ServerHandle(url, key, proc, home)


# ---- CPU accounting ---------------------------------------------------------------------------------------
AGENT_MARK = b"agentenv-envd-agent"
"""In the command line of every in-sandbox envd agent (see `agentenv.server.agents`)."""


def _proc_cpu(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of process `pid`."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    hz = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / hz, (int(fields[13]) + int(fields[14])) / hz


def _agents_cpu() -> tuple[float, float]:
    """Summed (own, children's) CPU seconds of every envd agent on this host."""
    own = kids = 0.0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if AGENT_MARK not in Path(f"/proc/{name}/cmdline").read_bytes():
                continue
            a, b = _proc_cpu(int(name))
        except OSError:  # exited meanwhile
            continue
        own, kids = own + a, kids + b
    return own, kids


def _machine_busy_s() -> float:
    """Busy CPU seconds of the whole host since boot (all CPUs, /proc/stat)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _snapshot(server_pid: int | None) -> dict[str, float]:
    agents, commands = _agents_cpu()
    return {"server": _proc_cpu(server_pid)[0] if server_pid else 0.0, "agents": agents, "commands": commands,
            "machine": _machine_busy_s()}


# ---- load generation ----------------------------------------------------------------------------------------
def _load_worker(opts: dict, sandbox_ids: list[str], threads: int, seconds: float, offset: int, ready, go,
                 out) -> None:
    from e2b import Sandbox

    handles = {sid: Sandbox.connect(sid, **opts) for sid in sandbox_ids}
    ready.put(1)
    go.wait()  # every worker starts issuing at the same moment (the parent's CPU window starts then)
    start_barrier = time.time()
    lat: list[float] = []
    counts = {"ok": 0, "err": 0}
    samples: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        sb = handles[sandbox_ids[(offset + i) % len(sandbox_ids)]]
        mine: list[float] = []
        ok = err = 0
        end = start_barrier + seconds
        while time.time() < end:
            t0 = time.perf_counter()
            try:
                if sb.commands.run("true").exit_code == 0:
                    ok += 1
                    mine.append((time.perf_counter() - t0) * 1e3)
                else:
                    err += 1
            except Exception as e:  # count and sample every failure; the run must report them, not die
                err += 1
                if len(samples) < 5:
                    samples.append(f"{type(e).__name__}: {e}"[:300])
        with lock:
            lat.extend(mine)
            counts["ok"] += ok
            counts["err"] += err

    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    cpu0 = time.process_time()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out.put((counts["ok"], counts["err"], samples, lat, time.process_time() - cpu0))


def load(opts: dict, sandbox_ids: list[str], clients: int, seconds: float, processes: int | None = None,
         server_pid: int | None = None) -> LoadResult:
    """`clients` concurrent stock-SDK clients looping ``commands.run("true")`` for `seconds`.

    Clients are threads spread over `processes` worker processes (default: one per 32 clients, at least 2),
    each thread bound to one sandbox of `sandbox_ids` (round robin). CPU is accounted over the window in which
    the clients issue calls (`LoadResult.cpu_s`); `server_pid` names the server process to account.
    """
    if clients < 1 or seconds <= 0 or not sandbox_ids:
        raise ValueError(f"need clients >= 1, seconds > 0 and sandboxes, got {clients}, {seconds}, {sandbox_ids}")
    processes = processes or max(2, min(8, (clients + 31) // 32))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    per = [clients // processes + (1 if i < clients % processes else 0) for i in range(processes)]
    ready, go = ctx.Queue(), ctx.Event()
    procs, offset = [], 0
    for n in per:
        p = ctx.Process(target=_load_worker, args=(opts, sandbox_ids, n, seconds, offset, ready, go, out))
        p.start()
        procs.append(p)
        offset += n
    for _ in procs:  # workers import the SDK and connect before the clock starts
        ready.get(timeout=300)
    before = _snapshot(server_pid)
    go.set()
    time.sleep(seconds)
    after = _snapshot(server_pid)
    ok = err = 0
    samples: list[str] = []
    lat: list[float] = []
    client_cpu = 0.0
    for _ in procs:
        o, e, s, lt, c = out.get(timeout=seconds + 300)
        ok, err = ok + o, err + e
        samples += s
        lat += lt
        client_cpu += c
    for p in procs:
        p.join(timeout=30)
    cpu = {k: after[k] - before[k] for k in before}
    cpu["sdk_clients"] = client_cpu
    return LoadResult(clients, seconds, ok, err, samples[:5], Timing.from_samples(lat) if lat else None, cpu)


# ---- PTY and watch: round trips through the stock SDK (no in-process counterpart) ---------------------------
class _PtyScreen:
    """Output of one SDK PTY session, read on a thread; `wait_for` returns once a marker has arrived."""

    def __init__(self, handle):
        self.data = bytearray()
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(handle,), daemon=True)
        self.thread.start()

    def _read(self, handle) -> None:
        try:
            handle.wait(on_pty=self._add)
        except Exception:  # the session is killed at the end of the rows
            pass

    def _add(self, chunk: bytes) -> None:
        with self.cond:
            self.data += chunk
            self.cond.notify_all()

    def wait_for(self, marker: bytes, timeout: float = 10.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: marker in self.data, timeout):
                raise TimeoutError(f"{marker!r} not seen on the PTY")


def _interactive_rows(sb, reps: int) -> list[Row]:
    """``pty.send_stdin`` → the shell's answer seen, and ``files.write`` → the watch event seen."""
    from e2b.sandbox.commands.command_handle import PtySize

    handle = sb.pty.create(PtySize(rows=24, cols=80))
    screen = _PtyScreen(handle)
    counter = iter(range(10**9))

    def echo() -> None:
        n = next(counter)
        sb.pty.send_stdin(handle.pid, f"echo m$(( {n} + 1000000 ))\n".encode())
        screen.wait_for(f"m{n + 1000000}\r\n".encode())

    t_pty = time_fn(echo, warmup=3, rep=reps)
    sb.pty.kill(handle.pid)
    sb.files.make_dir("/tmp/bench-watch")
    watch = sb.files.watch_dir("/tmp/bench-watch")

    def event() -> None:
        name = f"f{next(counter)}"
        sb.files.write(f"/tmp/bench-watch/{name}", b"x")
        deadline = time.monotonic() + 10
        while not any(e.name == name for e in watch.get_new_events()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no watch event for {name}")

    t_watch = time_fn(event, warmup=3, rep=reps)
    watch.stop()
    return [Row(case="pty: send_stdin -> echo seen", baseline="-", baseline_ms=None, ours_ms=t_pty.median_ms,
                params={"reps": reps}, extra=_extra(t_pty),
                note="stock SDK PTY (interactive bash); keystrokes in, the shell's output back"),
            Row(case="watch: files.write -> event seen", baseline="-", baseline_ms=None, ours_ms=t_watch.median_ms,
                params={"reps": reps}, extra=_extra(t_watch),
                note="stock SDK watch_dir + get_new_events polled back to back; includes the write (inotify)")]


# ---- a minimal HTTP client (what the server costs without the SDK's own work) -------------------------------
class RawClient:
    """The SDK's create/kill and 1 MB multipart upload as bare `http.client` requests on one kept-alive
    connection: the gap between this and the stock SDK is spent in the SDK, not in the server."""

    BOUNDARY = "agentenvbench"

    def __init__(self, server: ServerHandle):
        u = urlsplit(server.url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        self.key = server.api_key

    def _call(self, method: str, path: str, body: bytes | None, headers: dict, status: int) -> bytes:
        self.conn.request(method, path, body, headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != status:
            raise RuntimeError(f"{method} {path}: HTTP {resp.status} {data[:300]!r}")
        return data

    def create_kill(self) -> None:
        created = self._call("POST", "/v2/sandboxes", json.dumps({"templateID": "base", "timeout": 300}).encode(),
                             {"X-API-Key": self.key, "Content-Type": "application/json"}, 201)
        self._call("DELETE", f"/sandboxes/{json.loads(created)['sandboxID']}", None, {"X-API-Key": self.key}, 204)

    def write(self, sandbox_id: str, token: str, path: str, data: bytes) -> None:
        head = (f'--{self.BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{path}"\r\n'
                f"Content-Type: application/octet-stream\r\n\r\n").encode()
        body = b"".join((head, data, f"\r\n--{self.BOUNDARY}--\r\n".encode()))
        self._call("POST", "/files", body, {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983",
                                            "X-Access-Token": token,
                                            "Content-Type": f"multipart/form-data; boundary={self.BOUNDARY}"}, 200)

    def close(self) -> None:
        self.conn.close()


# ---- the benchmark ------------------------------------------------------------------------------------------
def _extra(t: Timing, **more) -> dict:
    return {"p20_ms": round(t.p20_ms, 3), "p80_ms": round(t.p80_ms, 3), "p99_ms": round(t.p99_ms, 3), "n": t.n,
            **more}


def run_server_bench(args: argparse.Namespace) -> list[Row]:
    """All rows of the server benchmark (latency vs in-process, then throughput)."""
    from e2b import Sandbox as E2BSandbox
    from e2b_code_interpreter import Sandbox as CodeSandbox

    from agentenv import Sandbox
    from agentenv.runtime.local import NamespaceBackend

    reps = getattr(args, "server_reps", 50)
    home = Path(tempfile.mkdtemp(prefix="agentenv-bench-srv-", dir="/tmp"))
    server = start_server(home)
    backend = NamespaceBackend(home)
    rows: list[Row] = []
    try:
        opts = server.sdk_opts()
        remote = CodeSandbox.create(timeout=3600, **opts)
        local = Sandbox.create("host", backend=backend)
        blob = os.urandom(MB)
        # correctness gate: both paths must do the same work before anything is timed
        remote.files.write("/tmp/gate", blob)
        local.files.write("/tmp/gate", blob)
        assert bytes(remote.files.read("/tmp/gate", format="bytes")) == blob
        assert local.files.read("/tmp/gate", text=False) == blob
        assert remote.commands.run("echo ok").stdout == "ok\n"
        assert remote.run_code("1 + 1").text == "2" and local.python.run("1 + 1").value == "2"

        cases = [
            ("create+kill", lambda: E2BSandbox.create(**opts).kill(),
             lambda: Sandbox.create("host", backend=backend).destroy(), max(10, reps // 4), ""),
            ('commands.run("true")', lambda: remote.commands.run("true"),
             lambda: local.exec(["/bin/bash", "-l", "-c", "true"]), reps, "both run /bin/bash -l -c true"),
            ("files.write 1 MB", lambda: remote.files.write("/tmp/w", blob),
             lambda: local.files.write("/tmp/w", blob), reps, ""),
            ("files.read 1 MB", lambda: remote.files.read("/tmp/gate", format="bytes"),
             lambda: local.files.read("/tmp/gate", text=False), reps, ""),
            ('run_code("1 + 1")', lambda: remote.run_code("1 + 1"), lambda: local.python.run("1 + 1"), reps, ""),
        ]
        for name, ours, base, n, note in cases:
            t_base = time_fn(base, warmup=3, rep=n)
            t_ours = time_fn(ours, warmup=3, rep=n)
            rows.append(Row(case=name, baseline="in-process agentenv SDK", baseline_ms=t_base.median_ms,
                            ours_ms=t_ours.median_ms, params={"reps": n},
                            extra=_extra(t_ours, base_p99_ms=round(t_base.p99_ms, 3),
                                         overhead_p50_ms=round(t_ours.median_ms - t_base.median_ms, 3)),
                            note=f"ours = stock e2b SDK over HTTP; {note}".rstrip("; ")))
        raw = RawClient(server)
        token = remote._envd_access_token or ""
        raw_cases = [("create+kill", raw.create_kill, max(10, reps // 4)),
                     ("files.write 1 MB", lambda: raw.write(remote.sandbox_id, token, "/tmp/w", blob), reps)]
        for name, fn, n in raw_cases:  # same server, same run: splits the SDK's overhead into ours and its own
            t_raw = time_fn(fn, warmup=3, rep=n)
            rows.append(Row(case=f"{name} (bare http.client)", baseline="-", baseline_ms=None, ours_ms=t_raw.median_ms,
                            params={"reps": n}, extra=_extra(t_raw),
                            note="the same requests as the stock SDK sends, without the SDK: server + HTTP only"))
        raw.close()
        rows += _interactive_rows(remote, reps)
        sh = time_fn(lambda: local.exec("true"), warmup=3, rep=reps)
        rows.append(Row(case='exec("true") in-process (/bin/sh -c)', baseline="-", baseline_ms=None,
                        ours_ms=sh.median_ms, params={"reps": reps}, extra=_extra(sh), note="reference only"))
        remote.kill()
        local.destroy()

        seconds = getattr(args, "server_seconds", 10.0)
        n_sandboxes = getattr(args, "server_sandboxes", 32)
        pool = [E2BSandbox.create(timeout=3600, **opts) for _ in range(n_sandboxes)]
        ids = [sb.sandbox_id for sb in pool]
        for sb in pool:  # every agent started and every pooled connection open before the clock runs
            sb.commands.run("true")
        for clients in getattr(args, "server_clients", [64, 256]):
            result = load(opts, ids, clients, seconds, server_pid=server.proc.pid)
            lat = result.latency
            per_req = {f"cpu_ms_{k}": round(v * 1e3 / max(1, result.ok), 3) for k, v in result.cpu_s.items()}
            # what the CPU per call allows on this host's cores: all of it, and with the server and agent free
            # (the stock SDK client and the command itself are not ours to remove)
            cores = os.cpu_count() or 1
            per_req["ceiling_req_per_s"] = round(cores * 1e3 / per_req["cpu_ms_machine"], 1) \
                if per_req.get("cpu_ms_machine") else None
            not_ours = per_req.get("cpu_ms_sdk_clients", 0) + per_req.get("cpu_ms_commands", 0)
            per_req["ceiling_without_ours_req_per_s"] = round(cores * 1e3 / not_ours, 1) if not_ours else None
            rows.append(Row(case=f"throughput {clients} clients", baseline="-", baseline_ms=None,
                            ours_ms=lat.median_ms if lat else float("nan"),
                            params={"clients": clients, "sandboxes": n_sandboxes, "seconds": seconds,
                                    "loadavg_1m": round(os.getloadavg()[0], 1)},
                            extra={"req_per_s": round(result.rps, 1), "errors": result.errors,
                                   "p99_ms": round(lat.p99_ms, 2) if lat else None, "ok": result.ok, **per_req},
                            note='stock SDK commands.run("true"); clients and server share the 2 cores; cpu_ms_*: '
                                 "CPU per call by process (machine = whole host, other jobs included)"
                                 + (f"; errors: {result.error_samples}" if result.errors else "")))
        for sb in pool:
            sb.kill()
    finally:
        server.stop()
        backend.gc(everything=True)
        shutil.rmtree(home, ignore_errors=True)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server-reps", type=int, default=50, help="calls per latency case")
    parser.add_argument("--server-clients", type=int, nargs="+", default=[64, 256], help="concurrency levels")
    parser.add_argument("--server-seconds", type=float, default=10.0, help="seconds per throughput level")
    parser.add_argument("--server-sandboxes", type=int, default=32, help="sandboxes shared by the clients")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results")
    args = parser.parse_args(argv)
    rows = run_server_bench(args)
    for row in rows:
        base = "-" if row.baseline_ms is None else f"{row.baseline_ms:.3f}"
        print(f"{row.case:42s} ours {row.ours_ms:9.3f} ms  base {base} ms  {row.extra}")
    if not args.no_write:
        path = write_results("env-server", rows, title="AgentEnv server: stock E2B SDK vs in-process SDK")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
