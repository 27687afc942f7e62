"""`flashkda.launch`: the compiled-kernel key against Triton's own specialisation, and the launch bookkeeping (CPU)."""

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

from flashkda import launch  # noqa: E402
from flashkda.launch import CompiledLaunch, descriptor, launch_key  # noqa: E402


def _triton_spec(x):
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    return native_specialize_impl(BaseBackend, x, False, True, True)


def _arguments():
    buf = torch.empty(64, dtype=torch.bfloat16)
    f32 = torch.empty(64, dtype=torch.float32)
    args = [buf, buf[1:], buf[8:], buf[9:], f32, f32[4:], f32[1:], 1, 0, 2, 16, 17, 32, -16, -1, 2**31 - 16,
            2**31, 2**40 + 1, 0.5, 1.0, True, False, None]
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:
        return args
    x = torch.empty(64, 128, dtype=torch.bfloat16)
    wide = gl.NVMMASharedLayout.get_default_for([32, 128], gl.bfloat16)
    narrow = gl.NVMMASharedLayout.get_default_for([16, 128], gl.bfloat16)
    args += [TensorDescriptor(x, [64, 128], [128, 1], [32, 128], wide),
             TensorDescriptor(x, [32, 128], [128, 1], [32, 128], wide),
             TensorDescriptor(x, [64, 128], [128, 1], [16, 128], narrow),
             descriptor(x[32:], [32, 128], [128, 1], [32, 128], wide)]
    return args


def test_equal_keys_mean_equal_triton_specialisations():
    """Two arguments with one key are specialised alike by Triton (the key may be finer, never coarser), and the
    key tells apart what Triton tells apart: alignment, dtype, ints of 1, multiples of 16, int64."""
    args = _arguments()
    for a, b in itertools.combinations(args, 2):
        same_key = launch_key([a], (False,), {}) == launch_key([b], (False,), {})
        if same_key:
            assert _triton_spec(a) == _triton_spec(b), (a, b)
        if _triton_spec(a) != _triton_spec(b):
            assert not same_key, (a, b)


def test_constexpr_values_and_options_are_part_of_the_key():
    assert launch_key([4], (True,), {}) != launch_key([5], (True,), {})
    assert launch_key([4], (False,), {}) == launch_key([5], (False,), {})
    assert launch_key([4], (True,), {"num_warps": 4}) != launch_key([4], (True,), {"num_warps": 8})
    with pytest.raises(TypeError, match="list"):
        launch_key([[1, 2]], (False,), {})


def test_descriptor_matches_the_checked_constructor():
    gluon = pytest.importorskip("triton.experimental.gluon")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    x = torch.empty(64, 128, dtype=torch.bfloat16)
    layout = gluon.language.NVMMASharedLayout.get_default_for([32, 128], gluon.language.bfloat16)
    fast = descriptor(x, [64, 128], [128, 1], [32, 128], layout)
    checked = TensorDescriptor(x, [64, 128], [128, 1], [32, 128], layout)
    assert type(fast) is TensorDescriptor and fast == checked


def _kernel_source(x_ptr, n, scale, BLOCK: triton.language.constexpr, FLAG: triton.language.constexpr = False):
    pass


# the compiled form's JIT function, as ``triton.jit`` makes it outside the interpreter
_kernel = triton.runtime.jit.JITFunction(_kernel_source)


class _Recorder(triton.runtime.jit.JITFunction):
    """A JIT function whose ``kernel[grid](...)`` "compiles" (returns a new compiled kernel object) and records the
    call; ``compiled[grid](...)`` records the launch of an already compiled kernel."""

    def __init__(self, jit):
        super().__init__(jit.fn)
        self.compiles, self.launches = [], []

    def __getitem__(self, grid):
        def compile_and_run(*args, **kwargs):
            self.compiles.append((grid, args, kwargs))
            return _Compiled(self)
        return compile_and_run


class _Compiled:
    def __init__(self, owner):
        self.owner = owner

    def __getitem__(self, grid):
        return lambda *values: self.owner.launches.append((grid, values, self))


def test_launch_compiles_once_per_key_and_passes_every_parameter_in_order(monkeypatch):
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    rec = _Recorder(_kernel)
    fast = CompiledLaunch(rec)
    x = torch.empty(32, dtype=torch.float32)
    first = fast[(4,)](x, 7, 0.5, BLOCK=32, num_warps=4)
    assert len(rec.compiles) == 1 and not rec.launches
    again = fast[(8, 2)](x, 9, 0.25, BLOCK=32, num_warps=4)
    assert again is first and rec.launches == [((8, 2, 1), (x, 9, 0.25, 32, False), first)]
    # each of these differs from the first call in one part of the key: compiled again
    fast[(4,)](x[1:], 7, 0.5, BLOCK=32, num_warps=4)          # pointer alignment
    fast[(4,)](x, 16, 0.5, BLOCK=32, num_warps=4)             # an int divisible by 16
    fast[(4,)](x, 1, 0.5, BLOCK=32, num_warps=4)              # an int of 1
    fast[(4,)](x.double(), 7, 0.5, BLOCK=32, num_warps=4)     # dtype
    fast[(4,)](x, 7, 0.5, BLOCK=64, num_warps=4)              # constexpr
    fast[(4,)](x, 7, 0.5, BLOCK=32, FLAG=True, num_warps=4)   # defaulted constexpr
    fast[(4,)](x, 7, 0.5, BLOCK=32, num_warps=8)              # option
    assert len(rec.compiles) == 8 and len(rec.launches) == 1
    fast[(4,)](x, 7, 0.5, BLOCK=32, FLAG=True, num_warps=4)
    assert len(rec.compiles) == 8 and rec.launches[-1][1] == (x, 7, 0.5, 32, True)


def test_launch_without_a_key_always_goes_through_triton(monkeypatch):
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    rec = _Recorder(_kernel)
    fast = CompiledLaunch(rec)
    for _ in range(2):
        fast[(1,)]([1.0], 7, 0.5, BLOCK=32)
    assert len(rec.compiles) == 2 and not rec.launches
    with pytest.raises(TypeError, match="missing arguments \\['scale', 'BLOCK'\\]"):
        fast[(1,)](torch.empty(4), 7)


@pytest.mark.parametrize("wrap", ["interpreted", "autotuned"])
def test_kernels_other_than_jit_functions_always_go_through_triton(monkeypatch, wrap):
    """An interpreted kernel has no compiled form, an autotuner picks its config by argument values: every call is
    the kernel's own."""
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    calls = []

    class Interpreted(triton.runtime.interpreter.InterpretedFunction):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(args)

    if wrap == "interpreted":
        kernel = Interpreted(_kernel_source)
    else:
        kernel = triton.autotune(configs=[triton.Config({})], key=["n"])(_kernel)
        kernel.run = lambda *args, grid, warmup, **kwargs: calls.append(args) or object()
    fast = CompiledLaunch(kernel)
    for n in (7, 7, 9):
        fast[(1,)](torch.empty(4), n, 0.5, BLOCK=32)
    assert len(calls) == 3


def test_launch_keys_by_device(monkeypatch):
    rec = _Recorder(_kernel)
    fast = CompiledLaunch(rec)
    x = torch.empty(32)
    for device in (0, 1, 0, 1):
        monkeypatch.setattr(launch, "_current_device", lambda device=device: device)
        fast[(1,)](x, 7, 0.5, BLOCK=32)
    assert len(rec.compiles) == 2 and len(rec.launches) == 2
