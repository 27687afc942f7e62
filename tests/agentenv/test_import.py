import subprocess
import sys

import pytest


@pytest.mark.no_runtime
def test_import_agentenv_does_not_import_torch():
    code = (
        "import sys, agentenv, agentenv.sandbox, agentenv.runtime.local, agentenv.cli; "
        "from agentenv import Sandbox, Limits, SandboxError; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.no_runtime
def test_tool_server_modules_use_only_the_stdlib():
    """The tool server runs with the host's /usr/bin/python3 and no site-packages."""
    code = (
        "import sys; sys.path.insert(0, 'src'); import agentenv.runtime.toolserver; "
        "bad = [m for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names and "
        "m.split('.')[0] not in ('agentenv', '__main__')]; assert not bad, bad"
    )
    done = subprocess.run(["/usr/bin/python3", "-I", "-S", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
