"""Decode cache, generate(), save_pretrained / AutoModelForCausalLM and packed (cu_seqlens) input."""

import pytest
import torch

from k3infra.model import K3Cache, K3Config, K3ForCausalLM, register


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3ForCausalLM(K3Config.from_preset("k3-debug", kda_chunk_size=8)).eval()
    with torch.no_grad():  # a non-uniform AttnRes so the test sees the sources' mixing
        for layer in m.model.layers:
            layer.attn_res.query.normal_(0, 0.5)
            layer.ffn_res.query.normal_(0, 0.5)
    return m


def test_prefill_then_decode_equals_full_forward(model):
    ids = torch.randint(0, 512, (2, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :13], use_cache=True)
        steps = [out.logits]
        cache = out.cache
        assert isinstance(cache, K3Cache) and cache.get_seq_length() == 13
        for t in range(13, 21):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


def test_greedy_generate_equals_repeated_full_forward(model):
    prompt = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        seq = prompt
        for _ in range(6):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(generated, seq)


def test_packed_sequences_equal_separate_forwards(model):
    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 512, (1, n), generator=gen) for n in (9, 1, 14)]
    cu = torch.tensor([0, 9, 10, 24], dtype=torch.int32)
    with torch.no_grad():
        packed = model(torch.cat(docs, 1), cu_seqlens=cu).logits  # eval: no cache by default with cu_seqlens
        separate = torch.cat([model(d, use_cache=False).logits for d in docs], 1)
    torch.testing.assert_close(packed, separate, rtol=1e-4, atol=1e-4)


def test_save_pretrained_and_auto_load(model, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    register()
    register()  # idempotent
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "k3"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is K3ForCausalLM
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
