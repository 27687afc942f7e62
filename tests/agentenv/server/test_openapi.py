"""The OpenAPI document describes the whole API, and every route it lists is served."""

from __future__ import annotations

import pytest

from agentenv.client import Client, ServerError
from agentenv.server.openapi import ROUTES, SANDBOX_ROUTES, document


@pytest.mark.no_runtime
def test_document_is_openapi_31_with_every_route():
    doc = document()
    assert doc["openapi"] == "3.1.0"
    assert len(doc["paths"]) == len({p for _, p, *_ in ROUTES}) + len({p for _, p, _ in SANDBOX_ROUTES})
    create = doc["paths"]["/v2/sandboxes"]["post"]
    assert create["responses"]["201"]["content"]["application/json"]["schema"]["$ref"] == \
        "#/components/schemas/Sandbox"
    assert create["responses"]["429"]["content"]["application/json"]["schema"]["$ref"] == \
        "#/components/schemas/Error"


def test_server_serves_the_document(server):
    assert Client(server.url, server.api_key).openapi() == document()


@pytest.mark.parametrize("method,path", [(m, p) for m, p, *_ in ROUTES], ids=[f"{m} {p}" for m, p, *_ in ROUTES])
def test_every_listed_route_is_routed(server, method, path):
    client = Client(server.url, server.api_key)
    concrete = path.replace("{sandboxID}", "sb-000000000000").replace("{snapshotID}", "snap-000000000000")
    try:
        reply = client.request(method.upper(), concrete, None if method in ("get", "delete") else {})
    except ServerError as e:
        assert e.status in (400, 404) and "no route" not in str(e), str(e)  # reached its handler
        return
    if isinstance(reply, dict) and "sandboxID" in reply:  # a create route made a sandbox: clean up
        client.kill(reply["sandboxID"])
