"""FlashKDA's environment switches, parsed in one place.

Every ``FLASHKDA_*`` switch is a flag or a choice. A value outside the accepted set is an error that names the
variable and the values it takes, never a silent fallback (``=false`` must not mean "on").

| variable | values (default first) | read |
|---|---|---|
| ``FLASHKDA_DISABLE`` | 0, 1 | each fla dispatch |
"""

from __future__ import annotations

import os

__all__ = ["env_choice", "env_flag"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _value(name: str) -> tuple[str | None, str]:
    """``(raw, normalised)`` of ``name``: raw None when unset or blank, normalised stripped and lower-case."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None, ""
    return raw, raw.strip().lower()


def env_flag(name: str, default: bool) -> bool:
    """The boolean switch ``name``: unset or empty gives ``default``; 1/true/yes/on and 0/false/no/off (any case).

    Raises:
        ValueError: any other value, naming the variable and the accepted values.
    """
    raw, value = _value(name)
    if raw is None:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r}: expected 1 or 0 (also true/false, yes/no, on/off), "
                     f"or unset for the default ({int(default)})")


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The switch ``name`` as one of ``choices`` (case-insensitive); unset or empty gives ``default``.

    Raises:
        ValueError: any other value, naming the variable and the choices.
    """
    raw, value = _value(name)
    if raw is None:
        return default
    if value not in choices:
        raise ValueError(f"environment variable {name}={raw!r}: expected one of {', '.join(choices)}, "
                         f"or unset for the default ({default})")
    return value
