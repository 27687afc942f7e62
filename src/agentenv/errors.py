"""Exceptions. Each also subclasses the matching builtin, so `except TimeoutError` works as expected.

`SandboxError` is the root. Tool-server replies carry an error kind (see `agentenv.protocol.ERROR_KINDS`)
that `from_reply` maps through one fixed table; nothing is imported by a name taken from a reply.
"""

from __future__ import annotations


class SandboxError(Exception):
    """A runtime fault in a sandbox or in the runtime itself."""


class SandboxTimeoutError(SandboxError, TimeoutError):
    """A command, code or request ran past its timeout (the sandbox stays usable)."""


class SandboxNotFoundError(SandboxError, LookupError):
    """No live sandbox, snapshot or image with that id or name."""


class SandboxGoneError(SandboxError):
    """The sandbox's tool server is gone: destroyed, expired (TTL) or killed (e.g. OOM)."""


class NotFoundError(SandboxError, FileNotFoundError):
    """A path inside the sandbox does not exist."""


class CommandNotFoundError(SandboxError, FileNotFoundError):
    """The program to run does not exist (or is not executable) inside the sandbox."""


class InvalidArgumentError(SandboxError, ValueError):
    """The sandbox refused an argument (e.g. an unknown op or a path that is not a directory)."""


class SandboxPermissionError(SandboxError, PermissionError):
    """The sandbox denied the operation."""


class SandboxIsADirectoryError(SandboxError, IsADirectoryError):
    """A file operation got a directory."""


class SandboxFileExistsError(SandboxError, FileExistsError):
    """The path already exists."""


_BY_KIND: dict[str, type[SandboxError]] = {
    "timeout": SandboxTimeoutError,
    "not_found": NotFoundError,
    "command": CommandNotFoundError,
    "invalid": InvalidArgumentError,
    "permission": SandboxPermissionError,
    "is_directory": SandboxIsADirectoryError,
    "exists": SandboxFileExistsError,
    "internal": SandboxError,
}


def from_reply(reply: dict) -> SandboxError:
    """The exception for a failed tool-server reply (`{"ok": false, "error": kind, "message": ...}`)."""
    cls = _BY_KIND.get(str(reply.get("error")), SandboxError)
    return cls(str(reply.get("message", "sandbox request failed")))
