"""Seeded tool tasks with rewards checked in the sandbox, and the compact action grammar a small LM emits.

Two task families; in both the agent must write a word to ``answer.txt`` and submit, and the verifier checks
``answer.txt`` in the sandbox (a `FileVerifier`): the agent's text is never trusted. Seeds below `HELD_OUT_FROM`
are the training split, seeds at or above it the held-out split.

* ``code`` (`make_task`): the instruction names the file holding the code word (3 tool calls).
* ``chain`` (`make_chain_task`): the instruction names a field; ``index.txt`` says which file holds each field
  and every file holds two fields, so the agent must read the index, follow the asked field's pointer, pick that
  field's word among the file's two, write it and submit (4 tool calls, distractors at both reads). Where each
  field lives is drawn anew per task, so no field -> file prior helps: only following the index does.

Action grammar (one line per turn), parsed into OpenAI tool calls::

    cat PATH           -> read_file {"path": PATH}
    write PATH TEXT    -> write_file {"path": PATH, "content": TEXT + "\\n"}
    submit             -> submit {}

Every call is served by the sandbox's tool server without starting a process (a `run_shell` ``cat`` costs a
process spawn, ~5-15 ms on a loaded 2-core host, against ~0.5 ms for a read), and each sandbox's writable
layer is a 16 MiB tmpfs rather than a 1 GiB ext4 (forking 8 children ~5x faster): the tasks write one word.
"""

from __future__ import annotations

import random

from agentenv.limits import Limits
from agentenv.rl.policy import tool_call
from agentenv.rl.tasks import FileVerifier, Setup, TaskSpec

HELD_OUT_FROM = 1_000_000
"""First seed of the held-out split."""

WORDS = ("red", "blue", "gold", "mint", "oak", "fig", "sun", "ice", "jade", "rose", "lime", "plum")
FILES = ("note.txt", "key.txt", "info.txt", "code.txt")
LIMITS = Limits(memory_mb=256, pids=128, disk_mb=16, disk_in_memory=True)
"""Sandbox limits of every task: small memory, a 16 MiB in-memory writable layer."""


def make_task(seed: int) -> TaskSpec:
    """The task of `seed` (deterministic): a code word hidden in one of a few files.

    Raises:
        ValueError: `seed` is not a non-negative int.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    rng = random.Random(seed)
    word = rng.choice(WORDS)
    name = rng.choice(FILES)
    decoy = rng.choice([w for w in WORDS if w != word])
    files = {f"/root/task/{name}": f"code: {word}\n", "/root/task/other.log": f"noise {decoy}\n"}
    instruction = f"find the code in {name}, write it to answer.txt, submit"
    solution = [tool_call("read_file", path=name),
                tool_call("write_file", path="answer.txt", content=f"{word}\n"), tool_call("submit")]
    return TaskSpec(id=f"code-{seed}", instruction=instruction, setup=Setup(files=files, files_at_reset=True),
                    verifier=FileVerifier("answer.txt", word), limits=LIMITS, max_steps=4, step_timeout_s=10.0,
                    solution=solution, tags=["posttrain", "held_out" if seed >= HELD_OUT_FROM else "train"])


FIELDS = ("code", "pin", "tag")


def make_chain_task(seed: int) -> TaskSpec:
    """The chain task of `seed` (deterministic): ``index.txt`` maps each of `FIELDS` (one line each, in that
    order) to its own file of `FILES` (one file holds none); every file that holds a field also holds a decoy:
    another field's name with a word that is not that field's.

    Raises:
        ValueError: `seed` is not a non-negative int.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    rng = random.Random(seed)
    held_out = seed >= HELD_OUT_FROM
    place = dict(zip(FIELDS, rng.sample(FILES, len(FIELDS))))
    field = rng.choice(FIELDS)
    words = rng.sample(WORDS, 2 * len(FIELDS))
    files = {"/root/task/index.txt": "".join(f"{f}: {place[f]}\n" for f in FIELDS)}
    for i, f in enumerate(FIELDS):
        decoy = FIELDS[(FIELDS.index(f) + 1 + rng.randrange(len(FIELDS) - 1)) % len(FIELDS)]
        lines = [f"{f}: {words[i]}\n", f"{decoy}: {words[len(FIELDS) + i]}\n"]
        rng.shuffle(lines)
        files[f"/root/task/{place[f]}"] = "".join(lines)
    word = words[FIELDS.index(field)]
    instruction = f"find the {field} via index.txt, write it to answer.txt, submit"
    solution = [tool_call("read_file", path="index.txt"), tool_call("read_file", path=place[field]),
                tool_call("write_file", path="answer.txt", content=f"{word}\n"), tool_call("submit")]
    return TaskSpec(id=f"chain-{seed}", instruction=instruction, setup=Setup(files=files, files_at_reset=True),
                    verifier=FileVerifier("answer.txt", word), limits=LIMITS, max_steps=6, step_timeout_s=10.0,
                    solution=solution, tags=["posttrain", "chain", "held_out" if held_out else "train"])


