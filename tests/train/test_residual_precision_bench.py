"""`benchmarks.train.residual_precision`: both sides measured, the baseline really is the fp32 source, and the
model's own `_embed` is back afterwards."""

import torch

from benchmarks.train import residual_precision
from k3infra.model import K3Config, K3ForCausalLM, modeling


def test_baseline_restores_the_embedding_cast_and_measures_both_sides():
    ours = modeling.K3Model._embed
    model = K3ForCausalLM(K3Config.from_preset("k3-debug", num_hidden_layers=2))
    ids = torch.randint(0, 512, (1, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16), residual_precision.fp32_embedding_source():
        assert model.model._embed(ids).dtype == torch.float32
    assert modeling.K3Model._embed is ours
    row = residual_precision.measure(seed=0, layers=2, rows=1, seq_len=16)
    for side in ("baseline", "ours"):
        for key in ("all_grads_rel", "embedding_rel", "median_tensor_rel"):
            value = row.extra[f"{side}_{key}"]
            assert 0 < value < 1, (side, key, value)
    assert row.extra["ours_all_grads_rel"] != row.extra["baseline_all_grads_rel"]
