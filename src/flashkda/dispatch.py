"""Which backend serves a ``fla.ops.kda.chunk_kda`` call: FlashKDA only where it was measured faster.

FlashKDA registers itself ahead of fla's own Triton path and of MoonshotAI's CUTLASS backend, so it must never
make a call slower. Each call is reduced to a `ShapeClass` (mode, heads, head sizes, token bucket, varlen, dtype)
and looked up in the calibration table of the GPU: a JSON data file shipped in ``flashkda/calibration/``, the
device's own ``<arch>-<device>.json`` (``sm_90-nvidia-h100-80gb-hbm3.json``) where one was measured, else the
architecture's ``<arch>.json`` (``sm_90.json`` for Hopper), written by ``k3infra bench kda --calibrate``.
FlashKDA serves the call only when every calibrated row of that class measured it at least `MIN_SPEEDUP` times
faster than each other backend that would accept the call (fla's Triton path always; the CUTLASS FlashKDA when it
is installed and its verifier accepts). A class that was not calibrated, an architecture without a table, or a
competitor the table did not time: the call is declined with the reason, and fla serves it.

Environment (read on every call):

| variable | values (default first) | meaning |
|---|---|---|
| ``FLASHKDA_DISPATCH`` | auto, always, never | auto: the calibrated policy; always: serve every call we can; never: off |
| ``FLASHKDA_DISABLE`` | 0, 1 | 1 is an alias of ``FLASHKDA_DISPATCH=never`` |
| ``FLASHKDA_CALIBRATION`` | unset, a path | a calibration table that replaces the shipped one for its architecture |
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path

import torch

from flashkda.env import env_choice, env_flag

__all__ = [
    "CalibrationTable",
    "Decision",
    "DispatchPolicy",
    "Measurement",
    "ShapeClass",
    "device_arch",
    "device_name",
    "device_slug",
    "dispatch_mode",
    "table_stem",
    "token_bucket",
]

logger = logging.getLogger(__name__)

DISPATCH_ENV = "FLASHKDA_DISPATCH"
DISABLE_ENV = "FLASHKDA_DISABLE"
CALIBRATION_ENV = "FLASHKDA_CALIBRATION"
MODES = ("auto", "always", "never")

#: Serve only when at least this much faster than every competitor in every calibrated row of the class: a
#: smaller measured gain is within the run-to-run spread of one device call.
MIN_SPEEDUP = 1.03

#: Upper edges of the token buckets (total tokens of the call, ``B * T``); a class covers (previous edge, edge].
TOKEN_EDGES = (2048, 8192, 32768, 131072, 524288)

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def token_bucket(tokens: int) -> int:
    """The smallest edge of `TOKEN_EDGES` at or above ``tokens`` (``-1`` above the last edge: never calibrated)."""
    for edge in TOKEN_EDGES:
        if tokens <= edge:
            return edge
    return -1


@dataclass(frozen=True)
class ShapeClass:
    """What the calibration keys on: calls of one class are expected to rank the backends alike."""

    mode: str
    """``"inference"`` (no autograd) or ``"training"`` (some input requires grad)."""
    H: int
    HV: int
    K: int
    V: int
    tokens: int
    """Token bucket (`token_bucket` of ``B * T``)."""
    varlen: bool
    dtype: str
    """``"bf16"``, ``"fp16"`` or ``"fp32"`` (of q)."""

    @classmethod
    def of_call(cls, q: torch.Tensor, v: torch.Tensor, cu_seqlens, training: bool) -> ShapeClass:
        """The class of a ``chunk_kda`` call from ``q [B, T, H, K]``, ``v [B, T, HV, V]`` and ``cu_seqlens``."""
        B, T, H, K = q.shape
        return cls("training" if training else "inference", H, v.shape[2], K, v.shape[3],
                   token_bucket(B * T), cu_seqlens is not None, _DTYPES.get(q.dtype, str(q.dtype)))

    def label(self) -> str:
        tokens = f"T<={self.tokens}" if self.tokens > 0 else f"T>{TOKEN_EDGES[-1]}"
        heads = f"H{self.H}" if self.HV == self.H else f"H{self.H}-HV{self.HV}"
        return (f"{self.mode} {heads} K{self.K} V{self.V} {tokens} {'varlen' if self.varlen else 'fixed'} "
                f"{self.dtype}")


@dataclass(frozen=True)
class Measurement:
    """One calibrated row: our median time and each baseline's, measured in the same run."""

    row: str
    shape: ShapeClass
    ours_ms: float
    baselines_ms: dict[str, float]
    """Backend name (``"fla"``, ``"flash_kda"``, ...) to its median ms."""

    def speedup(self, backend: str) -> float | None:
        """``baseline_ms / ours_ms`` against ``backend``, or None when it was not timed."""
        base = self.baselines_ms.get(backend)
        return None if base is None else base / self.ours_ms


