"""Agentic RL post-training on AgentEnv: seeded tool tasks with sandbox-checked rewards, SFT on recorded
scripted transcripts, GRPO with groups forked from one sandbox, and a self-contained HTML viewer.

Public API: `make_tasks`, `make_task`, `ByteTokenizer`, `WordTokenizer`, `tiny_model`, `TrainConfig`,
`run` (SFT + GRPO), `sft`, `grpo_step`, `group_advantages`, `grpo_loss`, `rollout_group`, `rollout_groups`,
`evaluate`, `write_view`.
"""

from __future__ import annotations

from agentenv.posttrain.grpo import group_advantages, grpo_loss, sft_loss
from agentenv.posttrain.policy import ByteTokenizer, WordTokenizer, tiny_model
from agentenv.posttrain.rollout import Episode, evaluate, record_transcripts, rollout_group, rollout_groups
from agentenv.posttrain.tasks import make_task, make_tasks
from agentenv.posttrain.train import TrainConfig, grpo_step, run, sft
from agentenv.posttrain.view import write_view

__all__ = ["ByteTokenizer", "Episode", "TrainConfig", "evaluate", "group_advantages", "grpo_loss", "grpo_step",
           "make_task", "make_tasks", "record_transcripts", "rollout_group", "rollout_groups", "run", "sft", "sft_loss",
           "tiny_model", "WordTokenizer", "write_view"]
