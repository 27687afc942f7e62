"""The OpenAPI 3.1 document of the whole API (served at ``GET /agentenv/v1/openapi.json``).

Built from one route table, so the document and the tests that walk it cannot drift apart silently.
"""

from __future__ import annotations

from agentenv import __version__

_ERR = {"$ref": "#/components/schemas/Error"}
_SANDBOX = {"$ref": "#/components/schemas/Sandbox"}
_LISTED = {"$ref": "#/components/schemas/ListedSandbox"}
_SNAP = {"$ref": "#/components/schemas/SnapshotInfo"}


def _obj(**props: dict) -> dict:
    return {"type": "object", "properties": props}


_STR, _INT, _NUM, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_ACTION = {"oneOf": [_obj(type={"const": "bash"}, command=_STR), _obj(type={"const": "python"}, code=_STR)]}

# (method, path, tag, summary, request body schema or None, {status: response schema or None})
ROUTES: list[tuple[str, str, str, str, dict | None, dict[int, dict | None]]] = [
    ("post", "/sandboxes", "sandboxes", "Create a sandbox (v1)",
     _obj(templateID=_STR, timeout=_INT, metadata=_MAP, envVars=_MAP), {201: _SANDBOX}),
    ("post", "/v2/sandboxes", "sandboxes", "Create a sandbox from an image, template or snapshot",
     _obj(templateID=_STR, timeout=_INT, metadata=_MAP, envVars=_MAP), {201: _SANDBOX}),
    ("get", "/sandboxes", "sandboxes", "List this key's sandboxes (v1, unpaginated)", None,
     {200: {"type": "array", "items": _LISTED}}),
    ("get", "/v2/sandboxes", "sandboxes", "List sandboxes; filters state, metadata; pages via x-next-token",
     None, {200: {"type": "array", "items": _LISTED}}),
    ("get", "/sandboxes/{sandboxID}", "sandboxes", "Sandbox details", None, {200: _LISTED}),
    ("delete", "/sandboxes/{sandboxID}", "sandboxes", "Kill a sandbox", None, {204: None}),
    ("post", "/sandboxes/{sandboxID}/timeout", "sandboxes", "Set the timeout (seconds from now)",
     _obj(timeout=_INT), {204: None}),
    ("post", "/sandboxes/{sandboxID}/refreshes", "sandboxes", "Extend the timeout", _obj(duration=_INT),
     {204: None}),
    ("post", "/sandboxes/{sandboxID}/pause", "sandboxes", "Pause (freeze every process)", None, {204: None}),
    ("post", "/sandboxes/{sandboxID}/resume", "sandboxes", "Resume a paused sandbox", _obj(timeout=_INT),
     {201: _SANDBOX}),
    ("post", "/sandboxes/{sandboxID}/connect", "sandboxes", "Connect (resumes if paused)", _obj(timeout=_INT),
     {200: _SANDBOX, 201: _SANDBOX}),
    ("post", "/v2/sandboxes/{sandboxID}/connect", "sandboxes", "Connect (resumes if paused)", _obj(timeout=_INT),
     {200: _SANDBOX, 201: _SANDBOX}),
    ("post", "/sandboxes/{sandboxID}/snapshots", "snapshots", "Snapshot files and interpreter state",
     _obj(name=_STR), {201: _SNAP}),
    ("post", "/sandboxes/{sandboxID}/fork", "sandboxes", "Fork into count live copies",
     _obj(count=_INT, timeout=_INT), {201: {"type": "array", "items": _obj(sandbox=_SANDBOX, error=_ERR)}}),
    ("get", "/sandboxes/{sandboxID}/metrics", "sandboxes", "Resource metrics (one sample)", None,
     {200: {"type": "array", "items": {"type": "object"}}}),
    ("get", "/snapshots", "snapshots", "List snapshots (sandboxID filter, x-next-token pages)", None,
     {200: {"type": "array", "items": _SNAP}}),
    ("delete", "/templates/{snapshotID}", "snapshots", "Delete a snapshot", None, {204: None}),
    ("post", "/agentenv/v1/sandboxes/{sandboxID}/fork", "agentenv", "Fork into n live copies",
     _obj(n=_INT, timeout=_INT), {201: _obj(sandboxes={"type": "array", "items": _SANDBOX})}),
    ("post", "/agentenv/v1/sandboxes/{sandboxID}/snapshot", "agentenv", "Snapshot", _obj(name=_STR),
     {201: _SNAP}),
    ("post", "/agentenv/v1/snapshots/{snapshotID}/restore", "agentenv", "New sandbox from a snapshot",
     _obj(timeout=_INT, metadata=_MAP), {201: _SANDBOX}),
    ("post", "/agentenv/v1/sandboxes/{sandboxID}/reset", "agentenv",
     "New episode: replace the sandbox with one restored from snapshotID", _obj(snapshotID=_STR, timeout=_INT),
     {201: _obj(sandbox=_SANDBOX, observation=_STR, info={"type": "object"})}),
    ("post", "/agentenv/v1/sandboxes/{sandboxID}/step", "agentenv",
     "Run one action; the last line printed by reward_cmd is the reward",
     _obj(action=_ACTION, reward_cmd=_STR, timeout=_NUM, terminate=_BOOL),
     {200: _obj(observation={"type": "object"}, reward=_NUM, terminated=_BOOL, truncated=_BOOL,
                info={"type": "object"})}),
    ("get", "/agentenv/v1/info", "agentenv", "This key's usage, quota, and what a restart found gone", None,
     {200: {"type": "object"}}),
    ("get", "/agentenv/v1/openapi.json", "agentenv", "This document", None, {200: {"type": "object"}}),
    ("get", "/health", "agentenv", "Server liveness", None, {200: {"type": "object"}}),
]

