"""Graph breaks of one compiled K3 decoder layer per kind (KDA or MLA mixer, dense or MoE FFN), on the CPU.

Usage:  python -m benchmarks.train.graph_breaks [--config k3-debug] [--dtype fp32|bf16] [--layers-of k3-mini]

Each layer's forward (training mode, a packed batch of three documents, two AttnRes sources) is traced by
``torch._dynamo.explain``; printed per kind: graphs, graph breaks as explain counts them (a break inside a nested
call counts once per enclosing frame: one ``torch.compiler.disable`` call two modules deep counts 3) and the
functions that broke the graph. ``--dtype bf16`` takes the ``torch._grouped_mm`` expert path, as CUDA training
under autocast does.

``--layers-of PRESET`` also compiles a whole model with ``aot_eager`` (the ``--config`` widths, that preset's layer
count, kinds and AttnRes blocks) in both `apply_compile` scopes and prints the frames and graphs dynamo compiled for
one forward + backward and the seconds it took.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import torch

from k3infra.model import K3Config, K3ForCausalLM
from k3infra.model.modeling import K3DecoderLayer
from k3infra.train.compile import SCOPES, apply_compile
from k3infra.train.parallel import decoder_layers

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


def model_graphs(config: K3Config, scope: str, dtype: torch.dtype, tokens: int = 256) -> dict:
    """``{"frames", "graphs", "seconds"}`` dynamo compiled (``aot_eager``) for one training forward + backward of
    ``K3ForCausalLM(config)`` under `apply_compile` with ``scope``."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    model = K3ForCausalLM(config).to(dtype).train()
    apply_compile(decoder_layers(model), scope=scope, backend="aot_eager")
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    cu_seqlens = torch.tensor([0, tokens // 3, tokens], dtype=torch.int32)
    start = time.perf_counter()
    model(input_ids=ids, cu_seqlens=cu_seqlens, labels=ids).loss.backward()
    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="k3-debug", help="model preset (default k3-debug)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="layer dtype (default fp32)")
    p.add_argument("--layers-of", default=None, help="also compile a whole model with this preset's layers")
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
    report = {"config": args.config, "dtype": args.dtype, "torch": torch.__version__, "layers": rows}
    if args.layers_of:
        shape = K3Config.from_preset(args.layers_of)
        config = K3Config.from_preset(args.config, num_hidden_layers=shape.num_hidden_layers,
                                      layer_types=shape.layer_types, attn_res_block_size=shape.attn_res_block_size,
                                      first_k_dense_replace=shape.first_k_dense_replace)
        report["model"] = {scope: model_graphs(config, scope, DTYPES[args.dtype]) for scope in SCOPES}
        for scope, row in report["model"].items():
            print(f"{args.layers_of} layers at {args.config} widths, scope {scope}: {row['frames']} frames, "
                  f"{row['graphs']} graphs, {row['seconds']} s (aot_eager, one forward + backward)")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
