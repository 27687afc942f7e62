"""The shared benchmark harness: timing, a machine line, and the results writer.

Every benchmark times the baseline and ours in the same process and run, on the same inputs, after a
correctness gate, and records both in one `Row`. `write_results` stores a JSON file under
`benchmarks/results/` (commit, date, device, versions, every row) and refreshes the component's table in
`BENCHMARKS.md`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"


@dataclass(frozen=True)
class Timing:
    """Summary of repeated timings, in milliseconds."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    p99_ms: float
    n: int

    @classmethod
    def from_samples(cls, samples_ms: list[float]) -> Timing:
        if not samples_ms:
            raise ValueError("samples_ms is empty: time at least one repetition")
        ordered = sorted(samples_ms)

        def q(fraction: float) -> float:
            return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]

        return cls(statistics.median(ordered), q(0.2), q(0.8), q(0.99), len(ordered))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def rms_ratio(x, ref) -> float:
    """Relative RMS error ``|x - ref|_2 / |ref|_2`` of two tensors of any shape and dtype, in fp64."""
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def time_fn(
    fn: Callable[[], object],
    *,
    device: str = "cpu",
    warmup: int = 3,
    rep: int = 20,
    min_time_s: float = 0.0,
) -> Timing:
    """Time `fn()` after `warmup` calls.

    On CUDA every repetition is bracketed by CUDA events (no host clock in the measured region); on the CPU
    by `time.perf_counter`. At least `rep` repetitions, more until `min_time_s` of samples are gathered.

    Returns:
        A `Timing` with the median and quantiles in milliseconds.
    """
    if rep < 1 or warmup < 0:
        raise ValueError(f"rep must be >= 1 and warmup >= 0, got rep={rep}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    _sync(device)
    samples: list[float] = []
    start_all = time.perf_counter()
    if device.startswith("cuda"):
        import torch

        while len(samples) < rep or time.perf_counter() - start_all < min_time_s:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end))
    else:
        while len(samples) < rep or time.perf_counter() - start_all < min_time_s:
            begin_s = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin_s) * 1e3)
    return Timing.from_samples(samples)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _commit() -> str:
    """``K3_COMMIT`` when set (benchmarks/device/run.sh sets it from ``.k3_commit``: the device copy's git state is
    not the working tree's), else HEAD's hash, else ``.k3_commit``."""
    if os.environ.get("K3_COMMIT"):
        return os.environ["K3_COMMIT"]
    head = _git("rev-parse", "HEAD")
    if len(head) == 40 and all(c in "0123456789abcdef" for c in head):
        return head
    marker = ROOT / ".k3_commit"
    return marker.read_text().strip() if marker.is_file() else "unknown"


def machine_info() -> dict:
    """Commit, date, host, device and library versions, recorded with every result."""
    info: dict = {
        "commit": _commit(),
        "dirty": False if os.environ.get("K3_COMMIT") else bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": "cpu",
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["device"] = f"{props.name} x{torch.cuda.device_count()}"
            info["cuda"] = torch.version.cuda
    except ImportError:
        info["torch"] = None
    for name in ("triton", "fla"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # absent or broken: recorded as None
            info[name] = None
    return info


def machine_line(info: dict) -> str:
    return (
        f"{info['device']} | torch {info.get('torch')} | triton {info.get('triton')} | "
        f"commit {str(info['commit'])[:10]}{'+dirty' if info.get('dirty') else ''} | {info['date']}"
    )


@dataclass
class Row:
    """One benchmark case: baseline and ours timed in the same run on the same inputs."""

    case: str
    """Readable id of the case, e.g. ``H64-T8192``."""
    baseline: str
    """What the baseline is, e.g. ``fla 0.6.0 chunk_kda``."""
    baseline_ms: float | None
    """Median ms of the baseline, or None when it could not run here (`note` says why)."""
    ours_ms: float
    params: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    """Further measured columns: GB/s, peak memory, p99, fraction of the floor, ..."""
    note: str = ""

    @property
    def speedup(self) -> float | None:
        if self.baseline_ms is None or self.ours_ms <= 0:
            return None
        return self.baseline_ms / self.ours_ms


def _fmt(value: object) -> str:
    if value is None:
        return "not run"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def markdown_table(rows: list[Row]) -> str:
    extra_keys: list[str] = []
    for row in rows:
        extra_keys += [k for k in row.extra if k not in extra_keys]
    headers = ["case", "baseline", "baseline ms", "ours ms", "speedup", *extra_keys, "note"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [row.case, row.baseline, _fmt(row.baseline_ms), _fmt(row.ours_ms)]
        cells.append("not run" if row.speedup is None else f"{row.speedup:.2f}x")
        cells += [_fmt(row.extra.get(k)) for k in extra_keys]
        cells.append(row.note)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(
    component: str,
    rows: list[Row],
    *,
    title: str | None = None,
    results_dir: Path | None = None,
    markdown: Path | None = None,
    info: dict | None = None,
    update_table: bool = False,
) -> Path:
    """Write `results/<component>-<date>.json`; refresh the component's section of BENCHMARKS.md only when asked.

    Args:
        component: benchmark name (``kda``, ``ep``, ``env``, ``smoke``); also the BENCHMARKS.md section key.
        rows: measured rows.
        title: section heading; defaults to the component name.
        results_dir: where the JSON goes (default `benchmarks/results/`).
        markdown: a markdown file to update (tests pass one); with None, BENCHMARKS.md is updated only when
            ``update_table`` is set (a bench's ``--update-table``): committed tables never change by accident.
        update_table: refresh the section of BENCHMARKS.md.

    Returns:
        Path of the JSON file written.
    """
    if not rows:
        raise ValueError("rows is empty: a results file needs at least one measured row")
    info = info or machine_info()
    results_dir = results_dir or RESULTS_DIR
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = info["date"].replace(":", "").replace("-", "")[:15]
    path = results_dir / f"{component}-{stamp}.json"
    payload = {
        "component": component,
        "machine": info,
        "rows": [{**asdict(r), "speedup": r.speedup} for r in rows],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    if update_table or markdown is not None:
        update_markdown(component, rows, info, title=title, markdown=markdown, json_name=path.name)
    return path


def update_markdown(
    component: str,
    rows: list[Row],
    info: dict,
    *,
    title: str | None = None,
    markdown: Path | None = None,
    json_name: str = "",
) -> None:
    markdown = markdown or BENCHMARKS_MD
    begin, end = f"<!-- bench:{component} -->", f"<!-- /bench:{component} -->"
    section = "\n".join(
        [
            begin,
            f"## {title or component}",
            "",
            f"`{machine_line(info)}`  ",
            f"raw: `benchmarks/results/{json_name}`",
            "",
            markdown_table(rows),
            end,
        ]
    )
    text = markdown.read_text() if markdown.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    markdown.write_text(text)
