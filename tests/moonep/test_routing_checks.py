"""Routing the buffer cannot serve names itself: ``top_k > num_experts`` at construction, and a token that
lists the same expert twice in ``topk_idx`` at dispatch (raised on every rank)."""

from __future__ import annotations

import pytest
import torch

from k3infra.testing import run_ranks
from moonep import Buffer

pytestmark = pytest.mark.multiproc


def _top_k_over_experts(rank: int, world: int) -> str:
    try:
        Buffer(None, 4, 8, 5, 4 * world, dtype=torch.float32, timeout_s=5.0)
    except ValueError as error:
        return str(error)
    return "no error"


def _duplicate_experts(rank: int, world: int, bad_rank: int) -> list[str]:
    buffer = Buffer(None, 4, 8, 2, 2 * world, dtype=torch.float32, timeout_s=5.0)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3]])
    if rank == bad_rank:
        idx[2] = torch.tensor([3, 3])
    w = torch.full((4, 2), 0.5)
    x = torch.randn(4, 8)
    errors = []
    for call in (lambda: buffer.dispatch(x, idx, w), lambda: buffer.plan(idx, w)):
        try:
            call()
            errors.append("no error")
        except ValueError as error:
            errors.append(str(error))
    # -1 (no selection) may repeat: it is not an expert.
    idx_none = torch.tensor([[0, -1], [-1, -1], [1, -1], [0, 1]])
    out = buffer.dispatch(x, idx_none, w)
    buffer.combine(out.x_CH, out.handle)
    buffer.destroy()
    return errors


def test_top_k_above_num_experts_raises_naming_top_k() -> None:
    (message,) = run_ranks(_top_k_over_experts, 1, timeout_s=60)
    assert "top_k (5) must be <= num_experts (4)" in message


def test_duplicate_expert_in_one_token_raises_on_every_rank() -> None:
    results = run_ranks(_duplicate_experts, 2, 1, timeout_s=60)
    for errors in results:
        assert len(errors) == 2
        for message in errors:
            assert "rank 1 passed topk_idx with the same expert twice within one token" in message
