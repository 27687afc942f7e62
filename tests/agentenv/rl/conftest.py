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
