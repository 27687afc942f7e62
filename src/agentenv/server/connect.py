"""The Connect protocol (connectrpc.com/docs/protocol) in its JSON codec, as the E2B SDK speaks it to envd.

Unary calls: the request body is one JSON message (``Content-Type: application/json``); a success is ``200``
with one JSON message; a failure is an HTTP status mapped from the error code with body
``{"code": "not_found", "message": "..."}``.

Streaming calls (``application/connect+json``): every message in either direction is an *envelope*, a
5-byte prefix (1 flag byte, 4-byte big-endian length) and the JSON. The response ends with an end-stream
envelope (flag ``0x02``) holding ``{}`` or ``{"error": {"code": ..., "message": ...}}``; the HTTP status of a
stream is always ``200`` once it has started.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

ENVELOPE = struct.Struct("!BI")
FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
MAX_MESSAGE = 16 << 20

STREAM_CONTENT_TYPE = "application/connect+json"
UNARY_CONTENT_TYPE = "application/json"

HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
    "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}
"""Connect error code -> HTTP status of a unary error response (the Connect spec's table)."""


class ConnectError(Exception):
    """An RPC failure with a Connect error `code` (a key of `HTTP_STATUS`) and a human `message`."""

    def __init__(self, code: str, message: str):
        if code not in HTTP_STATUS:
            code = "unknown"
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def to_json(self) -> dict:
        return {"code": self.code, "message": self.message}


def envelope(message: dict, *, end: bool = False) -> bytes:
    """One enveloped JSON message (`end` marks the end-stream envelope)."""
    body = json.dumps(message, separators=(",", ":")).encode()
    return ENVELOPE.pack(FLAG_END_STREAM if end else 0, len(body)) + body


def end_stream(error: ConnectError | None = None) -> bytes:
    """The end-stream envelope, with `error` if the stream failed."""
    return envelope({"error": error.to_json()} if error is not None else {}, end=True)


def iter_envelopes(body: bytes) -> Iterator[dict]:
    """Decode the enveloped messages of a (fully read) streaming request body.

    Raises:
        ConnectError: ``invalid_argument`` for truncated frames, compressed frames or bad JSON.
    """
    at = 0
    while at < len(body):
        if len(body) - at < ENVELOPE.size:
            raise ConnectError("invalid_argument", "truncated envelope prefix")
        flags, size = ENVELOPE.unpack_from(body, at)
        at += ENVELOPE.size
        if size > MAX_MESSAGE or at + size > len(body):
            raise ConnectError("invalid_argument", f"envelope of {size} bytes is truncated or too large")
        if flags & FLAG_COMPRESSED:
            raise ConnectError("unimplemented", "compressed envelopes are not supported (send identity)")
        payload = body[at : at + size]
        at += size
        if flags & FLAG_END_STREAM:
            return
        yield parse_json(payload)


def iter_stream(chunks: Iterator[bytes]) -> Iterator[dict]:
    """Decode enveloped messages as the body arrives in `chunks` (a client stream, message by message).

    Raises:
        ConnectError: as `iter_envelopes`, or ``invalid_argument`` when the body ends inside an envelope.
    """
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        while len(buf) >= ENVELOPE.size:
            flags, size = ENVELOPE.unpack_from(buf)
            if size > MAX_MESSAGE:
                raise ConnectError("invalid_argument", f"envelope of {size} bytes is too large")
            if len(buf) < ENVELOPE.size + size:
                break
            frame = bytes(buf[: ENVELOPE.size + size])
            del buf[: ENVELOPE.size + size]
            yield from iter_envelopes(frame)
            if flags & FLAG_END_STREAM:
                return
    if buf:
        raise ConnectError("invalid_argument", "client stream ended inside an envelope")


def parse_json(payload: bytes) -> dict:
    """A JSON object from a request body, or ``invalid_argument``."""
    if not payload:
        return {}
    try:
        message = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConnectError("invalid_argument", f"request body is not valid JSON: {e}") from e
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "request body must be a JSON object")
    return message


def first_message(body: bytes, streaming: bool) -> dict:
    """The single request message of a unary or server-streaming call."""
    if not streaming:
        return parse_json(body)
    for message in iter_envelopes(body):
        return message
    raise ConnectError("invalid_argument", "streaming request carries no message")
