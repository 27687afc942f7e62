"""The shared benchmark harness: timing, a machine line, and the results writer.

Every benchmark times the baseline and ours in the same process and run, on the same inputs, after a
correctness gate, and records both in one `Row`. `write_results` stores a JSON file under
`benchmarks/results/` (commit, date, device, versions, every row); `BENCHMARKS.md` changes only through
`python -m benchmarks.table` (or a bench's ``--update-table``) from chosen results files.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
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


def parse_ab_args(p: argparse.ArgumentParser, argv: list[str] | None, *, rep: int) -> argparse.Namespace:
    """The command line of an A/B benchmark with a CPU dry run: adds ``--rep`` (timed rounds, each running every
    variant; default ``rep``) and ``--dry-run`` to ``p``, parses ``argv``, logs at INFO, checks ``--rep`` and, for a
    dry run, turns on Triton's interpreter (before triton is first imported)."""
    p.add_argument("--rep", type=int, default=rep, help="timed rounds (each runs both variants)")
    p.add_argument("--dry-run", action="store_true", help="CPU, k3-debug, Triton's interpreter; writes no file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.rep < 1:
        p.error(f"--rep must be >= 1, got {args.rep}")
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return args


def require_cuda(p: argparse.ArgumentParser) -> None:
    """Stop with a usage error where no CUDA device is visible (the timed run; ``--dry-run`` is the CPU's)."""
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA device (use --dry-run on the CPU)")


def time_interleaved(prepare: Callable[[str], Callable[[], object]], names: Sequence[str], *, device: str,
                     rounds: int, warmup_rounds: int) -> dict[str, Timing]:
    """One call of each variant per round, the order reversed every other round, so that drift (clocks, heat, the
    allocator) falls on all variants alike; the first `warmup_rounds` rounds (compilation, autotuning) are not kept.

    `prepare(name)` sets a variant up, untimed (a mode switch, a state reload), and returns the call to time once.

    Returns:
        ``{name: Timing}`` over the kept rounds.
    """
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds + warmup_rounds):
        for name in names if i % 2 == 0 else list(reversed(names)):
            ms = time_fn(prepare(name), device=device, warmup=0, rep=1).median_ms
            if i >= warmup_rounds:
                samples[name].append(ms)
    return {name: Timing.from_samples(ms) for name, ms in samples.items()}


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
    ours_ms: float | None
    params: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    """Further measured columns: GB/s, peak memory, p99, fraction of the floor, ..."""
    note: str = ""

    @property
    def speedup(self) -> float | None:
        if self.baseline_ms is None or self.ours_ms is None or self.ours_ms <= 0:
            return None
        return self.baseline_ms / self.ours_ms


MAX_COLUMNS = 10
"""Widest table BENCHMARKS.md holds; further measured columns stay in the JSON."""


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _shared_extras(rows: list[Row], room: int, first: Sequence[str] = ()) -> list[str]:
    """Scalar extra columns every row has (a column some rows lack would need filler cells), the first `room`,
    the keys named in `first` ahead of the others."""
    scalar = (int, float, str, bool)  # nested dicts and lists stay in the JSON
    keys = [k for k in rows[0].extra if all(isinstance(r.extra.get(k), scalar) for r in rows)]
    keys = [k for k in first if k in keys] + [k for k in keys if k not in first]
    return keys[: max(room, 0)]


def _table(headers: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(_cell(c) for c in cells) + " |" for cells in lines]
    return "\n".join(out)