SANDBOX_ROUTES: list[tuple[str, str, str]] = [
    ("post", "/process.Process/Start", "Start a process (on a PTY when `pty` is set); server stream of start, "
                                        "data, end events"),
    ("post", "/process.Process/Connect", "Re-attach to a process's output stream"),
    ("post", "/process.Process/List", "Running processes"),
    ("post", "/process.Process/SendInput", "Write to a process's stdin or PTY"),
    ("post", "/process.Process/Update", "Resize a process's PTY"),
    ("post", "/process.Process/StreamInput", "Client stream of stdin writes"),
    ("post", "/process.Process/SendSignal", "SIGTERM or SIGKILL a process group"),
    ("post", "/process.Process/CloseStdin", "Close a process's stdin"),
    ("post", "/filesystem.Filesystem/Stat", "Entry info"),
    ("post", "/filesystem.Filesystem/ListDir", "Directory entries to a depth"),
    ("post", "/filesystem.Filesystem/MakeDir", "Make a directory (already_exists if present)"),
    ("post", "/filesystem.Filesystem/Move", "Rename"),
    ("post", "/filesystem.Filesystem/Remove", "Remove a file or a tree"),
    ("post", "/filesystem.Filesystem/WatchDir", "Server stream of filesystem events"),
    ("post", "/filesystem.Filesystem/CreateWatcher", "Start a polled watcher"),
    ("post", "/filesystem.Filesystem/GetWatcherEvents", "Events since the last poll"),
    ("post", "/filesystem.Filesystem/RemoveWatcher", "Stop a watcher"),
    ("get", "/files", "Download a file (?path=)"),
    ("post", "/files", "Upload: multipart/form-data or application/octet-stream (?path=); X-Metadata-<key> headers "
                       "set user metadata (user.e2b.<key> xattrs) on each file"),
    ("get", "/health", "envd liveness (204)"),
    ("post", "/execute", "Code interpreter (E2b-Sandbox-Port: 49999): NDJSON stream of outputs"),
    ("get", "/contexts", "Code interpreter contexts (namespaces in the persistent session)"),
    ("post", "/contexts", "Create a context {cwd, language}"),
    ("delete", "/contexts/{contextID}", "Remove a context"),
    ("post", "/contexts/{contextID}/restart", "Clear a context's namespace"),
    ("get", "/{path}", "Any other E2b-Sandbox-Port: HTTP proxied to 127.0.0.1:<port> inside the sandbox"),
]


def document() -> dict:
    """The OpenAPI 3.1 document (a fresh dict each call)."""
    paths: dict[str, dict] = {}
    for method, path, tag, summary, body, responses in ROUTES:
        op: dict = {"tags": [tag], "summary": summary, "security": [{"ApiKey": []}],
                    "responses": {str(code): ({"description": "OK"} if schema is None else
                                              {"description": "OK",
                                               "content": {"application/json": {"schema": schema}}})
                                  for code, schema in responses.items()}}
        for code in (400, 401, 403, 404, 409, 413, 429, 500):
            op["responses"].setdefault(str(code), {"description": "Error",
                                                   "content": {"application/json": {"schema": _ERR}}})
        if body is not None:
            op["requestBody"] = {"content": {"application/json": {"schema": body}}}
        params = [{"name": p.strip("{}"), "in": "path", "required": True, "schema": _STR}
                  for p in path.split("/") if p.startswith("{")]
        if params:
            op["parameters"] = params
        paths.setdefault(path, {})[method] = op
    sandbox_headers = [{"name": "E2b-Sandbox-Id", "in": "header", "required": True, "schema": _STR},
                       {"name": "E2b-Sandbox-Port", "in": "header", "schema": _STR,
                        "description": "49983 envd (default), 49999 code interpreter, anything else: proxied"}]
    for method, path, summary in SANDBOX_ROUTES:
        key = f"{path} (in-sandbox)"
        content = "application/connect+json or application/json (Connect protocol, JSON codec)" \
            if "." in path.split("/")[1] else "see summary"
        paths.setdefault(key, {})[method] = {
            "tags": ["in-sandbox"], "summary": summary, "description": content, "parameters": sandbox_headers,
            "security": [{"AccessToken": []}], "responses": {"200": {"description": "OK"},
                                                             "502": {"description": "Sandbox not running"}}}
    sandbox_props = {k: _STR for k in ("templateID", "sandboxID", "clientID", "alias", "envdVersion",
                                       "envdAccessToken")}
    listed_props = {**{k: _STR for k in ("templateID", "sandboxID", "clientID", "startedAt", "endAt",
                                         "envdVersion")},
                    "cpuCount": _INT, "memoryMB": _INT, "diskSizeMB": _INT,
                    "state": {"enum": ["running", "paused"]}, "metadata": _MAP}
    return {
        "openapi": "3.1.0",
        "info": {"title": "AgentEnv server (E2B-compatible)", "version": __version__,
                 "description": "E2B's control plane and envd services over the agentenv runtime, plus "
                                "fork/snapshot/restore/reset/step extensions under /agentenv/v1."},
        "servers": [{"url": "http://127.0.0.1:3000"}],
        "paths": paths,
        "components": {
            "securitySchemes": {"ApiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
                                "AccessToken": {"type": "apiKey", "in": "header", "name": "X-Access-Token"}},
            "schemas": {
                "Error": {"type": "object", "required": ["code", "message"],
                          "properties": {"code": _INT, "message": _STR}},
                "Sandbox": {"type": "object", "properties": sandbox_props},
                "ListedSandbox": {"type": "object", "properties": listed_props},
                "SnapshotInfo": {"type": "object", "properties": {"snapshotID": _STR,
                                                                  "names": {"type": "array", "items": _STR}}},
            },
        },
    }
