"""`e2b_code_interpreter.Sandbox.run_code` against the sandbox's persistent Python session."""

from __future__ import annotations

import pytest


@pytest.fixture
def ci(e2b_env):
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(timeout=120)
    yield sb
    sb.kill()


def test_state_survives_between_calls(ci):
    ci.run_code("import math\nx = 40")
    ci.run_code("def inc(v):\n    return v + 1")
    assert ci.run_code("inc(x) + 1").text == "42"
    assert ci.run_code("math.sqrt(16)").text == "4.0"


def test_stdout_stderr_and_errors(ci):
    execution = ci.run_code("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert execution.logs.stdout == ["out\n"] and execution.logs.stderr == ["err\n"]
    failed = ci.run_code("1 / 0")
    assert failed.error.name == "ZeroDivisionError"
    assert failed.error.value == "division by zero"
    assert "ZeroDivisionError" in failed.error.traceback
    assert ci.run_code("'still alive'").text == "'still alive'"


def test_state_carries_over_a_fork(ci):
    ci.run_code("secret = 1234")
    (kid,) = ci.fork(count=1)
    try:
        from e2b_code_interpreter import Sandbox

        kid_ci = Sandbox.connect(kid.sandbox_id)
        assert kid_ci.run_code("secret").text == "1234"
        kid_ci.run_code("secret = 0")
        assert ci.run_code("secret").text == "1234"
    finally:
        kid.kill()


def test_other_languages_are_refused(ci):
    from e2b import SandboxException

    with pytest.raises(SandboxException, match="only python"):
        ci.run_code("console.log(1)", language="js")


def test_env_vars_apply_to_one_execution(ci):
    ci.run_code("import os")
    assert ci.run_code("os.environ.get('RUN_MODE')", envs={"RUN_MODE": "eval"}).text == "'eval'"
    assert ci.run_code("os.environ.get('RUN_MODE')").text is None
    failed = ci.run_code("raise ValueError(os.environ['RUN_MODE'])", envs={"RUN_MODE": "boom"})
    assert failed.error.value == "boom"
    assert ci.run_code("os.environ.get('RUN_MODE')").text is None