@dataclass(frozen=True)
class CalibrationTable:
    """The measured rows of one GPU architecture, with where and when they were measured."""

    arch: str
    device: str
    measured: str
    """ISO date-time of the run."""
    commit: str
    rows: tuple[Measurement, ...]
    versions: dict[str, str] = field(default_factory=dict)

    def lookup(self, shape: ShapeClass) -> list[Measurement]:
        return [m for m in self.rows if m.shape == shape]

    def to_json(self) -> dict:
        data = asdict(self)
        data["rows"] = [asdict(m) for m in self.rows]
        return data

    @classmethod
    def from_json(cls, data: dict, source: str = "<dict>") -> CalibrationTable:
        """Parse a table written by `to_json`.

        Raises:
            ValueError: a missing or malformed field (names the source and the field).
        """
        try:
            rows = tuple(
                Measurement(r["row"], ShapeClass(**r["shape"]), float(r["ours_ms"]),
                            {k: float(v) for k, v in r["baselines_ms"].items()})
                for r in data["rows"]
            )
            for m in rows:
                if not (m.ours_ms > 0 and all(v > 0 for v in m.baselines_ms.values())):
                    raise ValueError(f"calibration table {source}: row {m.row!r} has a non-positive time")
            return cls(str(data["arch"]), str(data["device"]), str(data["measured"]), str(data["commit"]), rows,
                       dict(data.get("versions", {})))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"calibration table {source}: missing or malformed field {e}") from e

    @classmethod
    def load(cls, path: str | Path) -> CalibrationTable:
        """Read a table from a JSON file (ValueError naming the file when it is not one)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"calibration table {path}: cannot read it as JSON ({e})") from e
        return cls.from_json(data, str(path))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")


@dataclass(frozen=True)
class Decision:
    """Whether FlashKDA serves a call, and why."""

    serve: bool
    reason: str
    shape: ShapeClass | None = None
    speedup: float | None = None
    """The smallest measured speed-up over the competitors (when the table had the class)."""
    against: str | None = None
    """The competitor behind `speedup`."""


def dispatch_mode() -> str:
    """``FLASHKDA_DISPATCH`` with ``FLASHKDA_DISABLE=1`` as an alias of ``never``.

    Read on every fla dispatch, so the parse is memoised on the raw values.

    Raises:
        ValueError: a value outside the accepted ones, or ``FLASHKDA_DISABLE=1`` with ``FLASHKDA_DISPATCH=always``
            (the message names both variables).
    """
    return _parse_mode(os.environ.get(DISPATCH_ENV), os.environ.get(DISABLE_ENV))


@lru_cache(maxsize=16)
def _parse_mode(dispatch: str | None, disable: str | None) -> str:
    del dispatch, disable  # the cache key; env_choice and env_flag read the same variables
    mode = env_choice(DISPATCH_ENV, "auto", MODES)
    if env_flag(DISABLE_ENV, False):
        if mode == "always":
            raise ValueError(f"{DISABLE_ENV}=1 and {DISPATCH_ENV}=always contradict each other: unset one "
                             f"({DISABLE_ENV}=1 means {DISPATCH_ENV}=never)")
        return "never"
    return mode


def device_arch(device: torch.device) -> str:
    """``"sm_90"`` for a Hopper CUDA device; ``"interpreter"`` for CPU tensors under ``TRITON_INTERPRET=1``."""
    if device.type == "cuda":
        return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
    return "interpreter" if device.type == "cpu" else device.type


@cache
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def device_name(device: torch.device) -> str | None:
    """The CUDA device's name (``"NVIDIA H100 80GB HBM3"``), or None for other devices."""
    if device.type != "cuda":
        return None
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_slug(name: str) -> str:
    """A device name as it appears in a table's file name: ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    slug = "".join(c if c.isalnum() else "-" for c in name.lower())
    return "-".join(part for part in slug.split("-") if part)


def table_stem(arch: str, device: str | None = None) -> str:
    """The file name (without ``.json``) of the table of ``arch``, or of one ``device`` of it."""
    return f"{arch}-{device_slug(device)}" if device else arch


@cache
def shipped_table(arch: str, device: str | None = None) -> CalibrationTable | None:
    """The table shipped for ``device`` (``flashkda/calibration/<arch>-<device slug>.json``), else for ``arch``
    (``<arch>.json``), or None (read once per process)."""
    folder = resources.files("flashkda") / "calibration"
    for stem in ([table_stem(arch, device)] if device else []) + [arch]:
        resource = folder / f"{stem}.json"
        if resource.is_file():
            return CalibrationTable.load(str(resource))
    return None


@lru_cache(maxsize=8)
def _load_override(path: str, mtime_ns: int) -> CalibrationTable:
    return CalibrationTable.load(path)


def override_table() -> CalibrationTable | None:
    """The table named by ``FLASHKDA_CALIBRATION``, or None (ValueError naming the variable if unreadable)."""
    path = os.environ.get(CALIBRATION_ENV, "").strip()
    if not path:
        return None
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as e:
        raise ValueError(f"environment variable {CALIBRATION_ENV}={path!r}: {e.strerror}") from e
    return _load_override(path, mtime)


class DispatchPolicy:
    """Decides per call whether FlashKDA serves it (see the module docstring).

    Args:
        tables: calibration tables by `table_stem` (``"sm_90"`` or ``"sm_90-nvidia-h200"``; a device's own table
            wins over its architecture's); None reads ``FLASHKDA_CALIBRATION`` (if set) and the shipped tables on
            each decision.
        min_speedup: the margin over every competitor that a calibrated class must show.
    """

    def __init__(self, tables: dict[str, CalibrationTable] | None = None, min_speedup: float = MIN_SPEEDUP) -> None:
        if not (isinstance(min_speedup, (int, float)) and math.isfinite(min_speedup) and min_speedup > 0):
            raise ValueError(f"min_speedup must be a positive finite number, got {min_speedup!r}")
        self.tables = tables
        self.min_speedup = float(min_speedup)

    def table(self, arch: str, device: str | None = None) -> CalibrationTable | None:
        """The table that decides calls on ``device`` (a `device_name`) of architecture ``arch``."""
        if self.tables is not None:
            own = self.tables.get(table_stem(arch, device)) if device else None
            return own or self.tables.get(arch)
        override = override_table()
        if override is not None and override.arch == arch:
            return override
        return shipped_table(arch, device)

    def decide(self, shape: ShapeClass, arch: str, competitors: tuple[str, ...] = ("fla",),
               mode: str | None = None, device: str | None = None) -> Decision:
        """Whether FlashKDA serves a call of class ``shape`` on ``arch`` against ``competitors``.

        Args:
            shape: the call's class.
            arch: `device_arch` of the call's device.
            device: `device_name` of the call's device (its own table, when one is shipped, wins over the
                architecture's).
            competitors: the other backends that would serve the call (``"fla"`` plus registered backends whose
                verifier accepts it).
            mode: ``"auto"``, ``"always"`` or ``"never"``; None reads the environment (`dispatch_mode`).
        """
        mode = dispatch_mode() if mode is None else mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "never":
            return Decision(False, f"{DISPATCH_ENV}=never", shape)
        if mode == "always":
            return Decision(True, f"{DISPATCH_ENV}=always", shape)
        table = self.table(arch, device)
        if table is None:
            return Decision(False, f"no calibration table for {arch} (run `k3infra bench kda --calibrate` there, "
                                   f"or set {DISPATCH_ENV}=always)", shape)
        rows = table.lookup(shape)
        if not rows:
            return Decision(False, f"{shape.label()} was not calibrated on {table.device}", shape)
        worst, against, where = math.inf, None, None
        for m in rows:
            for name in competitors:
                s = m.speedup(name)
                if s is None:
                    return Decision(False, f"{shape.label()}: {name} was not timed in the calibration "
                                           f"(row {m.row} on {table.device})", shape)
                if s < worst:
                    worst, against, where = s, name, m.row
        what = f"{worst:.2f}x {against} at {where} on {table.device} ({table.measured[:10]})"
        if worst < self.min_speedup:
            return Decision(False, f"measured {what}, below {self.min_speedup:.2f}x", shape, worst, against)
        return Decision(True, f"measured {what}", shape, worst, against)


#: The shapes `dispatch_report` lists: K3-style heads (H12 ... H96), K = V = 128, bf16, B = 1.
REPORT_HEADS = (12, 32, 64, 96)
REPORT_TOKENS = (2048, 8192, 32768, 131072)


@dataclass(frozen=True)
class ReportRow:
    shape: ShapeClass
    backend: str
    """``"flashkda"`` or the competitor that serves instead (``"fla"``, ``"flash_kda"``)."""
    decision: Decision


def _cutlass_usable() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_kda") is not None and os.environ.get("FLA_FLASH_KDA", "1") != "0"


def _target(arch: str | None, device: str | None) -> tuple[str, str | None]:
    """``(arch, device)`` as given, or when ``arch`` is None this machine's GPU architecture and (unless ``device``
    is given) name, else ``("sm_90", device)`` (the architecture's shipped table)."""
    if arch is not None:
        return arch, device
    if torch.cuda.is_available():
        return device_arch(torch.device("cuda")), device or device_name(torch.device("cuda"))
    return "sm_90", device


def report_rows(arch: str | None = None, policy: DispatchPolicy | None = None,
                device: str | None = None) -> list[ReportRow]:
    """Who serves ``fla.ops.kda.chunk_kda`` for the common shapes on ``arch`` and ``device`` (default: this
    machine's GPU, else ``sm_90``'s own table), with the CUTLASS FlashKDA counted as a competitor where it is
    installed and takes the call (inference, bf16, K = V = 128, no GVA)."""
    arch, device = _target(arch, device)
    policy = policy or DispatchPolicy()
    cutlass = _cutlass_usable()
    rows = []
    for mode in ("inference", "training"):
        for H in REPORT_HEADS:
            for tokens, varlen in [(t, False) for t in REPORT_TOKENS] + [(8192, True)]:
                shape = ShapeClass(mode, H, H, 128, 128, token_bucket(tokens), varlen, "bf16")
                competitors = ("fla", "flash_kda") if cutlass and mode == "inference" else ("fla",)
                decision = policy.decide(shape, arch, competitors, device=device)
                if decision.serve:
                    backend = "flashkda"
                else:
                    backend = "flash_kda" if "flash_kda" in competitors else "fla"
                rows.append(ReportRow(shape, backend, decision))
    return rows


def dispatch_report(arch: str | None = None, policy: DispatchPolicy | None = None, device: str | None = None) -> str:
    """A text table of `report_rows` (same arguments): for each common shape, the backend that serves it and why.

    Example::

        >>> import flashkda
        >>> print(flashkda.dispatch_report("sm_90", device="NVIDIA H200"))  # doctest: +SKIP
    """
    arch, device = _target(arch, device)
    policy = policy or DispatchPolicy()
    rows = report_rows(arch, policy, device)
    mode = dispatch_mode()
    where = f"{arch}, {device}" if device else arch
    table = policy.table(arch, device)
    source = (f"calibration measured on {table.device} at commit {table.commit[:10]} ({table.measured[:10]}), "
              f"{len(table.rows)} rows" if table is not None else "no calibration table")
    lines = [f"fla.ops.kda.chunk_kda dispatch on {where} ({DISPATCH_ENV}={mode}); {source}",
             f"{'shape':<48} {'served by':<10} reason"]
    lines += [f"{r.shape.label():<48} {r.backend:<10} {r.decision.reason}" for r in rows]
    return "\n".join(lines)
