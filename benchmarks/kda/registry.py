"""The KDA benchmark cases: prefill rows against fla's chunk_kda, one decode row against
fla's fused_recurrent_kda. All rows: D = 128, bf16, fp32 initial and final state, inference mode."""

from __future__ import annotations

from dataclasses import dataclass, field

VARLEN_MIXED = (1300, 547, 2048, 963, 271, 3063)
VARLEN_EVEN = (1024,) * 8


@dataclass(frozen=True)
class Case:
    """One benchmark row: ``lengths`` of the sequences (one entry = fixed length, B = 1) and heads ``H``."""

    name: str
    H: int
    lengths: tuple[int, ...]
    varlen: bool = False
    decode: bool = False
    D: int = 128
    params: dict = field(default_factory=dict)

    @property
    def T(self) -> int:
        return sum(self.lengths)


# Ordered so that a run cut short has measured the anchors of DESIGN.md §2 first.
PREFILL = [
    Case("H64-T8192", 64, (8192,)),
    Case("H32-T131072", 32, (131072,)),
    Case("H64-varlen6", 64, VARLEN_MIXED, varlen=True),
    Case("H12-T8192", 12, (8192,)),
    Case("H96-T8192", 96, (8192,)),
    Case("H64-varlen1024x8", 64, VARLEN_EVEN, varlen=True),
    Case("H64-T32768", 64, (32768,)),
    Case("H96-varlen6", 96, VARLEN_MIXED, varlen=True),
    Case("H96-varlen1024x8", 96, VARLEN_EVEN, varlen=True),
]

#: Decode: 256 sequences of one token each, H = 32 (batched as B = 256, T = 1).
DECODE = [Case("decode-B256-H32", 32, (1,) * 256, decode=True)]

CASES = {c.name: c for c in PREFILL + DECODE}
