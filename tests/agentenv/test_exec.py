import pytest

from agentenv import CommandNotFoundError, NotFoundError, SandboxTimeoutError


def test_exec_returns_output_and_exit_code(sandbox):
    result = sandbox.exec("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert sandbox.exec(["true"]).ok


def test_exec_passes_stdin_env_and_cwd(sandbox):
    assert sandbox.exec(["cat"], stdin="piped").stdout == "piped"
    assert sandbox.exec("echo $FOO", env={"FOO": "bar"}).stdout == "bar\n"
    assert sandbox.exec("pwd", cwd="/tmp").stdout == "/tmp\n"


def test_exec_streams_output_chunks(sandbox):
    chunks: list[str] = []
    result = sandbox.exec("for i in 1 2 3; do echo $i; sleep 0.01; done", on_stdout=chunks.append)
    assert "".join(chunks) == "1\n2\n3\n" == result.stdout


def test_exec_timeout_kills_command_and_sandbox_stays_usable(sandbox):
    with pytest.raises(SandboxTimeoutError):
        sandbox.exec("sleep 30", timeout=0.3)
    assert sandbox.exec("echo alive").stdout == "alive\n"
    assert sandbox.exec("pgrep -x sleep || echo none").stdout.strip() == "none"


def test_command_not_found_raises_and_sandbox_stays_usable(sandbox):
    with pytest.raises(CommandNotFoundError):
        sandbox.exec(["/no/such/binary"])
    assert sandbox.exec("no-such-command").exit_code == 127
    with pytest.raises(NotFoundError):
        sandbox.exec(["true"], cwd="/no/such/dir")
    assert sandbox.exec(["true"]).ok


def test_huge_output_is_truncated_not_fatal(sandbox):
    result = sandbox.exec("head -c 5000000 /dev/zero", max_output=1 << 20)
    assert result.truncated and len(result.stdout) == 1 << 20
    assert sandbox.exec("echo ok").stdout == "ok\n"


@pytest.mark.parametrize(
    "cmd, kwargs, name",
    [
        pytest.param("", {}, "cmd", id="empty-cmd"),
        pytest.param([], {}, "cmd", id="empty-argv"),
        pytest.param("true", {"timeout": -1}, "timeout", id="negative-timeout"),
        pytest.param("true", {"cwd": "relative"}, "path", id="relative-cwd"),
        pytest.param("true", {"env": {"A": 1}}, "env", id="env-not-str"),
        pytest.param("true", {"max_output": 0}, "max_output", id="max-output-zero"),
    ],
)
def test_bad_exec_arguments_raise_value_error(sandbox, cmd, kwargs, name):
    with pytest.raises(ValueError, match=name):
        sandbox.exec(cmd, **kwargs)
