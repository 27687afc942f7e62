"""The in-sandbox services E2B's SDK calls through the ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` headers.

Port 49983 (envd): the Connect services ``process.Process`` and ``filesystem.Filesystem``, ``/files``
(download, multipart and octet-stream upload) and ``/health``. Port 49999: the code interpreter's
``/execute`` (see `agentenv.server.interpreter`). Every call is checked against the sandbox's access token,
translated to the agent's frames (`agentenv.server.agent`) and the answer back into Connect JSON.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import logging
import os
import re
import select
import signal

from agentenv.server import connect
from agentenv.server.agents import MAX_BLOB, AgentError, AgentLink, open_regular_in_sandbox
from agentenv.server.connect import ConnectError
from agentenv.server.httpd import MAX_BODY, Handler, HTTPError

log = logging.getLogger(__name__)

KEEPALIVE_S = 30.0
"""Idle seconds after which a process or watch stream sends a keep-alive event."""
SIGNALS = {"SIGNAL_SIGKILL": signal.SIGKILL, "SIGNAL_SIGTERM": signal.SIGTERM, 9: signal.SIGKILL,
           15: signal.SIGTERM}


def username(handler: Handler) -> str | None:
    """The user the SDK names in ``Authorization: Basic base64(user:)`` (None: the default user)."""
    auth = handler.headers.get("Authorization", "")
    if not auth.startswith("Basic "):
        return None
    try:
        return base64.b64decode(auth[6:]).decode().split(":", 1)[0] or None
    except (binascii.Error, UnicodeDecodeError):
        return None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(value: object, what: str) -> bytes:
    try:
        return base64.b64decode(value or "", validate=True)
    except (binascii.Error, TypeError) as e:
        raise ConnectError("invalid_argument", f"{what} must be base64") from e


def _selector(msg: dict) -> dict:
    sel = msg.get("process") or {}
    if sel.get("pid") is not None:
        return {"pid": int(sel["pid"])}
    if sel.get("tag") is not None:
        return {"tag": str(sel["tag"])}
    raise ConnectError("invalid_argument", "process selector needs a pid or a tag")


def _pty_size(pty: object) -> dict:
    """``{rows, cols}`` from a Connect ``process.PTY`` message (a PTY without a size gets 24x80)."""
    size = (pty.get("size") if isinstance(pty, dict) else None) or {}
    try:
        rows, cols = int(size.get("rows") or 24), int(size.get("cols") or 80)
    except (TypeError, ValueError) as e:
        raise ConnectError("invalid_argument", f"pty.size must hold integer rows and cols, got {size!r}") from e
    if not (0 < rows < 65536 and 0 < cols < 65536):
        raise ConnectError("invalid_argument", f"pty.size must be 1..65535 rows and cols, got {rows}x{cols}")
    return {"rows": rows, "cols": cols}


def _input(selector: dict, data: dict) -> tuple[dict, bytes]:
    """The agent request for a ``process.ProcessInput`` (``stdin`` or ``pty`` bytes, base64 in JSON)."""
    if "pty" in data:
        return {"op": "input", "pty": True, **selector}, _unb64(data["pty"], "input.pty")
    return {"op": "input", **selector}, _unb64(data.get("stdin"), "input.stdin")


KILLED_BY_RUNTIME = {"ok": True, "ev": "end", "exitCode": -1, "exited": False, "status": "signal: killed",
                     "_hold": True}
"""The end of a process the runtime killed with its sandbox's other processes (fork, snapshot)."""


def _frames(link: AgentLink, req: dict):
    """Agent stream frames with keep-alive ticks (``{"ev": "keepalive"}``) when idle for `KEEPALIVE_S`.

    A fork or snapshot of the sandbox kills every process in it, the agent too (`AgentLink.retire`): a process
    stream then ends as a killed process (E2B's exit code -1, ``signal: killed``), a watch stream with
    ``aborted``.

    The connection goes back to the pool only when the final frame was read; a stream abandoned early (the
    HTTP client left) closes it, which makes the agent drop its subscription or stop its watch.
    """
    from agentenv.server import agent as wire

    sock = link.acquire()
    clean = False
    try:
        try:
            wire.send(sock, req)
        except OSError:  # a stale pooled connection: one retry on a fresh one
            sock.close()
            sock = link.open()
            wire.send(sock, req)
        while True:
            ready, _, _ = select.select([sock], [], [], KEEPALIVE_S)
            if not ready:
                yield {"ev": "keepalive"}, b""
                continue
            try:
                frame, blob = wire.recv(sock, MAX_BLOB)
            except (EOFError, OSError) as e:
                if link.ended_by is None:
                    raise ConnectError("unavailable", f"sandbox {link.sandbox.id} stopped answering: {e}") from e
                if req["op"] in ("start", "connect"):  # the runtime SIGKILLed it: the same end as `kill`
                    yield dict(KILLED_BY_RUNTIME), b""
                    return
                raise ConnectError("aborted", f"{req['op']} ended: a {link.ended_by} of sandbox {link.sandbox.id} "
                                              f"ends every process and watch in it") from e
            if "ok" in frame:
                clean = True
                if not frame["ok"]:
                    raise AgentError(str(frame.get("code", "internal")), str(frame.get("message", "failed")))
            # hold the message back when more is already waiting or the stream ends here: it then leaves
            # in one write with what follows (a held message never waits on a process)
            frame["_hold"] = clean or bool(select.select([sock], [], [], 0)[0])
            yield frame, blob
            if clean:
                return
    finally:
        if clean:
            link.release(sock)
        else:
            sock.close()


