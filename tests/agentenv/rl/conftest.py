"""Fixtures for agentenv.rl: a provider over the session's runtime backend (leak-checked by the parent conftest)."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="session")
def provider(backend):
    from agentenv.rl import LocalProvider

    provider = LocalProvider(backend)
    yield provider
    provider.close()


@pytest.fixture
def run():
    """Run a coroutine to completion (tests are plain functions; no asyncio plugin needed)."""
    return asyncio.run


@pytest.fixture
def live(backend):
    """Ids of the backend's live sandboxes, as a function (for leak checks within a test)."""
    return lambda: {i.id for i in backend.list() if i.kind == "sandbox" and i.alive}


def _server(backend, state_dir):
    from agentenv.server import Server
    from agentenv.server.auth import Quota

    server = Server(port=0, state_dir=state_dir, backend=backend).start()
    key = server.keys.create("rl-tests", Quota(max_sandboxes=0))[0]
    return server, key


@pytest.fixture(scope="session")
def servers(backend, tmp_path_factory):
    """Two AgentEnv servers (in this process, on loopback) over the session's runtime backend."""
    made = [_server(backend, tmp_path_factory.mktemp(f"server{i}")) for i in range(2)]
    yield made
    for server, _ in made:
        server.stop(kill_all=True)


@pytest.fixture(scope="session")
def remote(servers):
    from agentenv.rl import RemoteProvider

    server, key = servers[0]
    provider = RemoteProvider(server.url, key)
    yield provider
    provider.close()
