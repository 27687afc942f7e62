"""`K3Cache`: decode state of a K3 model: per KDA layer the fp32 recurrent state and the last ``w − 1`` conv
inputs of q, k and v; per MLA layer the latent ``[c | k_r]`` of every past token.

Example::

    >>> cache = K3Cache()
    >>> out = model(input_ids, cache=cache, use_cache=True)     # prefill
    >>> out = model(next_ids, cache=out.cache, use_cache=True)  # one more token
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["K3Cache", "KDALayerState"]


@dataclass
class KDALayerState:
    recurrent: torch.Tensor
    """``[B, H, K, V]`` fp32 KDA state."""
    conv: list[torch.Tensor]
    """``[B, w − 1, D]`` last conv inputs of q, k, v."""


class K3Cache:
    """Per-layer decode state (see the module docstring); `get_seq_length` is the number of tokens seen."""

    def __init__(self) -> None:
        self.kda: dict[int, KDALayerState] = {}
        self.mla: dict[int, torch.Tensor] = {}
        self._seen: dict[int, int] = {}

    def kda_state(self, layer_idx: int) -> KDALayerState | None:
        """This KDA layer's state, or None before its first call."""
        return self.kda.get(layer_idx)

    def update_kda(self, layer_idx: int, recurrent: torch.Tensor, conv: list[torch.Tensor], tokens: int) -> None:
        """Store a KDA layer's state after it processed ``tokens`` more tokens."""
        self.kda[layer_idx] = KDALayerState(recurrent.detach(), conv)
        self._seen[layer_idx] = self._seen.get(layer_idx, 0) + tokens

    def update_mla(self, layer_idx: int, latent_BTL: torch.Tensor) -> torch.Tensor:
        """Append ``[B, T, r_kv + r]`` latents; returns the layer's whole ``[B, S, r_kv + r]`` history."""
        past = self.mla.get(layer_idx)
        full = latent_BTL if past is None else torch.cat([past, latent_BTL], 1)
        self.mla[layer_idx] = full.detach()
        self._seen[layer_idx] = full.shape[1]
        return full

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens already processed (0 for an empty cache)."""
        if not self._seen:
            return 0
        return self._seen.get(layer_idx, max(self._seen.values()))

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Select batch rows ``beam_idx`` (beam search)."""
        for state in self.kda.values():
            state.recurrent = state.recurrent.index_select(0, beam_idx.to(state.recurrent.device))
            state.conv = [c.index_select(0, beam_idx.to(c.device)) for c in state.conv]
        for i, latent in self.mla.items():
            self.mla[i] = latent.index_select(0, beam_idx.to(latent.device))
