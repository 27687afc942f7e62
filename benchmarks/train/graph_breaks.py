"""Graph breaks of one compiled K3 decoder layer per kind (KDA or MLA mixer, dense or MoE FFN), on the CPU.

Usage:  python -m benchmarks.train.graph_breaks [--config k3-debug] [--dtype fp32|bf16]

Each layer's forward (training mode, a packed batch of three documents, two AttnRes sources) is traced by
``torch._dynamo.explain``; printed per kind: graphs, graph breaks as explain counts them (a break inside a nested
call counts once per enclosing frame: one ``torch.compiler.disable`` call two modules deep counts 3) and the
functions that broke the graph. ``--dtype bf16`` takes the ``torch._grouped_mm`` expert path, as CUDA training
under autocast does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch

from k3infra.model import K3Config
from k3infra.model.modeling import K3DecoderLayer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _reason(text: str) -> str:
    """The function a deliberate break skips (``K3MLA._attend``), else the first line of the reason."""
    found = re.search(r"function `?<function ([\w.]+) at", text)
    return found.group(1) if found else text.strip().splitlines()[0]


def layer_breaks(config: K3Config, layer_idx: int, dtype: torch.dtype, tokens: int = 96) -> dict:
    """``{"graphs", "graph_breaks", "reasons"}`` of ``K3DecoderLayer(config, layer_idx)``'s forward."""
    torch.manual_seed(0)
    layer = K3DecoderLayer(config, layer_idx).to(dtype).train()
    x = torch.randn(1, tokens, config.hidden_size, dtype=dtype)
    partial = torch.randn_like(x)
    cu_seqlens = torch.tensor([0, tokens // 3, tokens // 2, tokens], dtype=torch.int32)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer.forward)([x], partial, cu_seqlens, None)
    return {"graphs": explained.graph_count, "graph_breaks": explained.graph_break_count,
            "reasons": sorted({_reason(b.reason) for b in explained.break_reasons})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="k3-debug", help="model preset (default k3-debug)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="layer dtype (default fp32)")
    args = p.parse_args(argv)
    moe = K3Config.from_preset(args.config)
    dense = K3Config.from_preset(args.config, first_k_dense_replace=moe.num_hidden_layers)
    kda, mla = moe.kda_layers[-1], moe.mla_layers[-1]
    kinds = {"KDA + dense": (dense, kda), "KDA + MoE": (moe, kda), "MLA + dense": (dense, mla),
             "MLA + MoE": (moe, mla)}
    rows = {name: layer_breaks(config, idx, DTYPES[args.dtype]) for name, (config, idx) in kinds.items()}
    print(f"| layer ({args.config}, {args.dtype}, CPU) | graphs | graph breaks (explain) | breaking functions |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['graphs']} | {row['graph_breaks']} | {', '.join(row['reasons'])} |")
    print(json.dumps({"config": args.config, "dtype": args.dtype, "torch": torch.__version__, "layers": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
