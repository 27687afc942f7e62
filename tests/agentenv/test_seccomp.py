import os
import subprocess
import sys

import pytest

from agentenv.runtime import seccomp

_PROBE = """
import ctypes, os, sys
sys.path.insert(0, "src")
from agentenv.runtime import seccomp
seccomp.install(seccomp.build_filter(seccomp.AGENT_DENY, block_namespace_clone=True), no_new_privs=True)
libc = ctypes.CDLL(None, use_errno=True)
results = {}
for name, nr, args in [("keyctl", 250, (0, 0)), ("unshare", 272, (0x10000000,)), ("bpf", 321, (0, 0, 0)),
                       ("init_module", 175, (0, 0, 0)), ("mount", 165, (0, 0, 0, 0, 0)), ("getpid", 39, ())]:
    r = libc.syscall(nr, *args)
    results[name] = 0 if r >= 0 else ctypes.get_errno()
print(results)
"""


@pytest.mark.no_runtime
def test_build_filter_is_whole_instructions_and_rejects_unknown_machine():
    program = seccomp.build_filter(seccomp.AGENT_DENY, block_namespace_clone=True)
    assert len(program) % 8 == 0 and len(program) // 8 > len(seccomp.AGENT_DENY)
    with pytest.raises(ValueError, match="machine"):
        seccomp.build_filter(seccomp.BASE_DENY, machine="sparc")


@pytest.mark.no_runtime
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="probe uses x86_64 syscall numbers")
def test_agent_filter_denies_dangerous_calls_with_eperm_and_allows_others():
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr
    results = eval(done.stdout)
    assert results["getpid"] == 0
    for name in ("keyctl", "unshare", "bpf", "init_module", "mount"):
        assert results[name] == 1, (name, results)  # EPERM
