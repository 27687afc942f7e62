import pytest

from agentenv import Limits, Network


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
        pytest.param({"disk_in_memory": 1}, "disk_in_memory", id="disk-in-memory-int"),
    ],
)
def test_bad_limits_raise_value_error_naming_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Limits(**kwargs)


@pytest.mark.no_runtime
def test_default_limits_are_bounded():
    limits = Limits()
    assert 0 < limits.memory_mb <= 4096 and 0 < limits.pids <= 4096 and limits.disk_mb > 0


@pytest.mark.no_runtime
@pytest.mark.parametrize(
    "allow, match",
    [
        pytest.param("10.0.0.0/8", "list", id="bare-string"),
        pytest.param(["example.com:443"], "host names", id="host-name"),
        pytest.param(["fd00::/8"], "IPv6", id="ipv6"),
        pytest.param(["10.0.0.1:0"], "port", id="port-zero"),
        pytest.param(["10.0.0.1:70000"], "port", id="port-too-big"),
        pytest.param([443], "strings", id="not-a-string"),
    ],
)
def test_bad_network_allow_raises_value_error_naming_the_entry(allow, match):
    with pytest.raises(ValueError, match=match):
        Network(allow=allow)


@pytest.mark.no_runtime
def test_network_policy_round_trips_and_defaults_to_loopback_only():
    assert not Limits().network.egress
    limits = Limits(network=Network(allow=["10.1.0.0/16", "192.0.2.7:8080"]))
    assert Limits.from_dict(limits.to_dict()) == limits
    assert [(str(r.net), r.port) for r in limits.network.rules()] == [("10.1.0.0/16", None), ("192.0.2.7/32", 8080)]
    with pytest.raises(ValueError, match="network"):
        Limits(network=["10.0.0.0/8"])
