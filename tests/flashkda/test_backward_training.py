"""A short training loop through the FlashKDA training path tracks the same loop through the fp64 oracle.

A tiny token mixer (input projections -> KDA with the K3 flags -> output projection) learns to reproduce a fixed
random target; the same initial weights and batches are trained once with ``chunk_kda_autograd`` and once with
autograd through ``flashkda.reference.chunk_kda_reference``. The loss must fall and the two curves must agree
step by step (each step's update depends on every gradient of the one before, so a wrong gradient anywhere
shows up as a diverging curve).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from flashkda.chunk import chunk_kda_autograd
from flashkda.reference import chunk_kda_reference

D, H, K, T = 32, 2, 16, 80


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkvg = nn.Linear(D, 4 * H * K, bias=False)
        self.b = nn.Linear(D, H, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        self.out = nn.Linear(H * K, D, bias=False)

    def forward(self, x: torch.Tensor, op) -> torch.Tensor:
        B = x.shape[0]
        q, k, v, g = self.qkvg(x).reshape(B, T, 4, H, K).unbind(2)
        o, _ = op(q, k, v, g, self.b(x), scale=K**-0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, A_log=self.A_log, dt_bias=self.dt_bias)
        return self.out(o.reshape(B, T, H * K).to(x.dtype))


def _train(op, dtype: torch.dtype, device: str, steps: int = 4) -> list[float]:
    torch.manual_seed(0)
    model = _Mixer().to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, T, D, generator=gen).to(device=device, dtype=dtype)
    target = torch.randn(1, T, D, generator=gen).to(device=device, dtype=dtype)
    opt = torch.optim.Adam(model.parameters(), lr=5e-2)
    losses = []
    for _ in range(steps):
        loss = (model(x, op) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_training_loop_matches_the_fp64_oracle_loop(device: str) -> None:
    ours = _train(chunk_kda_autograd, torch.float32, device)
    oracle = _train(chunk_kda_reference, torch.float64, device)
    assert ours[-1] < ours[0] * 0.98, f"loss did not fall: {ours}"
    for step, (a, b) in enumerate(zip(ours, oracle)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: flashkda {a:.6f} vs oracle {b:.6f}"