def markdown_table(rows: list[Row], headline: Sequence[str] = ()) -> str:
    """Markdown for `rows`: at most `MAX_COLUMNS` columns and no filler cells.

    Rows with a baseline make one table (case, baseline, both medians, speed-up, shared extras, note); rows
    measured without a baseline make a second one (case, ours, shared extras, note); rows that measured something
    other than a time (no medians, scalar extras: errors, loss gaps) a third (case, baseline, shared extras, note);
    correctness checks and rows that were not measured at all are named in one sentence each. Extra columns named
    in `headline` come first; columns only some rows have, and those past the width, stay in the JSON.
    """
    parts: list[str] = []
    compared = [r for r in rows if r.baseline_ms is not None and r.ours_ms is not None]
    alone = [r for r in rows if r.baseline_ms is None and r.ours_ms is not None]
    checks = [r for r in rows if r.ours_ms is None and r.note == "correctness only" and "rc" in r.extra]
    measured = [r for r in rows if r.ours_ms is None and r.baseline_ms is None and r not in checks
                and _shared_extras([r], 1)]
    for group, fixed in ((compared, ["case", "baseline", "baseline ms", "ours ms", "speed-up"]),
                         (alone, ["case", "ours ms"]), (measured, ["case", "baseline"])):
        if not group:
            continue
        one_baseline = len({r.baseline for r in group}) == 1
        head = [h for h in fixed if not (h == "baseline" and one_baseline)]
        with_note = any(r.note for r in group)
        extras = _shared_extras(group, MAX_COLUMNS - len(head) - with_note, headline)
        lines = []
        for r in group:
            cells = {"case": r.case, "baseline": r.baseline, "baseline ms": _fmt(r.baseline_ms),
                     "ours ms": _fmt(r.ours_ms), "speed-up": f"{r.speedup:.2f}x" if r.speedup else "-"}
            note = [r.note] if with_note else []
            lines.append([cells[h] for h in head] + [_fmt(r.extra[k]) for k in extras] + note)
        if group is not alone and one_baseline:
            parts.append(f"Baseline: {group[0].baseline}.")
        elif group is alone:
            parts.append("Measured without a baseline in this run (absolute numbers):")
        if group is measured:
            parts.append("Measurements other than times:")
        parts.append(_table(head + extras + (["note"] if with_note else []), lines))
    if checks:
        parts.append("Checks: " + "; ".join(
            f"{r.case}: {'passed' if str(r.extra.get('rc')) == '0' else 'FAILED'} (rc {r.extra.get('rc')})"
            for r in checks) + ".")
    missing = [r.case for r in rows if r.ours_ms is None and r not in checks and r not in measured]
    if missing:
        parts.append(f"Not run: {', '.join(missing)}.")
    return "\n\n".join(parts)


def write_results(
    component: str,
    rows: list[Row],
    *,
    title: str | None = None,
    results_dir: Path | None = None,
    markdown: Path | None = None,
    info: dict | None = None,
) -> Path:
    """Write `results/<component>-<date>.json` (and nothing else unless `markdown` is given).

    Args:
        component: benchmark name (``kda``, ``ep``, ``env``, ``smoke``); also the BENCHMARKS.md section key.
        rows: measured rows.
        title: section heading, stored in the JSON for `benchmarks.table`; defaults to the component name.
        results_dir: where the JSON goes (default ``$K3INFRA_RESULTS_DIR``, set by ``k3infra bench
            --results-dir``, else `benchmarks/results/`).
        markdown: a scratch markdown file to render the table into (tests); BENCHMARKS.md itself changes only
            through `python -m benchmarks.table` (a bench's ``--update-table``) from chosen results files.

    Returns:
        Path of the JSON file written.
    """
    if not rows:
        raise ValueError("rows is empty: a results file needs at least one measured row")
    info = info or machine_info()
    results_dir = results_dir or Path(os.environ.get("K3INFRA_RESULTS_DIR") or RESULTS_DIR)
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = info["date"].replace(":", "").replace("-", "")[:15]
    path = results_dir / f"{component}-{stamp}.json"
    payload = {
        "component": component,
        "title": title or component,
        "machine": info,
        "rows": [{**asdict(r), "speedup": r.speedup} for r in rows],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    if markdown is not None:
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
    headline: Sequence[str] = (),
) -> None:
    """Replace (or append) `component`'s section of `markdown` (default BENCHMARKS.md) with a table of `rows`
    (`markdown_table`, `headline` columns first) under `title`, the machine line of `info` and the results file
    names `json_name`."""
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
            markdown_table(rows, headline),
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
