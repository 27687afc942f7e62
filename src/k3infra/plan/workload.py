"""Workloads (`TrainWorkload`, `ServeWorkload`) and one parallel `Layout`, validated at construction.

Rank order of a layout (innermost first): TP, CP, DP, PP (Megatron's order). Expert parallelism regroups the
``TP·CP·DP`` ranks of one pipeline stage into ``EP`` × expert-data-parallel ``EDP`` (expert TP is 1).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RECOMPUTE", "OPTIMIZERS", "WEIGHT_BYTES", "TrainWorkload", "ServeWorkload", "Layout"]

RECOMPUTE = ("none", "selective", "full")
OVERLAP = ("none", "dp", "all")
"""Communication hidden behind compute: nothing, data-parallel traffic, or also EP/PP/CP (DualPipe-like)."""
OPTIMIZERS = ("adamw", "muon")
PRECISIONS = ("bf16", "fp8")
CACHE_BYTES = {"bf16": 2.0, "fp8": 1.0}
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "int4": 4.125 / 8, "mxfp4": 4.25 / 8}
"""Bytes per weight: int4 with one bf16 scale per 128 weights; MXFP4 with one 8-bit scale per 32."""
OPTIMIZER_BYTES = {"adamw": 12.0, "muon": 8.0}
"""fp32 master (4) + states: AdamW m, v (8); Muon momentum (4) — ``K3_MODEL.md`` §5."""


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class TrainWorkload:
    """One training step: ``global_batch_tokens`` tokens in sequences of ``seq_len``, ``micro_batch``
    sequences per micro-batch per data-parallel rank."""

    seq_len: int = 4096
    global_batch_tokens: int = 4096 * 64
    micro_batch: int = 1
    precision: str = "bf16"
    """``fp8``: GEMMs at the FP8 peak and saved GEMM inputs stored in 1 byte."""
    optimizer: str = "muon"
    chunked_ce: bool = False
    """Cross-entropy in pieces of ``ce_chunk_tokens`` tokens whose gradients are formed in the forward (no logits
    kept; `K3ForCausalLM` does this in training past ``loss_chunk_size`` tokens, `k3infra.model.linear_ce`)."""
    ce_chunk_tokens: int = 4096

    def __post_init__(self) -> None:
        _positive_int("--seq-len", self.seq_len)
        _positive_int("--global-batch-tokens", self.global_batch_tokens)
        _positive_int("--micro-batch", self.micro_batch)
        _positive_int("--ce-chunk-tokens", self.ce_chunk_tokens)
        _choice("--precision", self.precision, PRECISIONS)
        _choice("--optimizer", self.optimizer, OPTIMIZERS)
        if self.global_batch_tokens % self.seq_len:
            raise ValueError(
                f"--global-batch-tokens ({self.global_batch_tokens}) must be a multiple of --seq-len ({self.seq_len})"
            )

    @property
    def sequences(self) -> int:
        return self.global_batch_tokens // self.seq_len


@dataclass(frozen=True)
class ServeWorkload:
    """Decoding ``concurrency`` sequences of ``context`` tokens each; prefill in chunks of ``prefill_chunk``."""

    context: int = 32768
    concurrency: int = 1
    cache_dtype: str = "bf16"
    weight_dtype: str = "bf16"
    """Routed-expert weights (``bf16 | fp8 | int4 | mxfp4``)."""
    dense_weight_dtype: str = "bf16"
    """Every other weight."""
    prefill_chunk: int = 8192
    prefill_batch: int = 1
    """Sequences prefilled together in one forward (their chunks' working sets add up)."""

    def __post_init__(self) -> None:
        _positive_int("--context", self.context)
        _positive_int("--concurrency", self.concurrency)
        _positive_int("--prefill-chunk", self.prefill_chunk)
        _positive_int("--prefill-batch", self.prefill_batch)
        _choice("--cache-dtype", self.cache_dtype, tuple(CACHE_BYTES))
        _choice("--weight-dtype", self.weight_dtype, tuple(WEIGHT_BYTES))
        _choice("--dense-weight-dtype", self.dense_weight_dtype, tuple(WEIGHT_BYTES))


@dataclass(frozen=True)
class Layout:
    """Parallel sizes of one plan. ``world = tp·cp·dp·pp``; ``vp`` virtual stages per pipeline rank;
    ``zero`` 0 (replicated), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ weights: FSDP);
    ``redundant`` MoonEP redundant expert slots per rank per MoE layer."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    vp: int = 1
    cp: int = 1
    dp: int = 1
    zero: int = 1
    redundant: int = 0
    recompute: str = "none"

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "pp", "vp", "cp", "dp"):
            _positive_int(f"--{name}", getattr(self, name))
        _choice("--zero", self.zero, (0, 1, 2, 3))
        _choice("--recompute", self.recompute, RECOMPUTE)
        if not isinstance(self.redundant, int) or self.redundant < 0:
            raise ValueError(f"--redundant must be an int >= 0, got {self.redundant!r}")
        if self.vp > 1 and self.pp == 1:
            raise ValueError(f"--vp {self.vp} needs --pp > 1")
        if (self.tp * self.cp * self.dp) % self.ep:
            raise ValueError(f"--ep {self.ep} must divide tp·cp·dp = {self.tp * self.cp * self.dp}")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: replicas of each expert shard."""
        return self.tp * self.cp * self.dp // self.ep

    def label(self) -> str:
        parts = [f"TP{self.tp}", f"EP{self.ep}", f"PP{self.pp}" + (f"v{self.vp}" if self.vp > 1 else "")]
        parts += [f"CP{self.cp}", f"DP{self.dp}", f"Z{self.zero}"]
        if self.redundant:
            parts.append(f"R{self.redundant}")
        return " ".join(parts)
