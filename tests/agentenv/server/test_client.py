"""Our extension client: fork(n), snapshot/restore, reset/step, spreading over two servers."""

from __future__ import annotations

import asyncio

import pytest

from agentenv.client import AsyncClient, Client, Cluster, ConflictError, ServerNotFoundError


@pytest.fixture
def client(server):
    c = Client(server.url, server.api_key)
    made: list = []
    c.track = made.append
    yield c
    for sb in made:
        c.kill(sb)


def test_fork_n_keeps_python_state(client):
    sb = client.create("base")
    client.track(sb)
    client.step(sb, {"type": "python", "code": "x = 41"})
    kids = client.fork(sb, 3)
    for kid in kids:
        client.track(kid)
    values = [client.step(k, {"type": "python", "code": "x + 1"}).observation["value"] for k in kids]
    assert values == ["42", "42", "42"]
    assert len({k.id for k in kids} | {sb.id}) == 4


def test_snapshot_restore_restores_files_and_state(client):
    sb = client.create("base")
    client.track(sb)
    client.step(sb, {"type": "bash", "command": "echo one > /tmp/s.txt"})
    client.step(sb, {"type": "python", "code": "counter = 10"})
    snap = client.snapshot(sb, name=None)
    try:
        client.step(sb, {"type": "bash", "command": "echo two > /tmp/s.txt"})
        restored = client.restore(snap)
        client.track(restored)
        obs = client.step(restored, {"type": "bash", "command": "cat /tmp/s.txt"}).observation
        assert obs["stdout"] == "one\n"
        assert client.step(restored, {"type": "python", "code": "counter"}).observation["value"] == "10"
    finally:
        assert client.delete_snapshot(snap)
    with pytest.raises(ServerNotFoundError):
        client.restore(snap)


def test_reset_and_step_with_reward(client):
    sb = client.create("base")
    client.step(sb, {"type": "bash", "command": "echo 0 > /tmp/score"})
    snap = client.snapshot(sb)
    try:
        result = client.step(sb, {"type": "bash", "command": "echo 3 > /tmp/score"}, reward_cmd="cat /tmp/score")
        assert result.reward == 3.0 and not result.terminated
        fresh = client.reset(sb, snap)
        client.track(fresh)
        assert client.kill(sb) is False  # reset replaced it
        assert client.step(fresh, {"type": "bash", "command": "true"}, reward_cmd="cat /tmp/score").reward == 0.0
    finally:
        client.delete_snapshot(snap)


def test_step_on_paused_sandbox_is_conflict(client):
    sb = client.create("base")
    client.track(sb)
    client.request("POST", f"/sandboxes/{sb.id}/pause", {})
    with pytest.raises(ConflictError):
        client.step(sb, {"type": "bash", "command": "true"})


def test_bad_arguments_raise_value_error(server):
    with pytest.raises(ValueError, match="url"):
        Client("ftp://x", "k")
    with pytest.raises(ValueError, match="api_key"):
        Client(server.url, "")
    with pytest.raises(ValueError, match="timeout"):
        Client(server.url, "k", timeout=0)
    with pytest.raises(ValueError, match="clients"):
        Cluster([])


def test_async_client_forks(server):
    async def scenario():
        c = AsyncClient(server.url, server.api_key)
        sb = await c.create("base")
        kids = await c.fork(sb, 2)
        results = await asyncio.gather(*[c.step(k, {"type": "bash", "command": "hostname"}) for k in kids])
        for s in [sb, *kids]:
            await c.kill(s)
        return [r.observation["exit_code"] for r in results]

    assert asyncio.run(scenario()) == [0, 0]


def test_cluster_spreads_over_two_servers(server, second_server):
    cluster = Cluster([Client(server.url, server.api_key), Client(second_server.url, second_server.api_key)])
    made = [cluster.create("base") for _ in range(4)]
    try:
        assert sorted(sb.server for sb in made).count(server.url) == 2
        kids = cluster.fork(made[1], 1)
        made += kids
        assert kids[0].server == made[1].server
        assert cluster.step(kids[0], {"type": "bash", "command": "echo ok"}).observation["stdout"] == "ok\n"
    finally:
        for sb in made:
            cluster.kill(sb)
