"""HTTP to any other port inside a sandbox: ``E2b-Sandbox-Port: N`` with ``E2b-Sandbox-Id`` (E2B's get_host).

The request is replayed to ``127.0.0.1:N`` on the sandbox's own loopback (over a socket made in the
sandbox's network namespace, see `agentenv.server.agents.socket_in_netns`) and the response streamed back as
it arrives. One upstream connection per request (``Connection: close``); hop-by-hop headers and E2B's own
headers (access token, routing) are not forwarded.
"""

from __future__ import annotations

import http.client

from agentenv.server.agents import socket_in_netns
from agentenv.server.httpd import Handler, HTTPError

UPSTREAM_TIMEOUT_S = 300.0
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "content-length", "host", "x-access-token", "authorization"}


def forward(h: Handler, pid: int, sandbox_id: str, port: int) -> None:
    """Serve `h` from ``127.0.0.1:port`` inside the sandbox whose tool server is host pid `pid`."""
    body = h.body()
    sock = socket_in_netns(pid)
    sock.settimeout(UPSTREAM_TIMEOUT_S)
    try:
        sock.connect(("127.0.0.1", port))
    except OSError as e:
        sock.close()
        raise HTTPError(502, f"nothing accepts connections on port {port} in sandbox {sandbox_id} ({e.strerror})"
                        ) from e
    try:
        lines = [f"{h.command} {h.path} HTTP/1.1", f"Host: localhost:{port}", "Connection: close",
                 f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in h.headers.items()
                  if k.lower() not in HOP_BY_HOP and not k.lower().startswith("e2b-")]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        resp = http.client.HTTPResponse(sock, method=h.command)
        try:
            resp.begin()
        except (http.client.HTTPException, OSError) as e:
            raise HTTPError(502, f"port {port} in sandbox {sandbox_id} answered no valid HTTP: {e}") from e
        h.started = True
        h._pending = b""
        h.send_response(resp.status, resp.reason)
        for key, value in resp.getheaders():
            if key.lower() not in HOP_BY_HOP:
                h.send_header(key, value)
        if h.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200:
            h.end_headers()
            return
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        while chunk := resp.read1(65536):
            h.write_chunk(chunk)
        h.end_chunked()
    finally:
        sock.close()
