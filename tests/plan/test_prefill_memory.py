"""The planner's serving activation terms against the live bytes of the real model's no-grad prefill on the CPU.

Live bytes are counted per storage by a `TorchDispatchMode` (every op's outputs registered, freed when the storage
dies), so the peak is what the allocator would hold, without its rounding. The MoE and dense FFN phases run the
same torch code on the CPU as on a GPU (KDA and attention run other kernels there, so they are not compared).
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from k3infra.model import K3Cache, K3ForCausalLM
from k3infra.model.config import K3Config
from k3infra.plan import model_from_k3
from k3infra.plan.prefill import _dense_prefill, _stream, moe_prefill

TOLERANCE = 0.02
"""Relative: the formulas leave out per-token scalars (norm statistics, bincounts) and the int32 offsets."""


class LiveBytes(TorchDispatchMode):
    """Current and peak bytes of the storages made by ops inside the mode (``known`` storages skipped)."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known, self.live, self.current, self.peak = known, {}, 0, 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or key in self.known or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            weakref.finalize(storage, self._free, key)
            self.peak = max(self.peak, self.current)
        return out


@pytest.fixture(scope="module")
def prefill():
    """Per FFN module of k3-debug: peak bytes above the bytes alive at its entry, in one prefill of B×T tokens."""
    config = K3Config.from_preset("k3-debug", kda_backend="torch")
    torch.manual_seed(0)
    model = K3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    tracker = LiveBytes({t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]})
    peaks, entry, stream = {}, {}, {}
    cache = K3Cache()

    def cache_bytes() -> int:
        kda = [t for state in cache.kda.values() for t in (state.recurrent, *state.conv)]
        return sum(t.untyped_storage().nbytes() for t in [*kda, *cache.mla.values()])

    def alive(key):
        def hook(module, args):
            stream[key] = tracker.current - cache_bytes()

        return hook

    def enter(index):
        def hook(module, args):
            entry[index] = (tracker.current, tracker.peak)
            tracker.peak = tracker.current

        return hook

    def leave(index):
        def hook(module, args, out):
            start, outer = entry[index]
            peaks[index] = tracker.peak - start
            tracker.peak = max(outer, tracker.peak)

        return hook

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(alive((i, "attn")))
        layer.mlp.register_forward_pre_hook(alive((i, "ffn")))
        layer.mlp.register_forward_pre_hook(enter(i))
        layer.mlp.register_forward_hook(leave(i))
    B, T = 2, 96
    ids = torch.randint(0, config.vocab_size, (B, T))
    with torch.no_grad(), tracker:
        model.model(ids, cache=cache, use_cache=True)
    return config, B * T, peaks, cache, stream


def test_moe_and_dense_prefill_terms_match_live_bytes(prefill):
    config, tokens, peaks, _, _ = prefill
    spec = model_from_k3(config)
    for i, (_, ffn) in enumerate(spec.layers):
        predicted = moe_prefill(spec, tokens) if ffn == "moe" else _dense_prefill(spec, tokens)
        assert predicted == pytest.approx(peaks[i], rel=TOLERANCE), (i, ffn, predicted, peaks[i])


def test_cache_keeps_only_the_conv_tail(prefill):
    config, _, _, cache, _ = prefill
    D = config.kda_num_heads * config.kda_head_dim
    for state in cache.kda.values():
        for conv in state.conv:  # [B, w - 1, D]: a copy, not a view holding the whole projection
            assert conv.untyped_storage().nbytes() == conv.numel() * conv.element_size()
            assert conv.shape[1:] == (config.kda_conv_size - 1, D)


def test_residual_stream_alive_at_each_phase(prefill):
    """AttnRes sources, the site output and the normed input (mid-block the FFN phase also holds the mixer output
    and the old running sum) when the mixer / FFN starts, caches left out."""
    config, tokens, _, _, stream = prefill
    spec = model_from_k3(config)
    for i in range(len(spec.layers)):
        attn, ffn = _stream(spec, i)
        assert attn * tokens == pytest.approx(stream[(i, "attn")], rel=TOLERANCE), (i, "attn")
        assert ffn * tokens == pytest.approx(stream[(i, "ffn")], rel=TOLERANCE), (i, "ffn")