METADATA_HEADER = "x-metadata-"
"""Upload headers ``X-Metadata-<key>: <value>`` carry the user metadata set on every uploaded file (envd 0.6.2)."""
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_PRINTABLE = re.compile(r"[\x20-\x7e]*")


def _upload_metadata(h: Handler) -> dict[str, str]:
    """User metadata from an upload's ``X-Metadata-*`` headers, keys lower-cased (as envd does).

    Raises:
        HTTPError: 400 for a key that is not an HTTP token or a value that is not printable US-ASCII.
    """
    out = {}
    for name, value in h.headers.items():
        if not name.lower().startswith(METADATA_HEADER):
            continue
        key = name[len(METADATA_HEADER):].lower()
        if not _TOKEN.fullmatch(key):
            raise HTTPError(400, f"invalid metadata key {key!r}: use letters, digits and !#$%&'*+-.^_`|~")
        if not _PRINTABLE.fullmatch(value):
            raise HTTPError(400, f"invalid metadata value for key {key!r}: values must be printable US-ASCII")
        out[key] = value
    return out


STREAMING_RPCS = frozenset({"process.Start", "process.Connect", "process.StreamInput", "filesystem.WatchDir"})
"""Methods whose messages travel in Connect envelopes, so a plain-JSON (unary) request to them is refused."""


