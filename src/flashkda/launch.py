"""Kernel launches that skip Triton's per-launch argument binding once a kernel is compiled for the call's inputs.

``kernel[grid](...)`` binds and specialises every argument on every launch (the alignment of each pointer, the
divisibility of each integer, the layout of each tensor descriptor), builds the kernel-cache key from them, checks
the kernel's global values and then launches: host time that bounds a short ``chunk_kda`` call. `CompiledLaunch`
wraps a ``@triton.jit``/``@gluon.jit`` kernel with the same call syntax and keeps the compiled kernel per key of its
own, computed from what Triton specialises on::

    tensor      (dtype, data_ptr() % 16 == 0)
    int         (== 1, % 16 == 0, fits int32)           bool: its value
    float       the type alone (passed as fp32)         None: None
    descriptor  (base dtype, block shape, layout)       constexpr: its value
    options     (num_warps, maxnreg, ...) by value, plus the current device

Every part Triton's key holds is a function of this key (NVIDIA's specialisation; tested against Triton's own), so
two calls with one key run the same compiled kernel. The first call of a key goes through ``kernel[grid]``
unchanged, the others through the compiled kernel's own launcher (``compiled[grid]``, which calls Triton's launch
hooks as ``kernel[grid]`` does). Not noticed: a kernel's global values or Triton's debug knobs changed after the
first launch of a key (both are fixed for this package's kernels).

`descriptor` makes a Gluon ``TensorDescriptor`` without its per-call validation, for tensors the caller has just
allocated (16-byte aligned, positive shapes, 16-byte strides).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["CompiledLaunch", "descriptor", "launch_key"]

_INT32 = (-(2**31), 2**31)


def _tensor_key(x: torch.Tensor) -> tuple:
    return x.dtype, x.data_ptr() % 16 == 0


def _int_key(x: int) -> tuple:
    return "i", x == 1, x % 16 == 0, _INT32[0] <= x < _INT32[1]


def _arg_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _tensor_key(x)
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, int):
        return _int_key(x)
    if isinstance(x, float):
        return "f"
    block_shape = getattr(x, "block_shape", None)
    if block_shape is not None:  # a host tensor descriptor
        return "d", x.base.dtype, tuple(block_shape), x.layout
    raise TypeError(f"no launch key for an argument of type {type(x).__name__}")


# the common exact types first, without the isinstance chain (subclasses take `_arg_key`)
_KEY_BY_TYPE = {torch.Tensor: _tensor_key, int: _int_key, bool: bool, float: lambda x: "f", type(None): lambda x: None}


def launch_key(values: list, constexpr: tuple[bool, ...], options: dict) -> tuple:
    """The key `CompiledLaunch` keeps a compiled kernel by: ``values`` (every kernel parameter in order),
    ``constexpr`` (which of them are ``constexpr``: their values are part of the key) and the launch ``options``.

    Raises:
        TypeError: an argument of a type the key does not describe (the caller launches through Triton).
    """
    get = _KEY_BY_TYPE.get
    args = [v if c else get(type(v), _arg_key)(v) for v, c in zip(values, constexpr)]
    return tuple(args), tuple(sorted(options.items()))


def _is_jit_function(kernel) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(kernel, JITFunction)


def _current_device() -> int:
    return torch.cuda.current_device()


class CompiledLaunch:
    """``kernel[grid](*args, **kwargs)`` with the compiled kernel kept per `launch_key` (module docstring).

    Args:
        kernel: a ``triton.jit`` or ``gluon.jit`` function. Anything else (an interpreted kernel under
            ``TRITON_INTERPRET=1``, which has no compiled form; an autotuner or heuristics wrapper, whose choice
            depends on argument values the key does not hold) is called as is on every launch.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        params = list(inspect.signature(kernel.fn).parameters.values())
        self._names = [p.name for p in params]
        self._index = {name: i for i, name in enumerate(self._names)}
        self._defaults = [p.default for p in params]
        self._constexpr = tuple(p.is_constexpr for p in kernel.params) if _is_jit_function(kernel) else None
        self._compiled: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _bind(self, args: tuple, kwargs: dict) -> tuple[list, dict]:
        values = list(args) + self._defaults[len(args):]
        options = {}
        for name, value in kwargs.items():
            at = self._index.get(name)
            if at is None:
                options[name] = value
            else:
                values[at] = value
        if any(v is inspect.Parameter.empty for v in values):
            missing = [n for n, v in zip(self._names, values) if v is inspect.Parameter.empty]
            raise TypeError(f"{self.kernel.fn.__name__}: missing arguments {missing}")
        return values, options

    def _launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict):
        if self._constexpr is None:
            return self.kernel[grid](*args, **kwargs)
        values, options = self._bind(args, kwargs)
        try:
            key = (_current_device(), launch_key(values, self._constexpr, options))
        except TypeError:
            key = None
        compiled = None if key is None else self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None:
                self._compiled[key] = compiled
            return compiled
        compiled[(*grid, 1, 1)[:3]](*values)  # the compiled kernel's launcher reads three grid sizes
        return compiled


def descriptor(base: torch.Tensor, shape: list[int], strides: list[int], block_shape: list[int], layout):
    """A Gluon host ``TensorDescriptor`` of ``base`` (a tensor this package allocated: 16-byte aligned, positive
    shape, 16-byte strides but the last, which is 1), made without the constructor's per-call checks."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block_shape, layout=layout,
                         padding="zero")
    return desc
