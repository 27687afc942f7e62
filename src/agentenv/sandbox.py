"""The Python SDK: `Sandbox` (sync) and `AsyncSandbox`, shaped after E2B's SDK.

Example::

    from agentenv import Sandbox

    with Sandbox.create("host") as sb:               # killed on exit
        sb.files.write("/root/a.txt", "hi")
        print(sb.exec("cat /root/a.txt").stdout)      # hi
        sb.python.run("x = 41")
        kids = sb.fork(2)                             # files and interpreter state carry over
        print(kids[0].python.run("x + 1").value)      # 42
        for kid in kids:
            kid.destroy()
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from pathlib import Path

from agentenv import errors
from agentenv._aio import AsyncProxy
from agentenv.limits import Limits
from agentenv.protocol import CommandResult, EntryInfo, PythonResult
from agentenv.runtime.backend import Backend
from agentenv.runtime.client import Connection

DEFAULT_TIMEOUT_S = 60.0


def default_backend(home: Path | str | None = None) -> Backend:
    """The embedded namespace backend on the data directory `home` (default `$AGENTENV_HOME`).

    One backend per data directory and process, so sandboxes made without an explicit backend share its
    connections and worker thread.
    """
    from agentenv.runtime.store import default_home

    return _backend_for(str(Path(home if home is not None else default_home()).resolve()))


@functools.cache
def _backend_for(home: str) -> Backend:
    from agentenv.runtime.local import NamespaceBackend

    return NamespaceBackend(home)


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")


def _check_path(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"path must be an absolute path inside the sandbox, got {path!r}")
    return path


class Commands:
    """Processes in the sandbox (`sb.commands.run` is `sb.exec`)."""

    def __init__(self, sandbox: Sandbox):
        self._sb = sandbox

    def run(
        self,
        cmd: str | list[str],
        *,
        stdin: bytes | str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        on_stdout: Callable[[str], None] | None = None,
        on_stderr: Callable[[str], None] | None = None,
        max_output: int | None = None,
    ) -> CommandResult:
        """Run a command in a fresh process and wait for it.

        Args:
            cmd: a shell command line (run by ``/bin/sh -c``) or an argv list (run directly).
            stdin: bytes (or text, UTF-8) fed to the command's standard input.
            env: extra environment variables.
            cwd: working directory inside the sandbox (default /root).
            timeout: seconds before the command is killed and `SandboxTimeoutError` raised; None waits forever.
            on_stdout: called with each chunk of standard output as it arrives (streaming).
            on_stderr: the same for standard error.
            max_output: bytes kept per stream (default 16 MiB); the rest is dropped and `truncated` set.

        Returns:
            `CommandResult` with exit code, output and duration (a non-zero exit is not an error).

        Raises:
            CommandNotFoundError: the program does not exist in the sandbox.
            SandboxTimeoutError: the command ran past `timeout`.
            SandboxGoneError: the sandbox is gone.
        """
        if isinstance(cmd, str):
            if not cmd.strip():
                raise ValueError("cmd must be a non-empty command line or argv list")
            request: dict = {"op": "exec", "cmd": cmd}
        elif isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd):
            request = {"op": "exec", "argv": cmd}
        else:
            raise ValueError(f"cmd must be a non-empty str or list of str, got {cmd!r}")
        _check_timeout(timeout)
        if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("env must map str to str")
        if cwd is not None:
            _check_path(cwd)
        if max_output is not None and (not isinstance(max_output, int) or max_output < 1):
            raise ValueError(f"max_output must be a positive int, got {max_output!r}")
        request.update(env=env, cwd=cwd, timeout=timeout, max_output=max_output)
        stream = on_stdout is not None or on_stderr is not None
        out: dict[str, list[bytes]] = {"out": [], "err": []}

        def on_event(kind: str, chunk: bytes) -> None:
            out[kind].append(chunk)
            callback = on_stdout if kind == "out" else on_stderr
            if callback is not None:
                callback(chunk.decode(errors="replace"))

        if stream:
            request["stream"] = True
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        reply, _ = self._sb._request(request, data, timeout_s=timeout, on_event=on_event if stream else None)
        if stream:
            reply["stdout"] = b"".join(out["out"]).decode(errors="replace")
            reply["stderr"] = b"".join(out["err"]).decode(errors="replace")
        return CommandResult(reply["exit_code"], reply["stdout"], reply["stderr"], reply["duration_ms"],
                             reply["truncated"])


class Shell:
    """The persistent bash session: variables, functions, aliases, options and cwd survive calls and forks."""

    def __init__(self, sandbox: Sandbox):
        self._sb = sandbox

    def run(self, cmd: str, *, timeout: float | None = DEFAULT_TIMEOUT_S, max_output: int | None = None
            ) -> CommandResult:
        """Run `cmd` in the session (stdin is /dev/null). A timeout restarts the session without its state.

        Example::

            >>> sb.shell.run("cd /tmp && X=1"); sb.shell.run("echo $X $PWD").stdout
            '1 /tmp\\n'
        """
        if not isinstance(cmd, str) or not cmd.strip():
            raise ValueError(f"cmd must be a non-empty str, got {cmd!r}")
        _check_timeout(timeout)
        reply, _ = self._sb._request({"op": "shell", "cmd": cmd, "timeout": timeout, "max_output": max_output},
                                     timeout_s=timeout)
        return CommandResult(reply["exit_code"], reply["stdout"], reply["stderr"], reply["duration_ms"],
                             reply["truncated"])


class Python:
    """The persistent Python interpreter (the host's python3, stdlib): globals survive calls and forks.

    Each context (``default`` and those from `create_context`) runs in its own kernel process: a crash of
    one (a segfault, ``os._exit``, an OOM kill) returns error ``DeadKernelError`` saying how it ended, and
    the next run in that context starts a fresh kernel; the sandbox and the other contexts live on.
    """

    def __init__(self, sandbox: Sandbox):
        self._sb = sandbox

    def run(self, code: str, *, timeout: float | None = DEFAULT_TIMEOUT_S, context: str | None = None,
            envs: dict[str, str] | None = None) -> PythonResult:
        """Execute `code`; a trailing expression's repr comes back as `value`. Errors are returned, not raised.

        Args:
            context: the context id (None: ``default``); `NotFoundError` if there is no such context.
            envs: environment variables for this run only.

        Example::

            >>> sb.python.run("import math; r = 2"); sb.python.run("math.pi * r").value
            '6.283185307179586'
        """
        if not isinstance(code, str):
            raise ValueError(f"code must be a str, got {type(code).__name__}")
        _check_timeout(timeout)
        if context is not None and not isinstance(context, str):
            raise ValueError(f"context must be a str or None, got {type(context).__name__}")
        if envs is not None and not (isinstance(envs, dict)
                                     and all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items())):
            raise ValueError(f"envs must map str to str, got {envs!r}")
        req = {"op": "python", "code": code, "timeout": timeout}
        if context is not None:
            req["context"] = context
        if envs:
            req["env"] = envs
        reply, _ = self._sb._request(req, timeout_s=timeout)
        return PythonResult(reply["stdout"], reply["stderr"], reply["value"], reply["error"], reply["traceback"])

    def create_context(self, cwd: str | None = None) -> str:
        """A new context (own globals, own kernel process) whose runs start in `cwd`; returns its id."""
        if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
            raise ValueError(f"cwd must be an absolute path or None, got {cwd!r}")
        cid = os.urandom(16).hex()
        self._sb._request({"op": "context_create", "context": cid, "cwd": cwd})
        return cid

    def contexts(self) -> list[dict]:
        """Every context as ``{"id", "cwd"}`` (``default`` first)."""
        reply, _ = self._sb._request({"op": "context_list"})
        return reply["contexts"]

    def restart_context(self, context: str = "default") -> None:
        """End the context's kernel (its state is lost); the next run starts a fresh one."""
        self._sb._request({"op": "context_restart", "context": _check_context(context)})

    def remove_context(self, context: str) -> None:
        """Remove a context and end its kernel (``default`` is restarted instead)."""
        self._sb._request({"op": "context_remove", "context": _check_context(context)})


def _check_context(context: str) -> str:
    if not isinstance(context, str) or not context:
        raise ValueError(f"context must be a non-empty str, got {context!r}")
    return context


class Files:
    """Files inside the sandbox (paths are absolute, in the sandbox's root)."""

    def __init__(self, sandbox: Sandbox):
        self._sb = sandbox

    def read(self, path: str, *, text: bool = True) -> str | bytes:
        """Contents of a file (decoded as UTF-8 unless `text=False`). Raises `NotFoundError` if missing."""
        _, blob = self._sb._request({"op": "read", "path": _check_path(path)})
        return blob.decode() if text else blob

    def write(self, path: str, data: str | bytes, *, mode: int | None = None) -> None:
        """Create or replace a file (parents are created); `mode` e.g. 0o755."""
        if not isinstance(data, (str, bytes)):
            raise ValueError(f"data must be str or bytes, got {type(data).__name__}")
        if mode is not None and (not isinstance(mode, int) or not 0 <= mode <= 0o7777):
            raise ValueError(f"mode must be an int in [0, 0o7777], got {mode!r}")
        blob = data.encode() if isinstance(data, str) else data
        self._sb._request({"op": "write", "path": _check_path(path), "mode": mode}, blob)

    def list(self, path: str) -> list[EntryInfo]:
        """Entries of a directory, sorted by name."""
        reply, _ = self._sb._request({"op": "list", "path": _check_path(path)})
        return [EntryInfo(**e) for e in reply["entries"]]

    def exists(self, path: str) -> bool:
        reply, _ = self._sb._request({"op": "stat", "path": _check_path(path)})
        return bool(reply["exists"])

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Delete a file, an empty directory, or (with `recursive`) a tree."""
        self._sb._request({"op": "remove", "path": _check_path(path), "recursive": recursive})

    def make_dir(self, path: str) -> None:
        self._sb._request({"op": "mkdir", "path": _check_path(path)})

    def upload(self, local: str | os.PathLike, remote: str) -> None:
        """Copy a host file into the sandbox."""
        self.write(remote, Path(local).read_bytes())

    def download(self, remote: str, local: str | os.PathLike) -> None:
        """Copy a sandbox file to the host."""
        Path(local).write_bytes(self.read(remote, text=False))


class Sandbox:
    """A live sandbox. Make one with `Sandbox.create`, `Sandbox.restore` or `sb.fork`.

    Attributes:
        id: the sandbox id (``sb-...``).
        commands, files, shell, python: the sandbox's interfaces.
    """

    def __init__(self, sandbox_id: str, backend: Backend, connection: Connection | None = None):
        self.id = sandbox_id
        self.backend = backend
        self._conn = connection
        self.commands = Commands(self)
        self.files = Files(self)
        self.shell = Shell(self)
        self.python = Python(self)

    # ---- construction --------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        source: str = "host",
        *,
        limits: Limits | None = None,
        ttl: float | None = None,
        backend: Backend | None = None,
        home: str | os.PathLike | None = None,
    ) -> Sandbox:
        """Start a sandbox.

        Args:
            source: an image name (``host``: the host's /usr read-only, built on first use), a template name,
                or a snapshot id (``snap-...``).
            limits: resource limits (default `Limits()`: 512 MiB, 256 tasks, 1 CPU, 1 GiB writable layer).
            ttl: seconds after which the sandbox stops by itself (and `agentenv gc` reclaims it); None: never.
            backend: the runtime to use (default: the namespace backend on `home`).
            home: data directory for the default backend (default `$AGENTENV_HOME` or /var/lib/agentenv).

        Raises:
            ValueError: bad `limits` or `ttl`.
            SandboxNotFoundError: unknown image, template or snapshot.
            SandboxError: the sandbox failed to start (nothing is left behind).
        """
        if limits is not None and not isinstance(limits, Limits):
            raise ValueError(f"limits must be an agentenv.Limits, got {type(limits).__name__}")
        if not isinstance(source, str) or not source:
            raise ValueError(f"source must be an image, template or snapshot name, got {source!r}")
        backend = backend or default_backend(home)
        sid = backend.create(source, limits or Limits(), ttl_s=ttl)
        return cls._attach(sid, backend)

    @classmethod
    def restore(cls, snapshot_id: str, *, limits: Limits | None = None, ttl: float | None = None,
                backend: Backend | None = None, home: str | os.PathLike | None = None) -> Sandbox:
        """A new sandbox from a snapshot (the snapshot stays, so it can be restored again)."""
        backend = backend or default_backend(home)
        return cls._attach(backend.restore(snapshot_id, limits, ttl_s=ttl), backend)

    @classmethod
    def connect(cls, sandbox_id: str, *, backend: Backend | None = None, home: str | os.PathLike | None = None
                ) -> Sandbox:
        """Attach to a running sandbox by id (e.g. one made by the CLI)."""
        backend = backend or default_backend(home)
        return cls._attach(sandbox_id, backend)

    @classmethod
    def _attach(cls, sid: str, backend: Backend) -> Sandbox:
        try:
            return cls(sid, backend, backend.connect(sid))
        except errors.SandboxNotFoundError:
            raise
        except errors.SandboxError as e:
            try:
                backend.destroy(sid)
            except errors.SandboxError:
                pass
            raise errors.SandboxError(f"sandbox {sid} started but could not be reached; destroyed it") from e

    # ---- requests --------------------------------------------------------------------------------------
    def _request(self, obj: dict, blob: bytes = b"", **kwargs) -> tuple[dict, bytes]:
        if self._conn is None:
            self._conn = self.backend.connect(self.id)
        try:
            return self._conn.request(obj, blob, **kwargs)
        except (errors.SandboxGoneError, errors.SandboxTimeoutError):
            self._conn = None  # the connection was closed; the next call reconnects (or finds it gone)
            raise

    def exec(self, cmd: str | list[str], **kwargs) -> CommandResult:
        """Same as `sb.commands.run` (see there for the arguments)."""
        return self.commands.run(cmd, **kwargs)

    # ---- lifecycle -------------------------------------------------------------------------------------
    def snapshot(self) -> str:
        """Seal files and interpreter state into a snapshot; returns its id for `Sandbox.restore`.

        Background processes of the sandbox are stopped (its shell session is carried over as state).
        """
        self._close_conn()
        return self.backend.snapshot(self.id)

    def fork(self, n: int = 1, *, ttl: float | None = None) -> list[Sandbox]:
        """`n` live copies carrying files, the Python session and the shell session; this sandbox goes on.

        Background processes of this sandbox are stopped when it has changed files since its last fork.
        """
        self._close_conn()
        return [Sandbox._attach(sid, self.backend) for sid in self.backend.fork(self.id, n, ttl_s=ttl)]

    def pause(self) -> None:
        """Freeze every process (cgroup freezer); requests wait until `resume`."""
        self.backend.pause(self.id)

    def resume(self) -> None:
        self.backend.resume(self.id)

    def destroy(self) -> None:
        """Kill the sandbox and release its layers (idempotent)."""
        self._close_conn()
        try:
            self.backend.destroy(self.id)
        except errors.SandboxNotFoundError:
            pass

    kill = destroy

    def _close_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r})"


class AsyncSandbox:
    """The asyncio face of `Sandbox`: the same methods, awaited (each runs in a worker thread).

    Example::

        async with await AsyncSandbox.create("host") as sb:
            result = await sb.exec("echo hi")
            kids = await sb.fork(4)
    """

    def __init__(self, sandbox: Sandbox):
        self.sync = sandbox
        self.id = sandbox.id
        self.commands = AsyncProxy(sandbox.commands)
        self.files = AsyncProxy(sandbox.files)
        self.shell = AsyncProxy(sandbox.shell)
        self.python = AsyncProxy(sandbox.python)

    @classmethod
    async def create(cls, source: str = "host", **kwargs) -> AsyncSandbox:
        return cls(await asyncio.to_thread(Sandbox.create, source, **kwargs))

    @classmethod
    async def restore(cls, snapshot_id: str, **kwargs) -> AsyncSandbox:
        return cls(await asyncio.to_thread(Sandbox.restore, snapshot_id, **kwargs))

    async def exec(self, cmd: str | list[str], **kwargs) -> CommandResult:
        return await asyncio.to_thread(self.sync.exec, cmd, **kwargs)

    async def snapshot(self) -> str:
        return await asyncio.to_thread(self.sync.snapshot)

    async def fork(self, n: int = 1, **kwargs) -> list[AsyncSandbox]:
        return [AsyncSandbox(s) for s in await asyncio.to_thread(self.sync.fork, n, **kwargs)]

    async def pause(self) -> None:
        await asyncio.to_thread(self.sync.pause)

    async def resume(self) -> None:
        await asyncio.to_thread(self.sync.resume)

    async def destroy(self) -> None:
        await asyncio.to_thread(self.sync.destroy)

    kill = destroy

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()
