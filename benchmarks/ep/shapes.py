"""The K3 layer shapes and routings every EP benchmark takes (shared by `run.py` and `local.py`)."""

from __future__ import annotations

import argparse

BENCH_SKEWS = ("uniform", "lognormal1", "lognormal2", "hot_rank", "one_expert")


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """Tokens per rank, hiddens, E, K and skews, with the K3 defaults."""
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (s)")
    p.add_argument("--hiddens", default="7168,3584", help="comma-separated hidden sizes H to time")
    p.add_argument("--experts", type=int, default=896, help="number of routed experts E")
    p.add_argument("--topk", type=int, default=16, help="experts per token K")
    p.add_argument("--skews", default=",".join(BENCH_SKEWS),
                   help=f"comma-separated routing skews (from {', '.join(BENCH_SKEWS)})")