FAMILIES = {"code": make_task, "chain": make_chain_task}
"""Task makers by family name (`make_tasks`'s `family`)."""


def make_tasks(n: int, *, split: str = "train", start: int = 0, family: str = "code") -> list[TaskSpec]:
    """`n` tasks of a family (`FAMILIES`) and split (``"train"`` or ``"held_out"``), seeds ``start, start+1, ...``
    within the split."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    base = 0 if split == "train" else HELD_OUT_FROM
    return [FAMILIES[family](base + start + i) for i in range(n)]


def parse_action(text: str) -> dict:
    """One grammar line -> an OpenAI tool call dict; anything else becomes a call the env reports as an error."""
    line = text.strip().split("\n", 1)[0]
    head, _, rest = line.partition(" ")
    if head == "cat" and rest and " " not in rest:
        return tool_call("read_file", path=rest)
    if head == "write":
        path, _, content = rest.partition(" ")
        if path and content:
            return tool_call("write_file", path=path, content=content + "\n")
    if line == "submit":
        return tool_call("submit")
    return tool_call("invalid", text=line[:80])


def format_action(call: dict) -> str:
    """An OpenAI tool call of the grammar's kind -> its grammar line (inverse of `parse_action`).

    Raises:
        ValueError: the call has no grammar form.
    """
    import json

    name = call["function"]["name"]
    args = json.loads(call["function"]["arguments"] or "{}")
    if name == "read_file" and set(args) == {"path"}:
        return f"cat {args['path']}"
    if name == "run_shell" and args.get("command", "").startswith("cat "):
        return args["command"]
    if name == "write_file":
        return f"write {args['path']} {args['content'].rstrip(chr(10))}"
    if name == "submit":
        return "submit"
    raise ValueError(f"call: {name} {args} has no grammar form")


def format_observation(obs: dict, limit: int = 48) -> str:
    """The part of an observation the policy sees, on one line cut to `limit` chars: its output lines joined
    (a file's ``"code: red"``; a shell result's ``"exit_code: 0 code: red"``), or ``"error TYPE"``."""
    if obs.get("error"):
        return ("error " + obs["error"]["type"])[:limit]
    lines = [x.strip() for x in (obs.get("content") or "").split("\n")]
    return " ".join(x for x in lines if x and x not in ("stdout:", "stderr:"))[:limit]


def vocabulary(family: str = "code") -> list[str]:
    """Every word a family's instructions, files, actions and usual observations are made of (for a word-level
    tokenizer such as `agentenv.posttrain.policy.WordTokenizer`); the same list for both splits.

    Raises:
        ValueError: `family` is not in `FAMILIES`.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    words = set(WORDS) | set(FILES) | {"other.log", "answer.txt", "/root/task/answer.txt"}
    words |= set("find the code in write it to submit cat noise exit_code stdout stderr wrote bytes submitted error "
                 "no such file or directory not_found unknown_tool invalid_arguments is_directory".split())
    words |= set(",:;.") | {str(i) for i in range(10)}
    if family == "chain":
        words |= set(FIELDS) | {"via", "index.txt"}
    return sorted(words)
