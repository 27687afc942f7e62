"""`TrainerCallback`: the hook through which components join the pre-training loop without editing it.

The `k3infra.train.Trainer` calls, on every rank and in this order:

1. ``setup(trainer)`` once, after the model, its parallelism and the optimizers are built and before a
   ``--resume`` checkpoint is loaded;
2. ``load_state_dict(state)`` when resuming, with what ``state_dict()`` returned when the checkpoint was written;
3. ``on_fit_begin(trainer, first_step)`` once, right before the first step of the loop (``first_step`` 0-based:
   where a resumed run continues);
4. ``on_step_end(trainer, step, entry)`` after each optimizer step (``step`` 0-based; ``entry`` is the step's
   history dict, which the callback may extend with JSON-serialisable fields);
5. ``on_fit_end(trainer)`` once, after the last step (also when the loop raised), before the group is closed.

Collectives are allowed in every hook: all ranks call them at the same point.
"""

from __future__ import annotations

from typing import Any


class TrainerCallback:
    """Base class: every hook does nothing; override the ones needed."""

    @property
    def name(self) -> str:
        """Key of this callback's state in the checkpoint's ``trainer.json``."""
        return type(self).__name__

    def setup(self, trainer: Any) -> None:
        """Attach to ``trainer`` (its ``model``, ``optimizers``, ``state``, ``cfg`` are built)."""

    def on_fit_begin(self, trainer: Any, first_step: int) -> None:
        """Before the loop's first step, ``first_step`` (0-based)."""

    def on_step_end(self, trainer: Any, step: int, entry: dict) -> None:
        """After the optimizer step of ``step``; may add fields to ``entry`` (the history entry)."""

    def on_fit_end(self, trainer: Any) -> None:
        """After the loop, before the process group is closed."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state stored with each checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (called on resume, after `setup`)."""
