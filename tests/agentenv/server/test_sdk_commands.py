"""The stock `e2b` SDK's process service against our server: streaming, stdin, kill, list, re-attach."""

from __future__ import annotations

import time

import pytest


def test_run_streams_stdout_and_stderr(e2b_sandbox):
    out, err = [], []
    result = e2b_sandbox.commands.run("for i in 1 2 3; do echo out$i; echo err$i >&2; done",
                                      on_stdout=out.append, on_stderr=err.append)
    assert result.exit_code == 0
    assert result.stdout == "out1\nout2\nout3\n"
    assert result.stderr == "err1\nerr2\nerr3\n"
    assert "".join(out) == result.stdout and "".join(err) == result.stderr


def test_nonzero_exit_raises_command_exit(e2b_sandbox):
    from e2b import CommandExitException

    with pytest.raises(CommandExitException) as info:
        e2b_sandbox.commands.run("echo bad >&2; exit 7")
    assert info.value.exit_code == 7
    assert info.value.stderr == "bad\n"


def test_env_and_cwd_reach_the_process(e2b_sandbox):
    result = e2b_sandbox.commands.run("echo $GREETING; pwd", envs={"GREETING": "hi"}, cwd="/tmp")
    assert result.stdout == "hi\n/tmp\n"


def test_stdin_is_streamed_to_a_background_process(e2b_sandbox):
    handle = e2b_sandbox.commands.run("cat", background=True, stdin=True)
    e2b_sandbox.commands.send_stdin(handle.pid, "first\n")
    e2b_sandbox.commands.send_stdin(handle.pid, "second\n")
    e2b_sandbox.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert result.stdout == "first\nsecond\n"


def test_kill_stops_a_running_process(e2b_sandbox):
    from e2b import CommandExitException

    handle = e2b_sandbox.commands.run("sleep 100", background=True)
    assert handle.pid in [p.pid for p in e2b_sandbox.commands.list()]
    assert e2b_sandbox.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException):
        handle.wait()
    assert handle.pid not in [p.pid for p in e2b_sandbox.commands.list()]
    assert e2b_sandbox.commands.kill(handle.pid) is False  # already gone: not found


def test_connect_reattaches_to_a_running_process(e2b_sandbox):
    handle = e2b_sandbox.commands.run("sleep 0.5; echo done", background=True)
    handle.disconnect()
    again = e2b_sandbox.commands.connect(handle.pid)
    assert again.wait().stdout == "done\n"


def test_disconnected_process_keeps_running_until_killed(e2b_sandbox):
    handle = e2b_sandbox.commands.run("yes", background=True)  # floods its pipe: output is dropped, not buffered
    handle.disconnect()
    time.sleep(0.3)
    assert handle.pid in [p.pid for p in e2b_sandbox.commands.list()]
    assert e2b_sandbox.commands.kill(handle.pid)
    deadline = time.monotonic() + 10
    while handle.pid in [p.pid for p in e2b_sandbox.commands.list()] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert handle.pid not in [p.pid for p in e2b_sandbox.commands.list()]


def test_large_output_arrives_complete(e2b_sandbox):
    result = e2b_sandbox.commands.run("head -c 3000000 /dev/zero | tr '\\0' 'a'")
    assert len(result.stdout) == 3_000_000


def test_unknown_program_reports_exit_127(e2b_sandbox):
    from e2b import CommandExitException

    with pytest.raises(CommandExitException) as info:
        e2b_sandbox.commands.run("no-such-program-xyz")
    assert info.value.exit_code == 127


def test_async_sdk_runs_commands_concurrently(e2b_env):
    import asyncio

    from e2b import AsyncSandbox

    async def scenario() -> tuple[list[str], float]:
        sb = await AsyncSandbox.create(timeout=60)
        try:
            chunks: list[str] = []
            first = await sb.commands.run("echo streamed", on_stdout=chunks.append)
            assert first.stdout == "streamed\n" and chunks == ["streamed\n"]
            start = time.monotonic()
            results = await asyncio.gather(*[sb.commands.run(f"sleep 0.5; echo {i}") for i in range(8)])
            return [r.stdout for r in results], time.monotonic() - start
        finally:
            await sb.kill()

    outputs, elapsed = asyncio.run(scenario())
    assert outputs == [f"{i}\n" for i in range(8)]
    assert elapsed < 8 * 0.5 - 1.0  # the eight sleeps overlapped (in sequence they take >= 4 s); margin for load


def test_sandbox_envs_reach_every_command(e2b_env):
    from e2b import Sandbox

    sb = Sandbox.create(envs={"TEAM": "k3", "MODE": "rl"}, timeout=60)
    try:
        assert sb.commands.run("echo $TEAM-$MODE").stdout == "k3-rl\n"
        assert sb.commands.run("echo $MODE", envs={"MODE": "override"}).stdout == "override\n"
    finally:
        sb.kill()


def test_stream_input_delivers_each_chunk_as_it_is_sent(e2b_sandbox):
    handle = e2b_sandbox.commands.run("while read line; do echo $line >> /tmp/got; done", background=True,
                                      stdin=True)

    def got() -> str:
        try:
            return e2b_sandbox.files.read("/tmp/got")
        except Exception:
            return ""

    seen_before_second: list[bool] = []

    def chunks():
        yield "first\n"
        deadline = time.monotonic() + 10  # wait for the first chunk to arrive while the stream stays open
        while "first" not in got() and time.monotonic() < deadline:
            time.sleep(0.05)
        seen_before_second.append("first" in got())
        yield "second\n"

    e2b_sandbox.commands.stream_input(handle.pid, chunks())
    assert seen_before_second == [True]  # delivered mid-stream, not when the request body ended
    e2b_sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().exit_code == 0
    assert got() == "first\nsecond\n"
