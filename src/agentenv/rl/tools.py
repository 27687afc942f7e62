"""The agent's tools: OpenAI-style function schemas, argument checks, and execution in a sandbox.

An action is an OpenAI tool call (``{"id", "type": "function", "function": {"name", "arguments": "<json>"}}``)
or the short form ``{"name", "arguments": {...}}``. Every failure an agent can cause (unknown tool, malformed
or missing arguments, a command timing out, a missing file, oversized output, a sandbox that expired) comes
back as a `ToolOutput` with a structured `error`, so an episode never crashes on bad model output.

Example::

    >>> [s["function"]["name"] for s in tool_schemas()]
    ['run_shell', 'run_python', 'read_file', 'write_file', 'edit_file', 'list_files', 'submit']
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentenv import errors
from agentenv.rl.backends import SandboxHandle


@dataclass
class ToolCall:
    """A parsed action."""

    name: str
    arguments: dict
    call_id: str = ""


@dataclass
class ToolOutput:
    """What a tool call produced; `content` is the text shown to the policy."""

    content: str
    data: dict = field(default_factory=dict)
    """Structured result (exit code, stdout, value, ...)."""
    error: dict | None = None
    """``{"type": ..., "message": ...}`` when the call failed; types are listed in `ERROR_TYPES`."""
    truncated: bool = False
    submitted: bool = False
    answer: str | None = None

    def to_dict(self) -> dict:
        return {"content": self.content, "data": self.data, "error": self.error, "truncated": self.truncated,
                "submitted": self.submitted, "answer": self.answer}


ERROR_TYPES = ("unknown_tool", "invalid_action", "invalid_arguments", "timeout", "not_found", "is_directory",
               "permission", "sandbox_error", "sandbox_lost")
"""Kinds of `ToolOutput.error["type"]`."""


@dataclass
class ToolContext:
    """Per-episode settings the tools need."""

    workdir: str
    timeout_s: float
    max_output: int


@dataclass
class Tool:
    """A tool: its OpenAI function schema and the function that runs it."""

    name: str
    description: str
    parameters: dict
    run: Callable[[SandboxHandle, dict, ToolContext], ToolOutput]

    def schema(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def _params(required: list[str], **props: dict) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _cut(text: str, limit: int) -> tuple[str, bool]:
    raw = text.encode()
    if len(raw) <= limit:
        return text, False
    return raw[:limit].decode(errors="ignore"), True


def _resolve(path: str, ctx: ToolContext) -> str:
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(ctx.workdir, path))


def _with_note(text: str, truncated: bool, limit: int) -> str:
    return text + (f"\n[output truncated to {limit} bytes]" if truncated else "")


def _run_shell(h: SandboxHandle, args: dict, ctx: ToolContext) -> ToolOutput:
    timeout = min(float(args.get("timeout", ctx.timeout_s)), ctx.timeout_s)
    r = h.exec(args["command"], cwd=ctx.workdir, timeout_s=timeout, max_output=ctx.max_output)
    out, cut1 = _cut(r.stdout, ctx.max_output)
    err, cut2 = _cut(r.stderr, ctx.max_output)
    truncated = r.truncated or cut1 or cut2
    content = f"exit_code: {r.exit_code}\n" + (f"stdout:\n{out}" if out else "") + (f"\nstderr:\n{err}" if err else "")
    return ToolOutput(_with_note(content, truncated, ctx.max_output),
                      {"exit_code": r.exit_code, "stdout": out, "stderr": err}, truncated=truncated)


def _run_python(h: SandboxHandle, args: dict, ctx: ToolContext) -> ToolOutput:
    r = h.python(args["code"], timeout_s=ctx.timeout_s)
    out, cut1 = _cut(r.stdout, ctx.max_output)
    err, cut2 = _cut(r.stderr, ctx.max_output)
    value, cut3 = _cut(r.value or "", ctx.max_output)
    tb, _ = _cut(r.traceback or "", ctx.max_output)
    truncated = cut1 or cut2 or cut3
    parts = [out] if out else []
    if err:
        parts.append(f"stderr:\n{err}")
    if r.value is not None:
        parts.append(value)
    if r.error:
        parts.append(tb or r.error)
    data = {"stdout": out, "stderr": err, "value": r.value if r.value is None else value, "error": r.error}
    return ToolOutput(_with_note("\n".join(parts), truncated, ctx.max_output), data, truncated=truncated)


def _read_file(h: SandboxHandle, args: dict, ctx: ToolContext) -> ToolOutput:
    path = _resolve(args["path"], ctx)
    text = h.read(path).decode(errors="replace")
    lines = text.splitlines(keepends=True)
    start = max(0, int(args.get("offset", 1)) - 1)
    limit = args.get("limit")
    chosen = "".join(lines[start : start + int(limit)] if limit is not None else lines[start:])
    out, truncated = _cut(chosen, ctx.max_output)
    return ToolOutput(_with_note(out, truncated, ctx.max_output), {"path": path, "lines": len(lines)},
                      truncated=truncated)


def _write_file(h: SandboxHandle, args: dict, ctx: ToolContext) -> ToolOutput:
    path = _resolve(args["path"], ctx)
    data = args["content"].encode()
    h.write(path, data)
    return ToolOutput(f"wrote {len(data)} bytes to {path}", {"path": path, "bytes": len(data)})


def _edit_file(h: SandboxHandle, args: dict, ctx: ToolContext) -> ToolOutput:
    path = _resolve(args["path"], ctx)
    text = h.read(path).decode()
    old, new = args["old"], args["new"]
    count = text.count(old) if old else 0
    if count != 1:
        why = "old is empty" if not old else f"old occurs {count} times in {path}; it must occur exactly once"
        return ToolOutput(f"error: {why}", error={"type": "invalid_arguments", "message": why})
    h.write(path, text.replace(old, new, 1).encode())
    return ToolOutput(f"edited {path}", {"path": path})


def _list_files(h: SandboxHandle, args: dict, ctx: ToolContext) -> ToolOutput:
    path = _resolve(args.get("path", "."), ctx)
    entries = h.list(path)
    lines = [f"{e.name}{'/' if e.type == 'dir' else ''}\t{e.size}" for e in entries]
    out, truncated = _cut("\n".join(lines), ctx.max_output)
    return ToolOutput(_with_note(out, truncated, ctx.max_output),
                      {"path": path, "entries": [e.name for e in entries]}, truncated=truncated)


def _submit(h: SandboxHandle, args: dict, ctx: ToolContext) -> ToolOutput:
    answer = args.get("answer")
    return ToolOutput("submitted", {"answer": answer}, submitted=True, answer=answer)


TOOLS: dict[str, Tool] = {t.name: t for t in (
    Tool("run_shell", "Run a shell command (/bin/sh -c) in the task directory and return its exit code and output.",
         _params(["command"], command={"type": "string", "description": "The command line."},
                 timeout={"type": "number", "description": "Seconds before the command is killed (capped)."}),
         _run_shell),
    Tool("run_python", "Run Python code in a persistent interpreter (variables and imports survive between calls); "
         "the value of a trailing expression is returned.",
         _params(["code"], code={"type": "string", "description": "Python source."}), _run_python),
    Tool("read_file", "Read a text file (paths relative to the task directory), optionally a range of lines.",
         _params(["path"], path={"type": "string"},
                 offset={"type": "integer", "description": "First line, 1-based.", "minimum": 1},
                 limit={"type": "integer", "description": "Number of lines.", "minimum": 1}),
         _read_file),
    Tool("write_file", "Create or overwrite a file with the given content (parent directories are created).",
         _params(["path", "content"], path={"type": "string"}, content={"type": "string"}), _write_file),
    Tool("edit_file", "Replace the one occurrence of `old` in a file with `new`.",
         _params(["path", "old", "new"], path={"type": "string"}, old={"type": "string"}, new={"type": "string"}),
         _edit_file),
    Tool("list_files", "List a directory (default: the task directory).",
         _params([], path={"type": "string"}), _list_files),
    Tool("submit", "Finish the episode; the solution is then checked. Put a final answer in `answer` if the task "
         "asks for one.", _params([], answer={"type": "string"}), _submit),
)}


def tool_schemas(names: list[str] | None = None) -> list[dict]:
    """OpenAI ``tools=[...]`` entries for the given tool names (default: all), JSON-serialisable."""
    if names is None:
        return [t.schema() for t in TOOLS.values()]
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"names: unknown tools {unknown}; known: {sorted(TOOLS)}")
    return [TOOLS[n].schema() for n in names]


_JSON_TYPES: dict[str, tuple] = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,)}


def check_arguments(tool: Tool, args: Any) -> str | None:
    """Why `args` do not fit `tool`'s schema, or None if they do."""
    if not isinstance(args, dict):
        return f"arguments must be a JSON object, got {type(args).__name__}"
    props, required = tool.parameters["properties"], tool.parameters["required"]
    missing = [k for k in required if k not in args]
    if missing:
        return f"missing required argument(s) {missing} for {tool.name}"
    extra = [k for k in args if k not in props]
    if extra:
        return f"unknown argument(s) {extra} for {tool.name}; expected {sorted(props)}"
    for key, value in args.items():
        spec = props[key]
        kinds = _JSON_TYPES[spec["type"]]
        if not isinstance(value, kinds) or (spec["type"] != "boolean" and isinstance(value, bool)):
            return f"argument {key!r} of {tool.name} must be {spec['type']}, got {type(value).__name__}"
        if "minimum" in spec and value < spec["minimum"]:
            return f"argument {key!r} of {tool.name} must be >= {spec['minimum']}, got {value}"
    return None


