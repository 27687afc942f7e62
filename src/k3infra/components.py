"""Which parts of K3 Infra are importable on this machine, and why not when they are not."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Component:
    """One library of the distribution and what it needs."""

    name: str
    """Short name used on the command line (`k3infra bench <name>`)."""
    package: str
    """Import package."""
    needs: tuple[str, ...]
    """Third-party import packages the library cannot work without."""


COMPONENTS: tuple[Component, ...] = (
    Component("kda", "flashkda", ("torch", "triton")),
    Component("ep", "moonep", ("torch",)),
    Component("env", "agentenv", ()),
    Component("train", "k3infra.train", ("torch", "tokenizers", "transformers")),
)


def missing_dependencies(component: Component) -> list[str]:
    """Names of the component's third-party dependencies that are not installed."""
    return [name for name in component.needs if importlib.util.find_spec(name) is None]


def probe(component: Component) -> tuple[bool, str]:
    """Try to import a component.

    Returns:
        `(usable, detail)`: detail is the version on success, else the reason it is unusable.
    """
    missing = missing_dependencies(component)
    if missing:
        return False, f"missing {', '.join(missing)} (pip install 'k3-infra[{component.name}]')"
    try:
        module = importlib.import_module(component.package)
    except Exception as error:  # an import failure of any kind makes the component unusable
        return False, f"import failed: {type(error).__name__}: {error}"
    return True, getattr(module, "__version__", "unknown")


def by_name(name: str) -> Component:
    """Look a component up by its command-line name; ValueError lists the valid names."""
    for component in COMPONENTS:
        if component.name == name:
            return component
    valid = ", ".join(c.name for c in COMPONENTS)
    raise ValueError(f"unknown component {name!r}; expected one of: {valid}")
