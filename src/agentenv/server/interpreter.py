"""The code interpreter endpoints (port 49999) that `e2b_code_interpreter.Sandbox` calls.

``POST /execute`` with ``{"code", "context_id", "language", "env_vars"}`` answers a stream of JSON lines
(``stdout``, ``stderr``, ``result``, ``error``, ``end_of_execution``). Code runs in the sandbox's persistent
Python session (the runtime's `Sandbox.python`), so variables, imports and functions survive between calls,
snapshots and forks. ``env_vars`` apply to one execution and are restored afterwards.

Contexts (``/contexts``: create, list, restart, delete) are separate global namespaces kept *inside* that
session (helpers named ``__agentenv_*`` in its globals), so they too survive snapshots and forks; a
context's ``cwd`` is entered for each of its executions and left afterwards. ``default`` is the session's
own namespace.
"""

from __future__ import annotations

import ast
import json
import re
import time
import uuid

from agentenv import errors
from agentenv.server.httpd import Handler, HTTPError

RUN_TIMEOUT_S = 3600.0
DEFAULT_CONTEXT = "default"
_CONTEXT_ROUTE = re.compile(r"^/contexts/([A-Za-z0-9_-]+)(/restart)?$")
_HELPERS = '''
class __AgentenvNoContext(LookupError):
    pass

def __agentenv_env_save(keys):
    import os
    globals()['__agentenv_env_saved'] = {k: os.environ.get(k) for k in keys}

def __agentenv_env_restore():
    import os
    for k, v in globals().pop('__agentenv_env_saved', {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v

def __agentenv_ctx_table():
    return globals().setdefault('__agentenv_contexts', {})

def __agentenv_ctx_new(cid, cwd):
    __agentenv_ctx_table()[cid] = {'cwd': cwd, 'globals': {'__name__': '__main__'}}

def __agentenv_ctx_run(cid, code):
    import ast, os
    ctx = __agentenv_ctx_table().get(cid)
    if ctx is None:
        raise __AgentenvNoContext(cid)
    tree = ast.parse(code, '<context>', 'exec')
    last = ast.Expression(tree.body.pop().value) if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    here = os.getcwd()
    if ctx['cwd']:
        os.chdir(ctx['cwd'])
    try:
        exec(compile(tree, '<context>', 'exec'), ctx['globals'])
        return None if last is None else eval(compile(last, '<context>', 'eval'), ctx['globals'])
    finally:
        os.chdir(here)
'''
"""Defined in the session before each helper call (cheap, and present again after any restore)."""
_NO_CONTEXT = "__AgentenvNoContext"


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1e6):06d}Z"


def _session(sandbox, code: str):
    try:
        return sandbox.python.run(code, timeout=RUN_TIMEOUT_S)
    except errors.SandboxTimeoutError as e:
        raise HTTPError(504, f"code ran past {RUN_TIMEOUT_S} s: {e}") from e
    except errors.SandboxError as e:
        raise HTTPError(502, f"the sandbox's interpreter is unavailable: {e}") from e


def _helper(sandbox, call: str):
    """Evaluate a helper call (after defining the helpers); returns its value as a Python literal."""
    result = _session(sandbox, _HELPERS + call)
    if result.error:
        raise HTTPError(500, f"context bookkeeping failed: {result.error}")
    return ast.literal_eval(result.value) if result.value is not None else None


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
    if context != DEFAULT_CONTEXT:
        code = f"__agentenv_ctx_run({context!r}, {code!r})"
    if envs:  # set on one prefixed line (a default-context traceback shifts by one line)
        code = f"__agentenv_env_save({list(envs)!r}); __import__('os').environ.update({envs!r})\n" + code
    if envs or context != DEFAULT_CONTEXT:
        _session(sandbox, _HELPERS)
    try:
        result = _session(sandbox, code)
    finally:
        if envs:
            _session(sandbox, "__agentenv_env_restore()")
    if result.error == _NO_CONTEXT:
        raise HTTPError(404, f"context {context!r} not found (create it with create_code_context)")
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
            table = _helper(sandbox, "sorted((k, v['cwd']) for k, v in __agentenv_ctx_table().items())")
            h.send_json(200, [{"id": DEFAULT_CONTEXT, "language": "python", "cwd": ""}]
                        + [{"id": cid, "language": "python", "cwd": cwd or ""} for cid, cwd in table or []])
            return
        if h.command != "POST":
            raise HTTPError(405, f"{h.command} not allowed on /contexts")
        req = h.json_body()
        if req.get("language") not in (None, "python", "python3"):
            raise HTTPError(400, f"language {req.get('language')!r} is not supported: only python runs here")
        cwd = req.get("cwd")
        if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
            raise HTTPError(400, f"cwd must be an absolute path, got {cwd!r}")
        cid = uuid.uuid4().hex
        _helper(sandbox, f"__agentenv_ctx_new({cid!r}, {cwd!r})")
        h.send_json(200, {"id": cid, "language": "python", "cwd": cwd or ""})
        return
    m = _CONTEXT_ROUTE.match(h.route)
    if m is None:
        raise HTTPError(404, f"no route {h.route} on the code interpreter")
    cid, restart = m.group(1), m.group(2)
    if restart and h.command == "POST":
        ok = _helper(sandbox, f"({cid!r} in __agentenv_ctx_table()) and "
                              f"(__agentenv_ctx_new({cid!r}, __agentenv_ctx_table()[{cid!r}]['cwd']) or True)")
    elif not restart and h.command == "DELETE":
        ok = _helper(sandbox, f"__agentenv_ctx_table().pop({cid!r}, None) is not None")
    else:
        raise HTTPError(405, f"{h.command} not allowed on {h.route}")
    if not ok:
        raise HTTPError(404, f"context {cid!r} not found")
    h.send_empty(204)
