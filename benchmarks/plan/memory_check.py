"""Planner check: predicted peak memory vs `torch.cuda.max_memory_allocated` for k3-mini variants.

Each training variant runs two optimizer steps of ``K3ForCausalLM`` with the planner's memory layout: bf16
weights, fp32 gradient buffers filled by post-accumulate hooks (``main_grad``, the bf16 ``.grad`` freed at once),
fp32 master weights and AdamW states; the peak of the second step (states exist) is compared with
``train_memory``. Serving variants run one no-grad prefill of the whole context (``prefill_chunk`` = context) and
compare with ``serve_memory``. Full recompute uses the model's ``gradient_checkpointing_enable`` (a variant is
reported as not run if the model has none).

    python -m benchmarks.plan.memory_check                       # H200: every variant, JSON in results/
    python -m benchmarks.plan.memory_check --device cpu --model k3-debug --no-write   # API check, no numbers

On the CPU nothing is measured (``measured_gb`` is None); the run only proves that every variant executes.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import logging
import time
from dataclasses import dataclass

from benchmarks.harness import Row, write_results
from k3infra.model.config import K3Config
from k3infra.plan import Layout, ServeWorkload, TrainWorkload, model_from_k3, serve_memory, train_memory

log = logging.getLogger(__name__)
GB = 1e9


@dataclass(frozen=True)
class Variant:
    kind: str
    seq: int
    batch: int
    recompute: str = "none"

    @property
    def case(self) -> str:
        return f"{self.kind}-T{self.seq}-B{self.batch}-{self.recompute}"


VARIANTS = (
    Variant("train", 4096, 8, "none"),
    Variant("train", 4096, 8, "full"),
    Variant("train", 4096, 2, "none"),
    Variant("train", 32768, 1, "none"),
    Variant("train", 32768, 1, "full"),
    Variant("train", 4096, 4, "full"),
    Variant("serve", 4096, 8),
    Variant("serve", 32768, 1),
)
DEBUG_VARIANTS = tuple(Variant(v.kind, max(16, v.seq // 256), v.batch, v.recompute) for v in VARIANTS)


def _model_class():
    try:
        from k3infra.model import K3ForCausalLM
    except ImportError as error:
        raise SystemExit(f"K3ForCausalLM is not available in k3infra.model ({error}); nothing to measure") from error
    return K3ForCausalLM


def _loss(out) -> object:
    return out.loss if hasattr(out, "loss") else out[0] if isinstance(out, tuple) else out


def _train_step_fn(model, torch, device: str):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)

        def accumulate(param) -> None:
            param.main_grad.add_(param.grad.float())
            param.grad = None

        p.register_post_accumulate_grad_hook(accumulate)
    master = [p.detach().float().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=1e-4)

    def step(input_ids) -> float:
        loss = _loss(model(input_ids=input_ids, labels=input_ids))
        loss.backward()
        for m, p in zip(master, params):
            m.grad = p.main_grad
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)
                p.main_grad.zero_()
        return float(loss.detach())

    return step


def _prefill_fn(model, ids):
    """A serving engine's prefill: the decoder with a fresh cache, logits of the last position only (what
    `serve_memory` models). Falls back to the full forward when the model has no ``.model`` / ``cache`` API."""
    decoder = getattr(model, "model", None)
    accepted = inspect.signature(decoder.forward).parameters if decoder is not None else {}
    if "cache" in accepted:
        from k3infra.model import K3Cache

        def run() -> None:
            out = decoder(ids, cache=K3Cache(), use_cache=True)
            model.lm_head(out.last_hidden_state[:, -1:]).float()

        return run, ""
    return (lambda: model(input_ids=ids)), "full forward: logits of every position, no cache"


def _release(torch, cuda: bool) -> None:
    """Free what a finished (or failed) variant left behind, so the next one starts from an empty device."""
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def measure(variant: Variant, config: K3Config, device: str) -> tuple[float | None, float, str]:
    """Run one variant; ``(peak_bytes or None on CPU, seconds of the measured step, note)``."""
    import torch

    cls = _model_class()
    cuda = device.startswith("cuda")
    _release(torch, cuda)
    torch.manual_seed(0)
    model = cls(config).to(device=device)
    with torch.no_grad():  # parameters in bf16 (the planner's 2 B); fp32 buffers (router bias, QB statistics) stay
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (variant.batch, variant.seq), device=device)
    note = ""
    if variant.kind == "train":
        if variant.recompute == "full":
            if not getattr(model, "supports_gradient_checkpointing", False):
                return None, 0.0, "not run: the model does not support gradient checkpointing"
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        model.train()
        step = _train_step_fn(model, torch, device)
        step(ids)  # creates the optimizer states
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        begin = time.perf_counter()
        step(ids)
    else:
        model.eval()
        run, note = _prefill_fn(model, ids)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        begin = time.perf_counter()
        with torch.no_grad():
            run()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - begin
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return peak, seconds, note


def predict(variant: Variant, config: K3Config) -> dict[str, float]:
    spec = model_from_k3(config)
    if variant.kind == "train":
        tokens = variant.seq * variant.batch
        chunk = getattr(config, "loss_chunk_size", 0)  # the model's chunked loss (training, more tokens than chunk)
        work = TrainWorkload(seq_len=variant.seq, global_batch_tokens=tokens, micro_batch=variant.batch,
                             optimizer="adamw", chunked_ce=bool(chunk) and tokens > chunk,
                             ce_chunk_tokens=chunk or 4096)  # fmt: skip
        return train_memory(spec, Layout(zero=0, recompute=variant.recompute), work, 1)
    # the check prefills all sequences of the variant in one forward
    work = ServeWorkload(context=variant.seq, concurrency=variant.batch, prefill_chunk=variant.seq,
                         prefill_batch=variant.batch)
    return serve_memory(spec, Layout(zero=0), work)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="k3-mini", choices=("k3-mini", "k3-debug"), help="preset to build")
    parser.add_argument("--device", default="cuda", help="cuda (measures) or cpu (runs the variants, no numbers)")
    parser.add_argument("--only", default=None, help="comma-separated case names to run (default: all)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results JSON")
    args = parser.parse_args(argv)
    config = K3Config.from_preset(args.model, kda_backend="torch" if args.device == "cpu" else "auto")
    variants = DEBUG_VARIANTS if args.model == "k3-debug" else VARIANTS
    if args.only:
        wanted = set(args.only.split(","))
        variants = tuple(v for v in variants if v.case in wanted)
        if not variants:
            raise SystemExit(f"--only matched no case; cases: {[v.case for v in VARIANTS]}")
    rows = []
    for variant in variants:
        predicted = predict(variant, config)
        try:
            peak, seconds, note = measure(variant, config, args.device)
        except Exception as error:  # one failing variant (e.g. out of memory) must not hide the others
            peak, seconds, note = None, 0.0, f"failed: {type(error).__name__}: {str(error)[:300]}"
            log.warning("%s failed", variant.case, exc_info=True)
        finally:  # the failed variant's tensors (held by the traceback until here) go before the next one
            import torch

            _release(torch, args.device.startswith("cuda"))
        error_pct = None if peak is None else 100 * (predicted["total"] - peak) / peak
        terms = {k: round(v / GB, 3) for k, v in predicted.items() if k not in ("total", "stage") and v}
        rows.append(Row(
            case=variant.case, baseline="torch.cuda.max_memory_allocated", baseline_ms=None, ours_ms=1e3 * seconds,
            params={"model": args.model, "kind": variant.kind, "seq": variant.seq, "batch": variant.batch,
                    "recompute": variant.recompute, "predicted_terms_gb": terms},
            extra={"predicted_gb": round(predicted["total"] / GB, 3),
                   "measured_gb": None if peak is None else round(peak / GB, 3),
                   "error_pct": None if error_pct is None else round(error_pct, 1)},
            note=note or ("not measured on cpu" if peak is None else ""),
        ))  # fmt: skip
        e = rows[-1].extra
        print(f"{variant.case:28s} predicted {e['predicted_gb']:8.2f} GB  measured {e['measured_gb']}  "
              f"error {e['error_pct']}%  {rows[-1].note}")  # fmt: skip
    if not args.no_write:
        print(write_results("plan-memory", rows, title="planner: predicted vs measured peak memory (k3-mini)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
