"""Per-head Muon: query/key/value projections are orthogonalised one head block at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from k3infra.model import K3Config, K3ForCausalLM
from k3infra.train.optim import ShardedMuon, build_optimizers, head_blocks


def _muon_step(weight: torch.Tensor, grad: torch.Tensor, head_rows) -> torch.Tensor:
    """The update of one Muon step (no weight decay) from ``weight`` with gradient ``grad``."""
    param = nn.Parameter(weight.clone())
    opt = ShardedMuon([{"params": [param], "head_rows": head_rows}], lr=0.1, weight_decay=0.0,
                      adjust_lr_fn="match_rms_adamw")
    param.grad = grad.clone()
    opt.step()
    return (param - weight).detach()


def test_heads_are_orthogonalised_independently():
    torch.manual_seed(0)
    heads, head_dim, d_in = 4, 8, 32
    weight = torch.randn(heads * head_dim, d_in)
    grad = torch.randn(heads * head_dim, d_in)
    louder = grad.clone()
    louder[head_dim:2 * head_dim] *= 1000.0  # head 1's gradient dominates the whole matrix

    per_head, per_head_loud = _muon_step(weight, grad, (head_dim,)), _muon_step(weight, louder, (head_dim,))
    whole, whole_loud = _muon_step(weight, grad, None), _muon_step(weight, louder, None)
    h0 = slice(0, head_dim)
    # per head: head 0's update does not depend on head 1's gradient
    torch.testing.assert_close(per_head_loud[h0], per_head[h0], rtol=0, atol=1e-6)
    # whole matrix: head 1 takes over the spectrum and head 0's update collapses
    assert (whole_loud[h0] - whole[h0]).norm() > 0.5 * whole[h0].norm()

    # each head block equals Muon applied to that block as its own matrix (its own 0.2·√max scale)
    for h in range(heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        torch.testing.assert_close(per_head[rows], _muon_step(weight[rows], grad[rows], None), rtol=0, atol=1e-6)
    # and differs from whole-matrix orthogonalisation
    assert (per_head - whole).norm() > 0.1 * whole.norm()


def test_key_value_pattern_splits_each_head_into_its_blocks():
    torch.manual_seed(1)
    n, dv, heads, d_in = 4, 6, 3, 16
    weight, grad = torch.randn(heads * (n + dv), d_in), torch.randn(heads * (n + dv), d_in)
    update = _muon_step(weight, grad, (n, dv))
    start = 0
    for _ in range(heads):
        for size in (n, dv):
            rows = slice(start, start + size)
            torch.testing.assert_close(update[rows], _muon_step(weight[rows], grad[rows], None), rtol=0, atol=1e-6)
            start += size


def test_k3_model_gets_per_head_groups():
    model = K3ForCausalLM(K3Config.from_preset("k3-debug"))
    blocks = head_blocks(model)
    c = model.config
    assert blocks["model.layers.0.self_attn.q_proj.weight"] == (c.kda_head_dim,)
    assert blocks["model.layers.3.self_attn.kv_b_proj.weight"] == (c.qk_nope_head_dim, c.v_head_dim)
    assert blocks["model.layers.3.self_attn.q_b_proj.weight"] == (c.qk_nope_head_dim + c.qk_rope_head_dim,)
    muon = build_optimizers(model, lr=1e-2)[0]
    ids = {id(p): n for n, p in model.named_parameters()}
    grouped = {ids[id(p)]: g["head_rows"] for g in muon.param_groups for p in g["params"]}
    assert {n for n, rows in grouped.items() if rows} == set(blocks)
    assert grouped["model.layers.0.self_attn.o_proj.weight"] is None  # whole matrix
    plain = build_optimizers(model, lr=1e-2, per_head_muon=False)[0]
    assert all(g["head_rows"] is None for g in plain.param_groups)
    # one step runs and moves the per-head weights
    ids_ = torch.randint(0, c.vocab_size, (1, 16))
    model(ids_, labels=ids_).loss.backward()
    before = model.model.layers[3].self_attn.kv_b_proj.weight.detach().clone()
    muon.step()
    assert not torch.equal(before, model.model.layers[3].self_attn.kv_b_proj.weight)


def test_bad_head_rows_are_rejected():
    with pytest.raises(ValueError, match="head_rows"):
        ShardedMuon([{"params": [nn.Parameter(torch.zeros(10, 4))], "head_rows": (4,)}])
    with pytest.raises(ValueError, match="head_rows"):
        ShardedMuon([{"params": [nn.Parameter(torch.zeros(2, 8, 4))], "head_rows": (4,)}])


@pytest.mark.parametrize("shape", [(5, 8, 24), (3, 24, 8), (2, 16, 16)])
def test_batched_newton_schulz_equals_torch_per_slice(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    from k3infra.train.optim import zeropower_batched

    torch.manual_seed(2)
    g = torch.randn(*shape)
    g[1] *= 1e-3  # each slice normalised by its own norm, not the stack's
    batched = zeropower_batched(g, (3.4445, -4.775, 2.0315), 5, 1e-7)
    assert batched.shape == g.shape and batched.dtype == torch.bfloat16
    for i in range(shape[0]):
        torch.testing.assert_close(batched[i].float(), _zeropower_via_newtonschulz(g[i], (3.4445, -4.775, 2.0315),
                                                                                   5, 1e-7).float(),
                                   rtol=0, atol=2e-2)


def test_stacked_experts_are_orthogonalised_per_slice():
    torch.manual_seed(3)
    weight, grad = torch.randn(4, 6, 10), torch.randn(4, 6, 10)
    grad[2] *= 1000.0
    update = _muon_step(weight, grad, None)
    for e in range(4):
        torch.testing.assert_close(update[e], _muon_step(weight[e], grad[e], None), rtol=0, atol=2e-3)


@pytest.mark.parametrize("head_rows", [None, (4,)])
@pytest.mark.parametrize("batch_bytes", [1, 1 << 30])
def test_parameters_batched_together_step_as_each_alone(monkeypatch, head_rows, batch_bytes):
    from k3infra.train import optim

    monkeypatch.setattr(optim, "MUON_BATCH_BYTES", batch_bytes)
    torch.manual_seed(4)
    shapes = [(8, 10), (3, 8, 10), (12, 10), (8, 10)] if head_rows else [(8, 10), (3, 8, 10), (10, 6), (8, 10)]
    weights = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) * (1 + 100 * i) for i, s in enumerate(shapes)]
    if head_rows:  # per-head groups take 2-D matrices only
        weights, grads = [w for w in weights if w.ndim == 2], [g for g in grads if g.ndim == 2]
    params = [nn.Parameter(w.clone()) for w in weights]
    opt = ShardedMuon([{"params": params, "head_rows": head_rows}], lr=0.1, weight_decay=0.0,
                      adjust_lr_fn="match_rms_adamw")
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for p, w, g in zip(params, weights, grads):
        torch.testing.assert_close((p - w).detach(), _muon_step(w, g, head_rows), rtol=0, atol=2e-3)


@pytest.mark.parametrize("shape", [(16, 24), (24, 16)])
def test_whole_matrices_step_as_torch_muon(shape):
    """Without head blocks a 2-D parameter follows `torch.optim.Muon` (same momentum, Newton–Schulz, scale and
    decoupled weight decay) over several steps; only bf16 summation order differs."""
    torch.manual_seed(5)
    weight = torch.randn(shape)
    ours, ref = nn.Parameter(weight.clone()), nn.Parameter(weight.clone())
    kw = dict(lr=0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    opts = [ShardedMuon([{"params": [ours], "head_rows": None}], **kw), torch.optim.Muon([ref], **kw)]
    for _ in range(3):
        grad = torch.randn(shape)
        for p, opt in zip((ours, ref), opts):
            p.grad = grad.clone()
            opt.step()
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=0, atol=2e-3)
    assert not torch.equal(ours.detach(), weight)


def test_newton_schulz_flops_match_the_counted_matmuls():
    """`newton_schulz_flops` against torch's FLOP counter over a real step: whole matrices (wide and tall),
    stacked experts and per-head blocks of two shapes."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(12, 40)), nn.Parameter(torch.randn(40, 12)),
              nn.Parameter(torch.randn(3, 16, 24)), nn.Parameter(torch.randn(3 * 24, 20))]
    opt = ShardedMuon([{"params": params[:3]}, {"params": params[3:], "head_rows": (16, 8)}], lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    with FlopCounterMode(display=False) as counter:
        opt.step()
    ns = 5 * (2 * (4 * 12 * 12 * 40 + 2 * 12**3) + 3 * (4 * 16 * 16 * 24 + 2 * 16**3)
              + 3 * (4 * 16 * 16 * 20 + 2 * 16**3) + 3 * (4 * 8 * 8 * 20 + 2 * 8**3))
    assert opt.newton_schulz_flops() == ns
    assert counter.get_total_flops() == ns
