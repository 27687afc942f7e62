"""Argument validation shared by every public FlashKDA entry: one place that names the bad argument.

Every check here runs on shapes, dtypes and devices only, except the ``cu_seqlens`` content check, which reads
``cu_seqlens_cpu`` when given and compares it with the device tensor, read once per tensor object (`flashkda.seqlens`;
an inference tensor once per object and ``cu_seqlens_cpu`` values), and is skipped while a CUDA graph is being
captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashkda.seqlens import host_cu_seqlens

#: Input dtypes the kernels accept for q, k, v.
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Largest head dimensions the kernels hold in one tile.
MAX_HEAD_DIM = 256
#: The keywords fla-core 0.6.0's ``chunk_kda`` reads from its ``**kwargs``.
FLA_KWARGS = ("A_log", "dt_bias", "chunk_size", "transpose_state_layout")


@dataclass(frozen=True)
class KDAShapes:
    """Sizes of one validated call: ``N`` sequences, ``H`` q/k heads, ``HV`` value heads."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int


def _tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    return x


def _same_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"`{name}` is on {x.device} but q is on {device}; move all inputs to one device")


def check_qkvgb(q, k, v, g, beta) -> KDAShapes:
    """Checks q ``[B, T, H, K]``, k (same), v ``[B, T, HV, V]``, g ``[B, T, HV, K]``, beta ``[B, T, HV]``."""
    q, k, v, g, beta = (_tensor(n, x) for n, x in zip("q k v g beta".split(), (q, k, v, g, beta)))
    if q.dim() != 4:
        raise ValueError(f"`q` must be [B, T, H, K], got shape {list(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"`k` must have q's shape {list(q.shape)}, got {list(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"`v` must be [B, T, HV, V] with B={B}, T={T}, got {list(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"`v` has HV={HV} value heads, which must be a positive multiple of H={H} (GVA)")
    if not (0 < K <= MAX_HEAD_DIM):
        raise ValueError(f"`q` head dim K={K} must be in 1..{MAX_HEAD_DIM}")
    if not (0 < V <= MAX_HEAD_DIM):
        raise ValueError(f"`v` head dim V={V} must be in 1..{MAX_HEAD_DIM}")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"`g` must be [B, T, HV, K]={[B, T, HV, K]}, got {list(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"`beta` must be [B, T, HV]={[B, T, HV]}, got {list(beta.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"`{name}` dtype {x.dtype} is not supported; use bfloat16, float16 or float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"`k` and `v` must have q's dtype {q.dtype}, got k={k.dtype}, v={v.dtype}")
    for name, x in (("g", g), ("beta", beta)):
        if not x.is_floating_point():
            raise ValueError(f"`{name}` must be a floating-point tensor, got {x.dtype}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        _same_device(name, x, q.device)
    if T * HV * max(K, V, 64) >= 2**31:
        raise ValueError(f"`q`: T*HV*max(K, V, 64) = {T * HV * max(K, V, 64)} exceeds the kernels' int32 offsets; "
                         f"split the batch into calls of fewer tokens")
    return KDAShapes(B=B, T=T, H=H, HV=HV, K=K, V=V, N=B)


def check_cu_seqlens(shapes: KDAShapes, cu_seqlens, cu_seqlens_cpu, device: torch.device) -> KDAShapes:
    """Checks ``cu_seqlens`` (``[N + 1]`` ints, 0 .. T, non-decreasing, B == 1); returns shapes with N set."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("`cu_seqlens_cpu` was given without `cu_seqlens`")
        return shapes
    cu_seqlens = _tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"`cu_seqlens` must be a 1-D [N + 1] tensor, got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"`cu_seqlens` must be int32 or int64, got {cu_seqlens.dtype}")
    _same_device("cu_seqlens", cu_seqlens, device)
    if shapes.B != 1:
        raise ValueError(f"`cu_seqlens` needs batch size 1 (flattened sequences), got B={shapes.B}")
    host = None
    capturing = cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()
    if cu_seqlens_cpu is not None:
        cu_seqlens_cpu = _tensor("cu_seqlens_cpu", cu_seqlens_cpu)
        if cu_seqlens_cpu.dtype not in (torch.int32, torch.int64) or cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"`cu_seqlens_cpu` must be a CPU copy of `cu_seqlens` (int32/int64), got "
                             f"{cu_seqlens_cpu.dtype} on {cu_seqlens_cpu.device}")
        host = cu_seqlens_cpu
        if not capturing:
            # one device read per `cu_seqlens` tensor object (per object and CPU values for an inference tensor):
            # a loop that reuses it never waits again
            device_values = host_cu_seqlens(cu_seqlens, witness=cu_seqlens_cpu)
            if cu_seqlens_cpu.shape != device_values.shape or not torch.equal(cu_seqlens_cpu.long(), device_values):
                raise ValueError(f"`cu_seqlens_cpu` {_head(cu_seqlens_cpu)} must equal `cu_seqlens` "
                                 f"{_head(device_values)}")
    elif not capturing:
        host = host_cu_seqlens(cu_seqlens)  # read once per tensor object: repeated calls do not wait
    if host is not None:
        vals = host.tolist()
        if vals[0] != 0 or vals[-1] != shapes.T or any(b < a for a, b in zip(vals, vals[1:])):
            raise ValueError(f"`cu_seqlens` must rise from 0 to T={shapes.T} without decreasing, got {vals[:8]}"
                             f"{' ...' if len(vals) > 8 else ''}")
    return KDAShapes(**{**shapes.__dict__, "N": cu_seqlens.numel() - 1})


def _head(x: torch.Tensor) -> str:
    vals = x.tolist()
    return f"{vals[:8]}{' ...' if len(vals) > 8 else ''}"


def check_kwargs(kwargs: dict, accepted: tuple[str, ...] = FLA_KWARGS) -> None:
    """Raises TypeError naming the first keyword of ``kwargs`` (the ``**kwargs`` of a ``chunk_kda`` call) that fla's
    ``chunk_kda`` does not read either, as Python does for a misspelled keyword."""
    for name in kwargs:
        if name not in accepted:
            raise TypeError(f"chunk_kda() got an unexpected keyword argument {name!r}")


def check_state(name: str, state, shapes: KDAShapes, state_v_first: bool, device: torch.device) -> None:
    """Checks a ``[N, HV, K, V]`` (or V-first ``[N, HV, V, K]``) fp32 state."""
    if state is None:
        return
    state = _tensor(name, state)
    s = shapes
    want = (s.N, s.HV, s.V, s.K) if state_v_first else (s.N, s.HV, s.K, s.V)
    if tuple(state.shape) != want:
        layout = "[N, HV, V, K] (state_v_first)" if state_v_first else "[N, HV, K, V]"
        raise ValueError(f"`{name}` must be {layout}={list(want)}, got {list(state.shape)}")
    if state.dtype != torch.float32:
        raise ValueError(f"`{name}` must be float32, got {state.dtype}")
    _same_device(name, state, device)


def check_gate_params(shapes: KDAShapes, use_gate_in_kernel: bool, A_log, dt_bias, lower_bound, safe_gate: bool,
                      device: torch.device):
    """Checks the in-kernel gate parameters; returns ``(A_log [HV] fp32 or None, dt_bias [HV*K] fp32 or None)``."""
    if lower_bound is not None and not isinstance(lower_bound, (int, float)):
        raise ValueError(f"`lower_bound` must be a float or None, got {type(lower_bound).__name__}")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"`lower_bound` must be negative (the floor of the log-space gate, e.g. -5.0), "
                         f"got {lower_bound}")
    if not use_gate_in_kernel:
        return None, None
    if A_log is None and lower_bound is None:
        raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set")
    if safe_gate:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be set when `safe_gate=True` and `use_gate_in_kernel=True`")
        if not (-5 <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}")
    if A_log is not None:
        A_log = _tensor("A_log", A_log)
        if A_log.numel() != shapes.HV:
            raise ValueError(f"`A_log` must have HV={shapes.HV} elements, got shape {list(A_log.shape)}")
        _same_device("A_log", A_log, device)
        A_log = A_log.reshape(shapes.HV).float().contiguous()
    if dt_bias is not None:
        dt_bias = _tensor("dt_bias", dt_bias)
        if dt_bias.numel() != shapes.HV * shapes.K:
            raise ValueError(f"`dt_bias` must have HV*K={shapes.HV * shapes.K} elements ([HV * K] or [HV, K]), "
                             f"got shape {list(dt_bias.shape)}")
        _same_device("dt_bias", dt_bias, device)
        dt_bias = dt_bias.reshape(-1).float().contiguous()
    return A_log, dt_bias


def check_flags(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> None:
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")


def default_scale(scale, K: int) -> float:
    if scale is None:
        return K**-0.5
    if not isinstance(scale, (int, float)):
        raise ValueError(f"`scale` must be a float or None, got {type(scale).__name__}")
    return float(scale)
