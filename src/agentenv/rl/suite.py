"""The shipped task suite: small coding tasks with hidden tests (data in ``suite.json`` next to this file).

Each task carries a reference solution (a list of tool calls) for `ScriptedPolicy`, so demos and tests can
run full episodes, and verifiers of three kinds (hidden unit tests, a command, an answer check).

Example::

    >>> [t.id for t in load_suite()][:3]
    ['fizzbuzz', 'fix-median', 'roman']
"""

from __future__ import annotations

import json
from importlib import resources

from agentenv.rl.tasks import TaskSpec


def load_suite(ids: list[str] | None = None) -> list[TaskSpec]:
    """The suite's tasks (all, or those named in `ids`, in that order).

    Raises:
        ValueError: an id in `ids` is not in the suite.
    """
    data = json.loads(resources.files("agentenv.rl").joinpath("suite.json").read_text())
    tasks = {t["id"]: TaskSpec.from_dict(t) for t in data["tasks"]}
    if ids is None:
        return list(tasks.values())
    unknown = [i for i in ids if i not in tasks]
    if unknown:
        raise ValueError(f"ids: unknown tasks {unknown}; the suite has {sorted(tasks)}")
    return [tasks[i] for i in ids]