def parse_action(action: Any) -> ToolCall | ToolOutput:
    """A `ToolCall`, or a `ToolOutput` carrying the error if `action` is malformed."""
    def bad(kind: str, message: str) -> ToolOutput:
        return ToolOutput(f"error: {message}", error={"type": kind, "message": message})

    if not isinstance(action, dict):
        return bad("invalid_action", f"an action must be a tool call object, got {type(action).__name__}")
    call_id = str(action.get("id", ""))
    fn = action.get("function", action)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return bad("invalid_action", "a tool call needs function.name (a string)")
    name, args = fn["name"], fn.get("arguments", {})
    if name not in TOOLS:
        return bad("unknown_tool", f"unknown tool {name!r}; available: {', '.join(TOOLS)}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return bad("invalid_arguments", f"arguments of {name} are not valid JSON: {e}")
    problem = check_arguments(TOOLS[name], args)
    if problem:
        return bad("invalid_arguments", problem)
    return ToolCall(name, args, call_id)


_FAULTS: tuple[tuple[type, str], ...] = (
    (errors.SandboxTimeoutError, "timeout"),
    (errors.NotFoundError, "not_found"),
    (errors.CommandNotFoundError, "not_found"),
    (errors.SandboxIsADirectoryError, "is_directory"),
    (errors.SandboxPermissionError, "permission"),
    (errors.InvalidArgumentError, "invalid_arguments"),
    (errors.SandboxGoneError, "sandbox_lost"),
    (errors.SandboxNotFoundError, "sandbox_lost"),
)


def run_tool(handle: SandboxHandle, call: ToolCall, ctx: ToolContext) -> ToolOutput:
    """Execute `call`; sandbox faults become `ToolOutput.error` (``sandbox_lost`` means the sandbox is gone)."""
    try:
        return TOOLS[call.name].run(handle, call.arguments, ctx)
    except errors.SandboxError as e:
        kind = next((k for cls, k in _FAULTS if isinstance(e, cls)), "sandbox_error")
        return ToolOutput(f"error ({kind}): {e}", error={"type": kind, "message": str(e)})
    except UnicodeDecodeError as e:
        return ToolOutput(f"error: file is not UTF-8 text ({e})", error={"type": "invalid_arguments",
                                                                         "message": str(e)})
