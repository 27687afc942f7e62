"""Fuzz the AgentEnv HTTP control plane from its own OpenAPI description (schemathesis + hypothesis).

Every operation of ``/agentenv/v1/openapi.json`` (the in-sandbox envd routes aside) gets schema-valid and
schema-violating requests; half carry the real API key, half whatever was generated, and path ids are
sometimes a live sandbox's. The bar: no answer >= 500, the server still answers ``/health``, and a witness
sandbox no request names is still running at the end.

Run: ``python -m benchmarks.env.http_fuzz --requests 10000`` (root; writes benchmarks/results/env-fuzz-*.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import requests


@dataclass
class FuzzReport:
    requests: int = 0
    server_errors: list[dict] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    operations: int = 0
    seconds: float = 0.0
    server_alive: bool = False
    witness_alive: bool = False


def _operations(url: str):
    import schemathesis

    doc = requests.get(f"{url}/agentenv/v1/openapi.json", timeout=30).json()
    doc["paths"] = {k: v for k, v in doc["paths"].items() if "in-sandbox" not in k}
    return [op.ok() for op in schemathesis.openapi.from_dict(doc).get_all_operations()]


def fuzz(url: str, api_key: str, n_requests: int, *, seed: int = 0, timeout_s: float = 60.0) -> FuzzReport:
    """Send `n_requests` generated requests to the server at `url`; what came back (see `FuzzReport`)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seed_with
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    headers = {"X-API-Key": api_key}
    ops = _operations(url)
    report = FuzzReport(operations=len(ops))
    session = requests.Session()

    def make(name: str) -> str:
        r = session.post(f"{url}/sandboxes", json={"templateID": "base", "timeout": 600}, headers=headers,
                         timeout=timeout_s)
        r.raise_for_status()
        return r.json()["sandboxID"]

    witness = make("witness")
    target = [make("target")]
    strategies = [op.as_strategy(generation_mode=mode) for op in ops
                  for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    start = time.perf_counter()

    @seed_with(seed)
    @settings(max_examples=n_requests, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one(data) -> None:
        if report.requests >= n_requests:
            return
        case = data.draw(strategies[data.draw(st.integers(0, len(strategies) - 1))])
        if case.path_parameters and data.draw(st.integers(0, 9)) < 3:
            case.path_parameters = {k: target[0] for k in case.path_parameters}
        if data.draw(st.booleans()):  # the generated X-API-Key would win over a header passed to `call`
            case.headers = {**(case.headers or {}), **headers}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                resp = case.call(base_url=url, session=session, timeout=timeout_s)
        except requests.RequestException as e:  # a dropped connection counts as a failure too
            report.server_errors.append({"request": f"{case.method} {case.formatted_path}", "error": repr(e)})
            report.requests += 1
            return
        report.requests += 1
        report.statuses[resp.status_code] += 1
        if resp.status_code >= 500:
            report.server_errors.append({"request": f"{case.method} {case.formatted_path}",
                                         "body": repr(case.body)[:300], "status": resp.status_code,
                                         "answer": resp.text[:300]})
        if case.method.upper() == "DELETE" and target[0] in case.formatted_path and resp.status_code < 300:
            target[0] = make("target")

    while report.requests < n_requests:
        before = report.requests
        one()
        if report.requests == before:
            break
    report.seconds = time.perf_counter() - start
    report.server_alive = session.get(f"{url}/health", timeout=timeout_s).status_code == 200
    got = session.get(f"{url}/sandboxes/{witness}", headers=headers, timeout=timeout_s)
    report.witness_alive = got.status_code == 200 and got.json().get("state") == "running"
    for sid in (witness, target[0]):
        session.delete(f"{url}/sandboxes/{sid}", headers=headers, timeout=timeout_s)
    return report


def main() -> None:
    from benchmarks.harness import Row, write_results
    from tests.agentenv.server.conftest import runtime_leftovers, start_server

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=10000, help="generated requests in all")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="agentenv-fuzz-", dir="/tmp"))
    server = start_server(home, home / "state")
    try:
        report = fuzz(server.url, server.api_key, args.requests, seed=args.seed)
    finally:
        server.stop()
        left = runtime_leftovers(home)
        shutil.rmtree(home, ignore_errors=True)
    summary = {"requests": report.requests, "operations": report.operations, "responses_5xx": len(report.server_errors),
               "statuses": dict(sorted(report.statuses.items())), "server_alive": report.server_alive,
               "witness_alive": report.witness_alive, "leftover_sandboxes": left,
               "first_5xx": report.server_errors[:20]}
    print(json.dumps(summary, indent=1))
    row = Row(case=f"http-fuzz-{report.requests}", baseline="none (correctness run)", baseline_ms=None,
              ours_ms=report.seconds * 1e3 / max(report.requests, 1), params={"seed": args.seed}, extra=summary,
              note="ours_ms: mean ms per generated request")
    scratch = Path(tempfile.mkdtemp())
    path = write_results("env-fuzz", [row], markdown=scratch / "BENCHMARKS.md")
    shutil.rmtree(scratch, ignore_errors=True)
    print(path)


if __name__ == "__main__":
    main()
