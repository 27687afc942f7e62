"""Frames cut short by a dead sender, and a tool-server socket nobody serves: neither may leak or hang."""

import os
import socket
import time

import pytest

from agentenv import errors, protocol
from agentenv.runtime import client


def test_a_frame_cut_short_closes_the_descriptors_it_carried():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    try:
        # the header and the descriptor arrive, then the sender dies before the body
        socket.send_fds(left, [protocol.HEADER.pack(100, 0)], [w])
        left.close()
        os.close(w)
        with pytest.raises(protocol.ConnectionClosed):
            protocol.recv_msg(right)
        os.set_blocking(r, False)
        assert os.read(r, 1) == b""  # EOF: no copy of the write end is left open in this process
    finally:
        right.close()
        os.close(r)


def test_peer_pid_of_a_socket_nobody_serves_gives_up(tmp_path, monkeypatch):
    monkeypatch.setattr(client, "WHOAMI_TIMEOUT_S", 0.3)
    path = tmp_path / "sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)  # never accepts: a sandbox that was never cloned
    try:
        conn = client.Connection(path, "sb-never")
        begin = time.monotonic()
        with pytest.raises(errors.SandboxGoneError, match="sb-never"):
            conn.peer_pid()
        assert time.monotonic() - begin < 3
    finally:
        listener.close()