class Envd:
    """Routes one sandbox request (already authenticated) to its service."""

    def __init__(self, registry):
        self.registry = registry

    # ---- Connect plumbing --------------------------------------------------------------------------------
    def rpc(self, h: Handler, entry, service: str, method: str) -> None:
        streaming = h.headers.get("Content-Type", "").split(";")[0].strip() == connect.STREAM_CONTENT_TYPE
        fn = getattr(self, f"_{service}_{method}", None)
        try:
            if fn is None:
                raise ConnectError("unimplemented", f"{service}.{method} is not implemented by agentenv")
            link = self.registry.link(entry.id)
            if not streaming and f"{service}.{method}" in STREAMING_RPCS:
                raise ConnectError("invalid_argument", f"{service}.{method} is a streaming call: send Content-Type "
                                                       f"{connect.STREAM_CONTENT_TYPE} with enveloped messages")
            if method == "StreamInput":  # client stream: each message is forwarded as it arrives
                reply = self._process_stream_input(link, connect.iter_stream(h.iter_body()), entry)
            else:
                msg = connect.first_message(h.body(connect.MAX_MESSAGE), streaming)
                reply = fn(link, msg, username(h), entry)
        except AgentError as e:
            self._unary_error(h, streaming, ConnectError(e.code, str(e)))
            return
        except ConnectError as e:
            self._unary_error(h, streaming, e)
            return
        if not streaming:
            h.send_json(200, reply)
            return
        h.start_chunked(200, connect.STREAM_CONTENT_TYPE, hold=True)
        error = None
        try:
            if isinstance(reply, dict):
                h.write_chunk(connect.envelope(reply), hold=True)
            else:
                for message, hold in reply:
                    h.write_chunk(connect.envelope(message), hold=hold)
        except AgentError as e:
            error = ConnectError(e.code, str(e))
        except ConnectError as e:
            error = e
        finally:
            if not isinstance(reply, dict):
                reply.close()  # a client that went away: close the agent stream (unsubscribe / stop the watch)
        h.write_chunk(connect.end_stream(error))
        h.end_chunked()

    @staticmethod
    def _unary_error(h: Handler, streaming: bool, error: ConnectError) -> None:
        if streaming:  # errors before the first message still travel in the end-stream envelope
            h.start_chunked(200, connect.STREAM_CONTENT_TYPE)
            h.write_chunk(connect.end_stream(error))
            h.end_chunked()
        else:
            h.send_json(error.http_status, error.to_json())

    # ---- process.Process ---------------------------------------------------------------------------------
    @staticmethod
    def _events(frames):
        """Connect messages, each paired with whether it may be held for the next write."""
        for frame, blob in frames:
            ev, hold = frame.get("ev"), frame.get("_hold", False)
            if ev == "start":
                yield {"event": {"start": {"pid": frame["pid"]}}}, hold
            elif ev in ("stdout", "stderr", "pty"):
                yield {"event": {"data": {ev: _b64(blob)}}}, hold
            elif ev == "end":
                end = {k: frame[k] for k in ("exitCode", "exited", "status") if k in frame}
                yield {"event": {"end": end}}, hold
            elif ev == "keepalive":
                yield {"event": {"keepalive": {}}}, False

    def _process_Start(self, link, msg, user, entry):
        config = msg.get("process") or {}
        if not config.get("cmd"):
            raise ConnectError("invalid_argument", "process.cmd is required")
        req = {"op": "start", "cmd": config["cmd"], "args": config.get("args") or [],
               "envs": config.get("envs") or {}, "cwd": config.get("cwd"), "stdin": bool(msg.get("stdin")),
               "tag": msg.get("tag"), "user": user, "base_envs": entry.env_vars}
        if msg.get("pty") is not None:
            req["pty"] = _pty_size(msg["pty"])
        return self._events(_frames(link, req))

    def _process_Connect(self, link, msg, user, entry):
        return self._events(_frames(link, {"op": "connect", **_selector(msg)}))

    def _process_List(self, link, msg, user, entry):
        reply, _ = link.call({"op": "list"})
        return {"processes": reply["processes"]}

    def _process_SendInput(self, link, msg, user, entry):
        link.call(*_input(_selector(msg), msg.get("input") or {}))
        return {}

    def _process_stream_input(self, link, messages, entry):
        selector = None
        for msg in messages:
            if "start" in msg:
                selector = _selector(msg["start"])
            elif "data" in msg:
                if selector is None:
                    raise ConnectError("invalid_argument", "StreamInput: the start event must come first")
                link.call(*_input(selector, msg["data"].get("input") or {}))
        return {}

    _process_StreamInput = _process_stream_input

    def _process_SendSignal(self, link, msg, user, entry):
        sig = SIGNALS.get(msg.get("signal"))
        if sig is None:
            raise ConnectError("invalid_argument", f"signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM, "
                                                   f"got {msg.get('signal')!r}")
        link.call({"op": "signal", "signal": int(sig), **_selector(msg)})
        return {}

    def _process_Update(self, link, msg, user, entry):
        if msg.get("pty") is None:
            raise ConnectError("invalid_argument", "Update needs pty.size (the only process setting that changes)")
        link.call({"op": "resize", **_selector(msg), **_pty_size(msg["pty"])})
        return {}

    def _process_CloseStdin(self, link, msg, user, entry):
        link.call({"op": "close_stdin", **_selector(msg)})
        return {}

    # ---- filesystem.Filesystem -----------------------------------------------------------------------------
    def _filesystem_Stat(self, link, msg, user, entry):
        reply, _ = link.call({"op": "stat", "path": msg.get("path", ""), "user": user})
        return {"entry": reply["entry"]}

    def _filesystem_ListDir(self, link, msg, user, entry):
        reply, _ = link.call({"op": "list_dir", "path": msg.get("path", ""), "depth": msg.get("depth") or 1,
                              "user": user})
        return {"entries": reply["entries"]}

    def _filesystem_MakeDir(self, link, msg, user, entry):
        reply, _ = link.call({"op": "make_dir", "path": msg.get("path", ""), "user": user})
        return {"entry": reply["entry"]}

    def _filesystem_Move(self, link, msg, user, entry):
        reply, _ = link.call({"op": "move", "source": msg.get("source", ""),
                              "destination": msg.get("destination", ""), "user": user})
        return {"entry": reply["entry"]}

    def _filesystem_Remove(self, link, msg, user, entry):
        link.call({"op": "remove", "path": msg.get("path", ""), "user": user})
        return {}

    def _filesystem_WatchDir(self, link, msg, user, entry):
        req = {"op": "watch", "path": msg.get("path", ""), "recursive": bool(msg.get("recursive")),
               "include_entry": bool(msg.get("includeEntry")), "user": user}

        def events():
            for frame, _ in _frames(link, req):
                if frame.get("ev") == "start":
                    yield {"start": {}}, False
                elif frame.get("ev") == "fs":
                    yield {"filesystem": {k: frame[k] for k in ("name", "type", "entry") if k in frame}}, False
                elif frame.get("ev") == "keepalive":
                    yield {"keepalive": {}}, False

        return events()

    def _filesystem_CreateWatcher(self, link, msg, user, entry):
        reply, _ = link.call({"op": "watcher_create", "path": msg.get("path", ""),
                              "recursive": bool(msg.get("recursive")),
                              "include_entry": bool(msg.get("includeEntry")), "user": user})
        return {"watcherId": reply["watcherId"]}

    def _filesystem_GetWatcherEvents(self, link, msg, user, entry):
        reply, _ = link.call({"op": "watcher_events", "watcher_id": msg.get("watcherId", "")})
        return {"events": reply["events"]}

    def _filesystem_RemoveWatcher(self, link, msg, user, entry):
        link.call({"op": "watcher_remove", "watcher_id": msg.get("watcherId", "")})
        return {}

    # ---- /files ------------------------------------------------------------------------------------------
    def files(self, h: Handler, entry) -> None:
        link = self.registry.link(entry.id)
        user = h.query.get("username") or username(h)
        try:
            if h.command == "GET":
                path = h.query.get("path")
                if not path:
                    raise HTTPError(400, "query parameter 'path' is required")
                opened = open_regular_in_sandbox(entry.pid, path) if path.startswith("/") else None
                if opened is not None:  # a regular file at an absolute path: sent from the host, no agent hop
                    fd, size = opened
                    try:
                        h.send_file(200, fd, size)
                    finally:
                        os.close(fd)
                    return
                _, data = link.call({"op": "read", "path": path, "user": user})
                h.send_bytes(200, data)
                return
            if h.command != "POST":
                raise HTTPError(405, f"method {h.command} not allowed on /files")
            metadata = _upload_metadata(h)
            results = []
            for path, data in self._uploads(h):
                req = {"op": "write", "path": path, "user": user}
                if metadata:
                    req["metadata"] = metadata
                reply, _ = link.call(req, data)
                results.append({k: reply[k] for k in ("name", "type", "path", "metadata") if k in reply})
            h.send_json(200, results)
        except AgentError as e:
            raise HTTPError(connect.HTTP_STATUS.get(e.code, 500), str(e)) from e

    @staticmethod
    def _uploads(h: Handler) -> list[tuple[str, bytes | memoryview]]:
        body = h.body(MAX_BODY)
        if h.headers.get("Content-Encoding", "").lower() == "gzip":
            try:
                body = gzip.decompress(body)
            except (OSError, EOFError) as e:
                raise HTTPError(400, f"body is not valid gzip: {e}") from e
        ctype = h.headers.get("Content-Type", "")
        path = h.query.get("path")
        if not ctype.startswith("multipart/form-data"):
            if not path:
                raise HTTPError(400, "query parameter 'path' is required for an octet-stream upload")
            return [(path, body)]
        boundary = next((p.split("=", 1)[1].strip('"') for p in ctype.split(";") if p.strip().startswith("boundary=")),
                        None)
        if not boundary:
            raise HTTPError(400, "multipart upload without a boundary")
        files = []
        view = memoryview(body)
        delim = b"--" + boundary.encode()
        if not body.startswith(delim):
            raise HTTPError(400, "multipart body does not start with its boundary")
        pos = len(delim)
        while not body.startswith(b"--", pos):  # "--" after a delimiter closes the body
            head_end = body.find(b"\r\n\r\n", pos)
            # the long needle (CRLF + delimiter) keeps the scan over a large file fast
            content_end = body.find(b"\r\n" + delim, head_end + 4) if head_end >= 0 else -1
            if content_end < 0:
                raise HTTPError(400, "malformed multipart body (a part is not terminated by the boundary)")
            filename = None
            for line in body[pos:head_end].decode(errors="replace").split("\r\n"):
                if line.lower().startswith("content-disposition"):
                    for item in line.split(";"):
                        key, _, value = item.strip().partition("=")
                        if key == "filename":
                            filename = value.strip('"')
            target = path if path and len(files) == 0 else filename
            if not target:
                raise HTTPError(400, "multipart part without a filename and no 'path' parameter")
            files.append((target, view[head_end + 4 : content_end]))  # no copy of the file's bytes
            pos = content_end + 2 + len(delim)
        if path and len(files) > 1:
            raise HTTPError(400, "'path' names one file but the upload carries several")
        return files
