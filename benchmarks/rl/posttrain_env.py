"""Environment time of one GRPO iteration of the post-training run, before/after, in the same run.

Each round plays one iteration of the post-training rollout shape (6 groups, each one reset and one `fork(8)`,
every child doing the task's three tool calls: read the file, write the answer, submit + verify) twice,
alternating two set-ups on their own data directories:

* ``before``: the tasks as they were first built (``cat`` through `run_shell`, a ``grep -qx`` `CommandVerifier`,
  the default 1 GiB ext4 writable layer, one template snapshot per task), the children destroyed on the
  critical path, trajectories fsynced per step, groups forked when the iteration starts;
* ``after``: the tasks of `agentenv.posttrain.tasks` (`read_file`, a `FileVerifier`, a 16 MiB tmpfs layer, one
  template shared through `Setup.files_at_reset`), children destroyed in the background
  (`EnvPool.close_later`), no per-step fsync, the next iteration's groups forked while this one's policy works.

The policy's time is real: every turn samples an action for every live child from a tiny GPT-2
(`generate_actions`, one batch); the actions played are the solver's, so every episode makes all its tool
calls. Env time = iteration wall time minus that sampling.

    python -m benchmarks.rl.posttrain_env --rounds 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from agentenv.limits import Limits
from agentenv.posttrain import WordTokenizer, tiny_model
from agentenv.posttrain.policy import generate_actions
from agentenv.posttrain.rollout import EnvClock, fork_groups
from agentenv.posttrain.tasks import make_tasks, vocabulary
from agentenv.rl import CommandVerifier, EnvPool, LocalProvider, Setup, tool_call
from benchmarks.harness import Row, write_results


def legacy(task):
    """`task` as the post-training tasks were first built."""
    word, name = task.verifier.expected, task.instruction.split()[4].rstrip(",")
    solution = [tool_call("run_shell", command=f"cat {name}"), *task.solution[1:]]
    return dataclasses.replace(task, setup=Setup(files=task.setup.files), limits=Limits(memory_mb=256, pids=128),
                               verifier=CommandVerifier(f"grep -qx {word} answer.txt"), solution=solution)


async def iteration(pool, tasks, forked, model, tok, *, background: bool, after=None) -> tuple[float, float]:
    """One rollout iteration; returns (wall seconds, policy seconds)."""
    clock = EnvClock()
    t0 = time.perf_counter()
    groups = await (forked if forked is not None else fork_groups(pool, tasks, 8, clock=clock))
    kids = [(k, t) for b, t in zip(groups.envs, groups.tasks) for k in b]
    contexts = ["T: " + t.instruction + "\n" for _, t in kids]
    policy = 0.0
    for turn in range(3):
        tp = time.perf_counter()
        actions = generate_actions(model, tok, contexts, temperature=1.0, max_new_tokens=8)
        policy += time.perf_counter() - tp
        results = await asyncio.gather(*(k.step(t.solution[turn]) for k, t in kids))
        contexts = [c + f"A: {a}\nO: {r[0]['content'][:40]}\n" for c, a, r in zip(contexts, actions, results)]
    assert all(r[1] == 1.0 for r in results), "the solver's episodes must all succeed"
    if background:
        pool.close_later([k for k, _ in kids], after=after)
    else:
        await asyncio.gather(*(k.close() for k, _ in kids))
    return time.perf_counter() - t0, policy


async def measure(rounds: int, root: str) -> dict:
    tok = WordTokenizer(vocabulary())
    model = tiny_model(tok.vocab_size, n_positions=256, eos_token_id=tok.eos_token_id).eval()
    rng = random.Random(0)
    pool_tasks = make_tasks(64)
    out: dict[str, list] = {"before": [], "after": []}
    with LocalProvider(home=os.path.join(root, "before")) as p_before, \
            LocalProvider(home=os.path.join(root, "after")) as p_after:
        async with EnvPool(p_before, record_dir=os.path.join(root, "traj-before"), fsync="step") as before, \
                EnvPool(p_after, record_dir=os.path.join(root, "traj-after"), fsync="none") as after:
            await asyncio.gather(before.warm([legacy(t) for t in pool_tasks]), after.warm(pool_tasks))
            plan = [rng.sample(pool_tasks, 6) for _ in range(rounds + 1)]
            pending = asyncio.ensure_future(fork_groups(after, plan[0], 8))
            for r in range(rounds):
                out["before"].append(await iteration(before, [legacy(t) for t in plan[r]], None, model, tok,
                                                     background=False))
                t_wait = time.perf_counter()
                current = await pending  # what is left of the prefetch is on this iteration's critical path
                waited = time.perf_counter() - t_wait
                pending = asyncio.ensure_future(fork_groups(after, plan[r + 1], 8))
                wall, policy = await iteration(after, plan[r], _ready(current), model, tok, background=True,
                                               after=pending)
                out["after"].append((wall + waited, policy))
            left = await pending
            await asyncio.gather(*(k.close() for b in left.envs for k in b))
        alive = [i.id for p in (p_before, p_after) for i in p.backend.list() if i.kind == "sandbox" and i.alive]
    return out | {"alive_after": alive}


async def _ready(value):
    return value


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="posttrain-env-") as root:
        res = asyncio.run(measure(args.rounds, root))
    rows = []
    summary = {}
    for name in ("before", "after"):
        walls = [w for w, _ in res[name]]
        env = [w - p for w, p in res[name]]
        summary[name] = {"wall_s_median": statistics.median(walls), "env_s_median": statistics.median(env),
                         "env_share_median": statistics.median(e / w for e, w in zip(env, walls)),
                         "policy_s_median": statistics.median(p for _, p in res[name])}
    for name in ("before", "after"):
        rows.append(Row(case=f"grpo-iteration-{name}", baseline="before (same run, alternating rounds)",
                        baseline_ms=summary["before"]["env_s_median"] * 1e3,
                        ours_ms=summary[name]["env_s_median"] * 1e3,
                        params={"rounds": args.rounds, "groups": 6, "group_size": 8},
                        extra=summary[name] | {"load_before": load_before, "load_after": os.getloadavg(),
                                               "alive_after": res["alive_after"]},
                        note="ms: median env time (wall minus policy sampling) of one GRPO iteration"))
    print(json.dumps(summary | {"alive_after": res["alive_after"], "load": [load_before, os.getloadavg()]}))
    with tempfile.TemporaryDirectory() as scratch:
        return write_results("posttrain-env", rows, markdown=Path(scratch) / "BENCH.md")


if __name__ == "__main__":
    print(main())
