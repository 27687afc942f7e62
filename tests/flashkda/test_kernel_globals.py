"""Every Triton kernel and device function of flashkda reads only globals a GPU compile accepts: jit functions,
modules, ``tl.constexpr`` values. The interpreter accepts a plain ``int`` global; Triton's compiler refuses it
("Cannot access global variable ... from within @jit'ed function"), so only a device run would show it."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest
import triton.language as tl

import flashkda

#: ``@triton.jit`` gives a JITFunction, or an InterpretedFunction under TRITON_INTERPRET=1 (as these tests run).
JIT_TYPES = ("JITFunction", "InterpretedFunction")


def _jit_functions():
    for info in pkgutil.walk_packages(flashkda.__path__, "flashkda."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            fn = value if type(value).__name__ in JIT_TYPES else getattr(value, "fn", None)  # autotuners wrap one
            if type(fn).__name__ in JIT_TYPES and fn.fn.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", fn


def _plain_globals(fn) -> list[str]:
    code, scope = fn.fn.__code__, fn.fn.__globals__
    names = set(code.co_names)
    for const in code.co_consts:  # nested code objects (comprehensions, lambdas)
        if isinstance(const, types.CodeType):
            names |= set(const.co_names)
    bad = []
    for name in sorted(names):
        if name not in scope:
            continue
        value = scope[name]
        if isinstance(value, (bool, int, float, str)) and not isinstance(value, tl.constexpr):
            bad.append(f"{name}={value!r}")
    return bad


JIT = dict(_jit_functions())


def test_kernels_were_found():
    assert len(JIT) > 20 and any("intra" in n for n in JIT) and any("bwd" in n for n in JIT)


@pytest.mark.parametrize("name", sorted(JIT))
def test_kernel_reads_only_constexpr_globals(name):
    assert _plain_globals(JIT[name]) == [], f"{name} reads non-constexpr globals; wrap them in tl.constexpr"
