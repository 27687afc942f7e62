"""`KDAOptions`: the non-tensor arguments of one ``chunk_kda`` call, shared by the forward and backward stages."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KDAOptions:
    """The non-tensor arguments of one ``chunk_kda`` call."""

    scale: float
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    safe_gate: bool
    lower_bound: float | None
    state_v_first: bool
    disable_recompute: bool
    dot_precision: str = "ieee"
    """``tl.dot`` input precision of the backward's products: ``"tf32"`` (bf16/fp16 on a GPU) or ``"ieee"``."""
    cu_seqlens_cpu: torch.Tensor | None = None
    """Host copy of ``cu_seqlens`` (sizes the chunked layout without reading the device)."""
    head_slices: int | None = None
    """A fixed number of backward head slices (see `backward_head_slices`), or None for its memory rule."""
