"""Planner terms that follow `K3ForCausalLM`'s memory: the chunked loss holds one chunk's logits and the head's
weight gradient, AttnRes keeps two running sums per layer without full recompute, a batched prefill holds every
sequence's working set."""

from k3infra.model.config import K3Config
from k3infra.plan import Layout, ServeWorkload, TrainWorkload, model_from_k3, serve_memory, train_memory
from k3infra.plan.memory import CE_CHUNK_BYTES, CE_WEIGHT_GRAD_BYTES
from k3infra.plan.prefill import prefill_peak

SPEC = model_from_k3(K3Config.from_preset("k3-mini"))


def _train(**kw):
    layout = Layout(zero=0, recompute=kw.pop("recompute", "none"))
    return train_memory(SPEC, layout, TrainWorkload(seq_len=4096, global_batch_tokens=4096 * 4, **kw), 1)


def test_chunked_loss_holds_one_chunk():
    full = _train(micro_batch=4)["logits"]
    chunked = _train(micro_batch=4, chunked_ce=True, ce_chunk_tokens=4096)
    head_grad = SPEC.vocab * SPEC.hidden * CE_WEIGHT_GRAD_BYTES
    assert chunked["logits"] == 4096 * SPEC.vocab * CE_CHUNK_BYTES + head_grad < full
    half = _train(micro_batch=4, chunked_ce=True, ce_chunk_tokens=2048)["logits"]
    assert half - head_grad == (chunked["logits"] - head_grad) / 2


def test_attn_res_running_sums_only_without_full_recompute():
    none, full = _train(micro_batch=1)["attn_res"], _train(micro_batch=1, recompute="full")["attn_res"]
    sums = 2 * len(SPEC.layers) * SPEC.hidden * 2.0 * 4096
    assert none - full == sums


def test_prefill_batch_scales_the_working_set():
    one = serve_memory(SPEC, Layout(zero=0), ServeWorkload(context=4096, concurrency=8, prefill_chunk=4096))
    eight = serve_memory(SPEC, Layout(zero=0),
                         ServeWorkload(context=4096, concurrency=8, prefill_chunk=4096, prefill_batch=8))
    # per-token terms scale by 8; SiTU-GLU's blocked fp32 temporaries stop growing at one block
    assert one["activations"] < eight["activations"] <= 8 * one["activations"]
    assert eight["activations"] == prefill_peak(SPEC, tuple(range(len(SPEC.layers))), 8 * 4096)
    assert eight["kv_cache"] == one["kv_cache"]
