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


def test_contexts_are_separate_namespaces(ci):
    ci.run_code("shared = 'default'")
    ctx = ci.create_code_context(cwd="/tmp")
    ci.run_code("shared = 'ctx'\nimport os", context=ctx)
    assert ci.run_code("shared", context=ctx).text == "'ctx'"
    assert ci.run_code("os.getcwd()", context=ctx).text == "'/tmp'"
    assert ci.run_code("shared").text == "'default'"
    assert ctx.id in [c.id for c in ci.list_code_contexts()]
    ci.restart_code_context(ctx)
    assert ci.run_code("shared", context=ctx).error.name == "NameError"
    ci.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in ci.list_code_contexts()]
    from e2b import SandboxException

    with pytest.raises(SandboxException, match="not found"):
        ci.run_code("1", context=ctx)


def test_context_state_survives_a_fork(ci):
    ctx = ci.create_code_context()
    ci.run_code("inside = 7", context=ctx)
    (kid,) = ci.fork(count=1)
    try:
        from e2b_code_interpreter import Sandbox

        assert Sandbox.connect(kid.sandbox_id).run_code("inside * 6", context=ctx).text == "42"
    finally:
        kid.kill()
