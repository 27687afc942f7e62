"""The code interpreter endpoint (port 49999) that `e2b_code_interpreter.Sandbox.run_code` calls.

``POST /execute`` with ``{"code", "context_id", "language", "env_vars"}`` answers a stream of JSON lines
(``stdout``, ``stderr``, ``result``, ``error``, ``end_of_execution``). It runs in the sandbox's persistent
Python session (the runtime's `Sandbox.python`), so variables, imports and functions survive between calls,
snapshots and forks. The session is one interpreter per sandbox: only the default context exists.
``env_vars`` apply to one execution and are restored afterwards.
"""

from __future__ import annotations

import json
import time

from agentenv import errors
from agentenv.server.httpd import Handler, HTTPError

RUN_TIMEOUT_S = 3600.0
_SAVE, _RESTORE = "__agentenv_env_save", "__agentenv_env_restore"
_SAVER = f"""
def {_SAVE}(keys):
    import os
    globals()['__agentenv_env_saved'] = {{k: os.environ.get(k) for k in keys}}

def {_RESTORE}():
    import os
    for k, v in globals().pop('__agentenv_env_saved', {{}}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
"""
"""Helpers defined in the session so that per-execution ``env_vars`` are undone after the call."""


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1e6):06d}Z"


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
    if req.get("context_id") not in (None, "default"):
        raise HTTPError(404, f"context {req.get('context_id')!r} not found: only the default context exists")
    envs = req.get("env_vars") or {}
    if not isinstance(envs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items()):
        raise HTTPError(400, "env_vars must map strings to strings")
    try:
        if envs:  # for this execution only: set on one prefixed line (tracebacks shift by one), restored after
            code = f"{_SAVE}({list(envs)!r}); __import__('os').environ.update({envs!r})\n" + code
            sandbox.python.run(_SAVER, timeout=RUN_TIMEOUT_S)
        try:
            result = sandbox.python.run(code, timeout=RUN_TIMEOUT_S)
        finally:
            if envs:
                sandbox.python.run(f"{_RESTORE}()", timeout=RUN_TIMEOUT_S)
    except errors.SandboxTimeoutError as e:
        raise HTTPError(504, f"code ran past {RUN_TIMEOUT_S} s: {e}") from e
    except errors.SandboxError as e:
        raise HTTPError(502, f"the sandbox's interpreter is unavailable: {e}") from e
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


def contexts(h: Handler) -> None:
    """``/contexts``: only the default Python context exists (one persistent interpreter per sandbox)."""
    if h.command == "GET":
        h.send_json(200, [{"id": "default", "language": "python", "cwd": "/root"}])
        return
    raise HTTPError(501, "agentenv has one persistent Python session per sandbox; new contexts are not supported")
