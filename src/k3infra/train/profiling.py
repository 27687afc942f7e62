"""`StepProfiler`: ``torch.profiler`` over chosen training steps (``k3infra train --profile START:COUNT``).

Steps ``START .. START + COUNT - 1`` (1-based optimizer steps, each with all its micro-batches) are recorded, the
step before them as the profiler's warm-up when there is one. Each rank writes to ``<out>/profile/``:

- ``trace-rank<r>.json.gz``: a gzipped Chrome trace (https://ui.perfetto.dev or ``chrome://tracing`` open it);
- ``ops-rank<r>.txt``: the operators and kernels by total time (device time on a GPU, CPU time otherwise);
- ``ops-by-shape-rank<r>.txt``: the operators split by their input shapes, by the same time: which copy, add or
  gather of which tensor (a weight's cast, an activation's gradient) the time goes to.

The last recorded step's history entry gets ``profile_kernels_per_step`` (GPU kernels launched per step; on the
CPU, ``aten::`` operator calls per step, nested calls included) and ``profile_trace`` (the trace's path): the count
of launches per step is what a host-bound step is bound by.
"""

from __future__ import annotations

import gzip
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from k3infra.train.callbacks import TrainerCallback

__all__ = ["StepProfiler", "parse_profile_steps"]

logger = logging.getLogger(__name__)


def parse_profile_steps(spec: str) -> tuple[int, int]:
    """``"START:COUNT"`` (or ``"START"``: one step) -> ``(START, COUNT)``; raises ValueError naming ``--profile``."""
    start, _, count = str(spec).partition(":")
    try:
        steps = (int(start), int(count) if count else 1)
    except ValueError:
        raise ValueError(f"--profile must be START:COUNT (1-based optimizer steps, e.g. 3:2), got {spec!r}") from None
    if steps[0] < 1 or steps[1] < 1:
        raise ValueError(f"--profile START and COUNT must be >= 1, got {spec!r}")
    return steps


class StepProfiler(TrainerCallback):
    """Records steps ``start .. start + count - 1`` (1-based) with ``torch.profiler``; see the module docstring.

    Args:
        start, count: the first recorded step (1-based) and how many.
    """

    def __init__(self, start: int, count: int) -> None:
        if start < 1 or count < 1:
            raise ValueError(f"start and count must be >= 1, got start={start}, count={count}")
        self.start, self.count = start, count
        self.profiler: torch.profiler.profile | None = None
        self.trace: Path | None = None
        self.per_step: float | None = None
        self._rank = 0
        self._folder: Path | None = None
        self._device = "cpu"

    def setup(self, trainer: Any) -> None:
        self._rank = trainer.state.rank
        self._folder = Path(trainer.cfg.out) / "profile"
        self._device = trainer.state.device.type

    def on_fit_begin(self, trainer: Any, first_step: int) -> None:
        """Start the profiler before step ``first_step`` (0-based: where a resumed run continues)."""
        wait = self.start - 1 - first_step  # steps before the recorded ones
        if wait < 0 or self.start + self.count - 1 > trainer.cfg.steps:
            logger.warning("--profile %d:%d is outside steps %d-%d of this run: nothing recorded", self.start,
                           self.count, first_step + 1, trainer.cfg.steps)
            return
        warmup = 1 if wait > 0 else 0
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities, record_shapes=True,
            schedule=torch.profiler.schedule(wait=wait - warmup, warmup=warmup, active=self.count, repeat=1),
            on_trace_ready=self._write)
        self.profiler.start()

    def on_step_end(self, trainer: Any, step: int, entry: dict) -> None:
        if self.profiler is None:
            return
        self.profiler.step()
        if step + 1 == self.start + self.count - 1:
            self.profiler.stop()
            self.profiler = None
            entry["profile_kernels_per_step"] = self.per_step
            entry["profile_trace"] = str(self.trace)
            if trainer.state.is_main:
                logger.info("profile of steps %d-%d: %.0f %s per step; trace %s", self.start,
                            self.start + self.count - 1, self.per_step,
                            "GPU kernels" if self._device == "cuda" else "aten operators", self.trace)

    def on_fit_end(self, trainer: Any) -> None:
        if self.profiler is not None:  # the loop ended (or raised) inside the recorded steps
            self.profiler.stop()
            self.profiler = None

    def _write(self, prof: torch.profiler.profile) -> None:
        self._folder.mkdir(parents=True, exist_ok=True)
        raw = self._folder / f"trace-rank{self._rank}.json"
        prof.export_chrome_trace(str(raw))
        self.trace = raw.with_suffix(".json.gz")
        with raw.open("rb") as src, gzip.open(self.trace, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        events = prof.key_averages()
        if self._device == "cuda":
            launched = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
            sort_by = "self_cuda_time_total"
        else:
            launched = sum(e.count for e in events if e.key.startswith("aten::"))
            sort_by = "self_cpu_time_total"
        self.per_step = launched / self.count
        (self._folder / f"ops-rank{self._rank}.txt").write_text(events.table(sort_by=sort_by, row_limit=60))
        by_shape = prof.key_averages(group_by_input_shape=True)
        (self._folder / f"ops-by-shape-rank{self._rank}.txt").write_text(
            by_shape.table(sort_by=sort_by, row_limit=80, max_shapes_column_width=120))
