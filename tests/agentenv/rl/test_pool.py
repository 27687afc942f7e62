"""EnvPool: 200 environments at once on real sandboxes, admission control, timeouts, warm pools, metrics."""

from __future__ import annotations

import pytest

from agentenv.rl import CommandVerifier, EnvPool, ScriptedPolicy, TaskSpec, load_suite
from agentenv.rl.policy import tool_call
from agentenv.rl.pool import percentile


def test_pool_of_200_envs_solves_suite(provider, run, live, tmp_path):
    tasks = (load_suite() * 34)[:200]

    async def main():
        async with EnvPool(provider, max_envs=200, max_inflight=32, record_dir=tmp_path, fsync="end",
                           progress=True) as pool:
            await pool.warm(tasks)
            pool.reset_metrics()
            results = await pool.run(tasks, ScriptedPolicy)
            return results, pool.metrics()

    before = live()
    results, m = run(main())
    assert [r.task_id for r in results] == [t.id for t in tasks]
    assert all(r.reward == 1.0 and r.errors == [] for r in results)
    assert m.episodes == 200 and m.failed_episodes == 0 and m.step_errors == {}
    assert m.steps == sum(len(t.solution) for t in tasks)
    assert m.peak_envs == 200 and m.p50_ms <= m.p99_ms <= m.max_ms
    assert len(list(tmp_path.glob("*.jsonl"))) == 200
    assert live() <= before


def test_admission_control_caps_live_envs(provider, run):
    tasks = load_suite(["roman", "prime-sum"]) * 6

    async def main():
        async with EnvPool(provider, max_envs=3, max_inflight=4) as pool:
            results = await pool.run(tasks, ScriptedPolicy)
            return results, pool.metrics()

    results, m = run(main())
    assert all(r.reward == 1.0 for r in results)
    assert m.peak_envs == 3


def test_hung_step_fails_its_episode_only(provider, run, live):
    slow = TaskSpec(id="hang", instruction="x", verifier=CommandVerifier("true"), step_timeout_s=60,
                    solution=[tool_call("run_shell", command="sleep 20"), tool_call("submit")])
    (fast,) = load_suite(["prime-sum"])

    async def main():
        async with EnvPool(provider, max_envs=4, step_timeout_s=1.5) as pool:
            return await pool.run([slow, fast], ScriptedPolicy), pool.metrics()

    before = live()
    (hung, ok), m = run(main())
    assert hung.errors == ["step_timeout"] and hung.reward == 0.0
    assert ok.reward == 1.0 and m.failed_episodes == 1 and m.step_errors == {"step_timeout": 1}
    assert live() <= before


def test_warm_pool_hands_out_prerestored_sandboxes(provider, run, live):
    tasks = load_suite(["roman"]) * 3

    async def main():
        async with EnvPool(provider, max_envs=3) as pool:
            await pool.warm(tasks, per_task=3)
            warm = provider.warm_count()
            results = await pool.run(tasks, ScriptedPolicy)
            return warm, provider.warm_count(), results

    warm, after, results = run(main())
    assert warm == 3 and after == 0 and all(r.reward == 1.0 for r in results)


def test_pool_validates_arguments(provider):
    with pytest.raises(ValueError, match="max_envs"):
        EnvPool(provider, max_envs=0)
    with pytest.raises(ValueError, match="step_timeout_s"):
        EnvPool(provider, step_timeout_s=-1)
    with pytest.raises(ValueError, match="provider"):
        EnvPool(object())


@pytest.mark.no_runtime
def test_percentile_nearest_rank():
    assert percentile([], 99) == 0.0
    assert percentile([5.0], 50) == 5.0
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) in (50.0, 51.0) and percentile(values, 99) == 99.0


def test_burst_of_restores_keeps_template_alive(provider, live):
    """Hundreds of restores of one task's template at once (small task limits) must all succeed."""
    from concurrent.futures import ThreadPoolExecutor

    task = TaskSpec(id="burst", instruction="x", verifier=CommandVerifier("true"))
    snap = provider.template(task.image, task.setup, task.limits)
    before = live()
    with ThreadPoolExecutor(32) as ex:
        handles = list(ex.map(lambda _: provider.restore(snap, task.limits), range(300)))
    try:
        assert len({h.id for h in handles}) == 300
        assert handles[-1].python("1 + 1", timeout_s=30).value == "2"
    finally:
        with ThreadPoolExecutor(16) as ex:
            list(ex.map(lambda h: h.destroy(), handles))
    assert live() <= before


def test_close_later_destroys_in_the_background(provider, run, live):
    import asyncio

    task = load_suite()[0]

    async def main():
        async with EnvPool(provider) as pool:
            envs = [pool.make_env() for _ in range(3)]
            await asyncio.gather(*(e.reset(task=task) for e in envs))
            ids = [e.handle.id for e in envs]
            gate = asyncio.get_running_loop().create_future()
            pool.close_later(envs[:2], after=gate)              # waits for the gate
            pool.close_later(envs[2:])
            for _ in range(600):
                if ids[2] not in live():
                    break
                await asyncio.sleep(0.05)
            held = set(ids) & live()
            gate.set_result(None)
            await pool.drain()
            return ids, held, set(ids) & live()

    before = live()
    ids, held, left = run(main())
    assert held == set(ids[:2]) and not left and live() == before
