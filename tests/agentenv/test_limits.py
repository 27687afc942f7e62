import pytest

from agentenv import Limits


@pytest.mark.no_runtime
@pytest.mark.parametrize(
    "kwargs, name",
    [
        pytest.param({"memory_mb": 0}, "memory_mb", id="memory-zero"),
        pytest.param({"memory_mb": 1.5}, "memory_mb", id="memory-float"),
        pytest.param({"pids": 2}, "pids", id="pids-too-few"),
        pytest.param({"pids": True}, "pids", id="pids-bool"),
        pytest.param({"cpus": -1}, "cpus", id="cpus-negative"),
        pytest.param({"cpus": "1"}, "cpus", id="cpus-str"),
        pytest.param({"disk_mb": 0}, "disk_mb", id="disk-zero"),
    ],
)
def test_bad_limits_raise_value_error_naming_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Limits(**kwargs)


@pytest.mark.no_runtime
def test_default_limits_are_bounded():
    limits = Limits()
    assert 0 < limits.memory_mb <= 4096 and 0 < limits.pids <= 4096 and limits.disk_mb > 0
