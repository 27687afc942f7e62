"""The code interpreter endpoints (port 49999) that `e2b_code_interpreter.Sandbox` calls.

``POST /execute`` with ``{"code", "context_id", "language", "env_vars"}`` answers a stream of JSON lines
(``stdout``, ``stderr``, ``result``, ``error``, ``end_of_execution``). Code runs in the sandbox's persistent
Python interpreter (the runtime's `Sandbox.python`): each context is its own kernel process, so variables,
imports and functions survive between calls, snapshots and forks, and a crash of one context's kernel (a
segfault, ``os._exit``, an OOM kill) comes back as error ``DeadKernelError`` while the sandbox and the other
contexts live on; the context's next execution starts a fresh kernel. ``env_vars`` apply to one execution.

Contexts (``/contexts``: create, list, restart, delete); ``default`` always exists.
"""

from __future__ import annotations

import json
import re
import time

from agentenv import errors
from agentenv.server.httpd import Handler, HTTPError

RUN_TIMEOUT_S = 3600.0
DEFAULT_CONTEXT = "default"
_CONTEXT_ROUTE = re.compile(r"^/contexts/([A-Za-z0-9_-]+)(/restart)?$")


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1e6):06d}Z"


def _call(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except errors.NotFoundError as e:
        raise HTTPError(404, f"{what} not found (create it with create_code_context): {e}") from e
    except errors.SandboxTimeoutError as e:
        raise HTTPError(504, f"code ran past {RUN_TIMEOUT_S} s: {e}") from e
    except errors.SandboxError as e:
        raise HTTPError(502, f"the sandbox's interpreter is unavailable: {e}") from e


def execute(h: Handler, sandbox) -> None:
    """Serve ``/execute`` for the runtime sandbox `sandbox`."""
    if h.command != "POST":
        raise HTTPError(405, "use POST /execute")
    req = h.json_body()
    code = req.get("code")
    if not isinstance(code, str):
        raise HTTPError(400, "'code' must be a string")
    if req.get("language") not in (None, "python", "python3"):
        raise HTTPError(400, f"language {req.get('language')!r} is not supported: only python runs here")
    context = req.get("context_id") or DEFAULT_CONTEXT
    if not isinstance(context, str):
        raise HTTPError(400, "'context_id' must be a string")
    envs = req.get("env_vars") or {}
    if not isinstance(envs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items()):
        raise HTTPError(400, "env_vars must map strings to strings")
    result = _call(f"context {context!r}", sandbox.python.run, code, timeout=RUN_TIMEOUT_S,
                   context=None if context == DEFAULT_CONTEXT else context, envs=envs or None)
    h.start_chunked(200, "application/x-ndjson")
    stamp = _now()
    if result.stdout:
        h.write_chunk(_line({"type": "stdout", "text": result.stdout, "timestamp": stamp}))
    if result.stderr:
        h.write_chunk(_line({"type": "stderr", "text": result.stderr, "timestamp": stamp}))
    if result.error:
        lines = result.traceback.rstrip().splitlines()
        value = lines[-1].split(":", 1)[1].strip() if lines and ":" in lines[-1] else ""
        h.write_chunk(_line({"type": "error", "name": result.error, "value": value, "traceback": result.traceback}))
    elif result.value is not None:
        h.write_chunk(_line({"type": "result", "text": result.value, "is_main_result": True}))
    h.write_chunk(_line({"type": "end_of_execution"}))
    h.end_chunked()


def contexts(h: Handler, sandbox) -> None:
    """``/contexts`` (GET list, POST create) and ``/contexts/{id}`` (DELETE) and ``/contexts/{id}/restart``."""
    if h.route == "/contexts":
        if h.command == "GET":
            table = _call("contexts", sandbox.python.contexts)
            h.send_json(200, [{"id": c["id"], "language": "python", "cwd": c["cwd"] or ""} for c in table])
            return
        if h.command != "POST":
            raise HTTPError(405, f"{h.command} not allowed on /contexts")
        req = h.json_body()
        if req.get("language") not in (None, "python", "python3"):
            raise HTTPError(400, f"language {req.get('language')!r} is not supported: only python runs here")
        cwd = req.get("cwd")
        if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
            raise HTTPError(400, f"cwd must be an absolute path, got {cwd!r}")
        cid = _call("contexts", sandbox.python.create_context, cwd)
        h.send_json(200, {"id": cid, "language": "python", "cwd": cwd or ""})
        return
    m = _CONTEXT_ROUTE.match(h.route)
    if m is None:
        raise HTTPError(404, f"no route {h.route} on the code interpreter")
    cid, restart = m.group(1), m.group(2)
    if restart and h.command == "POST":
        _call(f"context {cid!r}", sandbox.python.restart_context, cid)
    elif not restart and h.command == "DELETE":
        _call(f"context {cid!r}", sandbox.python.remove_context, cid)
    else:
        raise HTTPError(405, f"{h.command} not allowed on {h.route}")
    h.send_empty(204)
