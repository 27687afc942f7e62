"""Progress bars for long benchmark loops (rich, on stderr), off under ``K3INFRA_QUIET=1`` (``k3infra bench
--quiet``/``--json``) or when stderr is not a terminal, so logs and JSON on stdout stay clean."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def enabled() -> bool:
    """True when progress should be drawn: not quiet, and stderr is a terminal."""
    return os.environ.get("K3INFRA_QUIET", "") not in ("1", "true", "yes") and sys.stderr.isatty()


def track(items: Iterable[T], description: str, *, total: int | None = None) -> Iterator[T]:
    """Yield `items`, drawing a bar with elapsed and remaining time while they are consumed.

    Args:
        items: what the loop runs over.
        description: the bar's label, e.g. ``"calibrate sm_90"``.
        total: number of items when `items` has no ``len`` (the bar is then a spinner if None).
    """
    if not enabled():
        yield from items
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    # No refresh thread: the bar redraws between items only, so nothing competes with a timed region for the GIL.
    with Progress(*columns, console=Console(stderr=True), transient=True, auto_refresh=False) as progress:
        task = progress.add_task(description, total=total)
        progress.refresh()
        for item in items:
            yield item
            progress.advance(task)
            progress.refresh()
