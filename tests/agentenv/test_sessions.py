from agentenv import SandboxTimeoutError


def test_python_session_keeps_state_between_calls(sandbox):
    assert sandbox.python.run("import math\nx = 20\ndef f(a):\n    return a * 2").error is None
    result = sandbox.python.run("print('side'); f(x) + 2")
    assert (result.stdout, result.value) == ("side\n", "42")


def test_python_errors_are_returned_and_session_survives(sandbox):
    result = sandbox.python.run("y = 1\n1 / 0")
    assert result.error == "ZeroDivisionError" and "ZeroDivisionError" in result.traceback
    assert sandbox.python.run("y").value == "1"
    assert sandbox.python.run("def (").error == "SyntaxError"


def test_python_timeout_interrupts_code(sandbox):
    result = sandbox.python.run("while True: pass", timeout=0.3)
    assert result.error == "TimeoutError"
    assert sandbox.python.run("1 + 1").value == "2"


def test_shell_session_keeps_cwd_variables_and_functions(sandbox):
    sandbox.shell.run("cd /tmp && export A=1 && B=2 && greet() { echo hi $1; }")
    result = sandbox.shell.run("echo $PWD $A $B; greet you")
    assert result.stdout == "/tmp 1 2\nhi you\n"
    assert sandbox.shell.run("false").exit_code == 1


def test_shell_timeout_restarts_session(sandbox):
    try:
        sandbox.shell.run("sleep 30", timeout=0.3)
    except SandboxTimeoutError:
        pass
    else:
        raise AssertionError("expected a timeout")
    assert sandbox.shell.run("echo back").stdout == "back\n"
