"""Post-training: tasks and sandbox verifiers, GRPO/SFT math by hand, one tiny SFT + GRPO run with forked
groups, replay of its trajectories, the HTML viewer in headless Chromium, no leaks."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from agentenv.posttrain import (  # noqa: E402
    ByteTokenizer,
    TrainConfig,
    WordTokenizer,
    group_advantages,
    grpo_loss,
    make_task,
    make_tasks,
    run,
    sft,
    sft_loss,
    tiny_model,
    write_view,
)
from agentenv.posttrain.policy import generate_action, generate_actions  # noqa: E402
from agentenv.posttrain.tasks import (  # noqa: E402
    HELD_OUT_FROM,
    format_action,
    format_observation,
    parse_action,
    vocabulary,
)


def test_tasks_are_seeded_and_split():
    assert make_task(3).to_dict() == make_task(3).to_dict()
    train, held = make_tasks(5), make_tasks(5, split="held_out")
    assert all("train" in t.tags for t in train) and all("held_out" in t.tags for t in held)
    assert {t.id for t in train}.isdisjoint({t.id for t in held})
    assert held[0].id == f"code-{HELD_OUT_FROM}"
    with pytest.raises(ValueError, match="seed"):
        make_task(-1)
    with pytest.raises(ValueError, match="split"):
        make_tasks(2, split="test")
    for call in make_task(7).solution:
        assert parse_action(format_action(call)) == call
    assert parse_action("rm -rf /")["function"]["name"] == "invalid"


def _asked_pair(task):
    field = task.instruction.split()[2]
    index = task.setup.files["/root/task/index.txt"].splitlines()
    return field, next(line.split()[1] for line in index if line.split()[0] == field + ":")


def test_chain_tasks_follow_the_index():
    train, held = make_tasks(40, family="chain"), make_tasks(40, split="held_out", family="chain")
    assert make_tasks(3, family="chain")[2].to_dict() == train[2].to_dict()
    assert {t.id for t in train}.isdisjoint({t.id for t in held}) and all("held_out" in t.tags for t in held)
    assert len({_asked_pair(t) for t in train}) == 12           # every field in every file: no prior to learn
    tok = WordTokenizer(vocabulary("chain"))
    for task in train[:5] + held[:5]:
        field, name = _asked_pair(task)
        lines = dict(x.split(": ") for x in task.setup.files[f"/root/task/{name}"].splitlines())
        assert len(lines) == 2 and lines[field] == task.verifier.expected  # the asked word and a decoy field
        assert [format_action(c) for c in task.solution][:2] == ["cat index.txt", f"cat {name}"]
        for text in [task.instruction, *task.setup.files.values(), *map(format_action, task.solution)]:
            assert tok.unk_token_id not in tok.encode(text)
    with pytest.raises(ValueError, match="family"):
        make_tasks(2, family="maze")
    with pytest.raises(ValueError, match="family"):
        vocabulary("maze")


def test_chain_task_reward_in_the_sandbox(provider, run, live):
    before = live()
    task = make_tasks(1, split="held_out", family="chain")[0]
    field, name = _asked_pair(task)
    decoy = next(x.split(": ")[1] for x in task.setup.files[f"/root/task/{name}"].splitlines()
                 if not x.startswith(field))
    solved = [format_action(c) for c in task.solution]
    assert _episode(provider, run, task, solved) == 1.0
    assert _episode(provider, run, task, solved[:2] + [f"write answer.txt {decoy}", "submit"]) == 0.0
    assert live() == before


def test_chain_transcript_replays(provider, run, live, tmp_path):
    from agentenv.posttrain import record_transcripts
    from agentenv.rl import EnvPool, replay

    async def record():
        async with EnvPool(provider, max_envs=2, record_dir=tmp_path) as pool:
            return await record_transcripts(pool, make_tasks(2, split="held_out", family="chain"))
    ids = run(record())
    assert len(ids) == 2
    for i in ids:
        report = replay(tmp_path / f"{i}.jsonl", provider)
        assert report.ok, report
    assert not live()


def test_policy_sees_the_shell_output():
    shown = format_observation({"content": "exit_code: 0\nstdout:\ncode: ice\n", "error": None})
    assert shown == "exit_code: 0 code: ice"
    assert format_observation({"content": "x", "error": {"type": "unknown_tool"}}) == "error unknown_tool"


def test_word_tokenizer():
    tok = WordTokenizer(vocabulary())
    for call in make_task(5).solution:
        line = format_action(call)
        assert tok.decode(tok.encode(line)) == line and tok.unk_token_id not in tok.encode(line)
    ids = tok.encode("T: find the code in key.txt, write it\nzzz")
    assert ids[-1] == tok.unk_token_id and ids[-2] == tok.encode("\n")[0]
    with pytest.raises(ValueError, match="words"):
        WordTokenizer(["a", "a"])
    with pytest.raises(ValueError, match="words"):
        WordTokenizer(["a b"])


def test_batched_sampling_matches_one_at_a_time():
    tok = WordTokenizer(vocabulary())
    model = tiny_model(tok.vocab_size, n_embd=32, n_layer=1, n_head=2, n_positions=64, eos_token_id=0).eval()
    contexts = ["T: find the code in key.txt\n", "T: submit\nA: cat note.txt\nO: exit_code: 0 code: red\n"]
    batched = generate_actions(model, tok, contexts, temperature=0, max_new_tokens=5)
    assert batched == [generate_action(model, tok, c, temperature=0, max_new_tokens=5) for c in contexts]


def _episode(provider, run, task, actions):
    from agentenv.rl import AgentEnv

    async def go():
        async with AgentEnv(provider) as env:
            await env.reset(task=task)
            reward = 0.0
            for a in actions:
                _, reward, terminated, truncated, _ = await env.step(parse_action(a))
                if terminated or truncated:
                    break
            return reward
    return run(go())


def test_reward_is_checked_in_the_sandbox(provider, run, live):
    before = live()
    task = make_task(11)
    word = task.verifier.expected
    name = task.instruction.split()[4].rstrip(",")
    wrong = "x" + word
    assert _episode(provider, run, task, [f"cat {name}", f"write answer.txt {word}", "submit"]) == 1.0
    assert _episode(provider, run, task, [f"cat {name}", f"write answer.txt {wrong}", "submit"]) == 0.0
    assert _episode(provider, run, task, [f"cat {name}", f"write answer.txt {word} {word}", "submit"]) == 0.0
    assert _episode(provider, run, task, ["submit"]) == 0.0          # claiming success is not enough
    assert _episode(provider, run, task, ["cat nothing.txt", "write answer.txt/x y", "submit"]) == 0.0
    assert live() == before


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]), eps=0.0 + 1e-4)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) / (0.5 + 1e-4) * 0.5, atol=1e-5)
    assert torch.all(adv[1] == 0)
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.zeros(4))


def test_grpo_loss_by_hand():
    logp = torch.tensor([[math.log(0.5), math.log(0.9)], [math.log(0.2), 0.0]])
    old = torch.tensor([[math.log(0.4), math.log(0.6)], [math.log(0.4), 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = grpo_loss(logp, old, adv, mask, clip_eps=0.2)
    # seq 0: ratios 1.25 (clip 1.2) and 1.5 (clip 1.2), A=+1 -> min = 1.2, 1.2 -> -1.2
    # seq 1: ratio 0.5 (clip 0.8), A=-2 -> min(-1.0, -1.6) = -1.6 -> +1.6
    assert loss.item() == pytest.approx((-1.2 + 1.6) / 2, abs=1e-5)
    assert stats["clip_frac"] == pytest.approx(1.0)
    ref = logp.clone()
    loss_kl, stats_kl = grpo_loss(logp, old, adv, mask, beta=0.5, logp_ref=ref)
    assert stats_kl["kl"] == pytest.approx(0.0) and loss_kl.item() == pytest.approx(loss.item())
    with pytest.raises(ValueError, match="logp_ref"):
        grpo_loss(logp, old, adv, mask, beta=0.1)
    assert sft_loss(logp, mask).item() == pytest.approx(-(math.log(0.5) + math.log(0.9) + math.log(0.2)) / 3)


@pytest.fixture(scope="module")
def tiny_run(provider, tmp_path_factory):
    import asyncio

    run_dir = tmp_path_factory.mktemp("posttrain-run")
    cfg = TrainConfig(sft_tasks=2, sft_steps=3, grpo_iters=1, groups_per_iter=2, group_size=2, train_tasks=4,
                      eval_tasks=2, max_envs=8)
    result = asyncio.run(run(run_dir, provider, tiny_model(n_embd=32, n_layer=1, n_head=2), ByteTokenizer(), cfg))
    return run_dir, result


def test_grpo_step_skips_groups_without_signal():
    from agentenv.posttrain import Episode, grpo_step
    from agentenv.posttrain.policy import prompt_text, turn_texts

    tok = WordTokenizer(vocabulary())
    model = tiny_model(tok.vocab_size, n_embd=32, n_layer=1, n_head=2, n_positions=64, eos_token_id=0).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def episode(word, reward):
        act, obs = turn_texts(f"write answer.txt {word}", {"content": "wrote"})
        return Episode("t", [(prompt_text("find the code"), False), (act, True), (obs, False)], reward=reward)
    before = [p.detach().clone() for p in model.parameters()]
    flat = [[episode("red", 1.0), episode("fig", 1.0)], [episode("red", 0.0), episode("oak", 0.0)]]
    assert grpo_step(model, None, opt, tok, flat, clip_eps=0.2, beta=0.0)["informative_groups"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))    # no signal: no step
    ctx = "T: find the code\nA: write answer.txt"
    logp = torch.log_softmax(model(torch.tensor([tok.encode(ctx)])).logits[0, -1], -1)[tok.encode("red")[0]]
    for _ in range(5):
        stats = grpo_step(model, None, opt, tok, [[episode("red", 1.0), episode("oak", 0.0)]] + flat,
                          clip_eps=0.2, beta=0.0)
    assert stats["informative_groups"] == 1
    after = torch.log_softmax(model(torch.tensor([tok.encode(ctx)])).logits[0, -1], -1)[tok.encode("red")[0]]
    assert after > logp                                                           # the rewarded word got likelier


def test_sft_reduces_loss():
    task = make_task(1)
    from agentenv.posttrain.policy import prompt_text, turn_texts

    segments = [(prompt_text(task.instruction), False)]
    for call, obs in zip(task.solution, ["code: x", "wrote", "submitted"]):
        a, o = turn_texts(format_action(call), {"content": obs})
        segments += [(a, True), (o, False)]
    losses = sft(tiny_model(n_embd=32, n_layer=1, n_head=2), ByteTokenizer(), [segments], steps=30, lr=1e-2)
    assert losses[-1] < 0.5 * losses[0]


def test_grpo_iteration_with_forked_groups(tiny_run, live):
    run_dir, result = tiny_run
    assert result["solver"] == 1.0 and 0.0 <= result["sft"] <= 1.0 and 0.0 <= result["grpo"] <= 1.0
    rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    assert [r["phase"] for r in rows] == ["sft", "grpo", "final"]
    assert 0.0 <= rows[1]["env_share"] <= 1.0 and math.isfinite(rows[1]["loss"])
    groups = [json.loads(x) for x in open(run_dir / "groups.jsonl")]
    assert len(groups) == 2 and all(len(g["children"]) == 2 for g in groups)
    for g in groups:
        for child in g["children"]:
            header = json.loads(open(run_dir / "traj" / f"{child['trajectory_id']}.jsonl").readline())
            assert header["parent"]["trajectory_id"] == g["parent"]         # one fork of the parent's sandbox per group
    assert (run_dir / "curves.png").stat().st_size > 0 and any((run_dir / "tb").iterdir())
    assert not live()


def test_recorded_trajectory_replays(tiny_run, provider):
    from agentenv.rl import replay

    run_dir, _ = tiny_run
    scripted = [p for p in sorted((run_dir / "traj").glob("*.jsonl"))
                if json.loads(p.open().readline()).get("parent") is None]
    report = replay(scripted[0], provider)
    assert report.ok, report


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs the distribution's chromium (make deps)")
def test_viewer_in_headless_chromium(tiny_run, tmp_path):
    from agentenv.cli import main

    run_dir, result = tiny_run
    out = tmp_path / "view.html"
    assert main(["view", str(run_dir), "-o", str(out)]) == 0
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--no-first-run", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", out.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert f'<td id="sft">{result["sft"]:.3f}</td>' in dom
    assert f'<td id="grpo">{result["grpo"]:.3f}</td>' in dom
    assert dom.count('class="group"') == 2 and dom.count('class="child ') == 4
    assert 'class="curve" data-points="1"' in dom
    assert "forked into 2" in dom
    with pytest.raises(FileNotFoundError, match="run_dir"):
        write_view(tmp_path / "nothing")
    assert not os.path.exists(tmp_path / "nothing" / "view.html")


def test_file_verifier_round_trips():
    from agentenv.rl.tasks import FileVerifier, verifier_from_dict

    verifier = make_task(4).verifier
    assert isinstance(verifier, FileVerifier) and verifier_from_dict(verifier.to_dict()) == verifier


def test_generated_tasks_share_one_template(provider, run, live):
    from agentenv.rl import AgentEnv, Setup

    tasks = make_tasks(3)
    assert len({provider.template(t.image, t.setup, t.limits) for t in tasks}) == 1

    async def first_observation(task):
        async with AgentEnv(provider) as env:
            await env.reset(task=task)
            return (await env.step(parse_action(f"cat {task.instruction.split()[4].rstrip(',')}")))[0]["content"]
    for task in tasks:                                   # each sandbox still starts with its task's files
        assert run(first_observation(task)).split() == ["code:", task.verifier.expected]
    assert not live()
    with pytest.raises(ValueError, match="files_at_reset"):
        Setup(files={"/root/a": "x"}, commands=["true"], files_at_reset=True)


def test_pointer_head_copies_from_the_context():
    tok = WordTokenizer(vocabulary())
    model = tiny_model(tok.vocab_size, n_embd=32, n_layer=1, n_head=2, n_positions=64, eos_token_id=0,
                       copy_head=True).eval()
    contexts = ["T: find the code in key.txt\n", "T: submit\nA: cat note.txt\nO: code: red\n"]
    batched = generate_actions(model, tok, contexts, temperature=0, max_new_tokens=5)
    assert batched == [generate_action(model, tok, c, temperature=0, max_new_tokens=5) for c in contexts]
    ids = torch.tensor([tok.encode(contexts[1])])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits.exp().sum(-1), torch.ones(ids.shape), atol=1e-5)
        model.gate.bias.fill_(-50.0)                          # all mass on the pointer
        model.query.weight.zero_()
        model.query.bias.zero_()                              # uniform attention over the tokens so far
        p = model(ids).logits[0, -1].exp()
    seen = set(ids[0].tolist())
    assert p[tok.encode("red")[0]] == pytest.approx(1 / ids.shape[1], rel=1e-3)
    assert all(p[i] < 1e-6 for i in range(tok.vocab_size) if i not in seen)
