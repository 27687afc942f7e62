"""The v2 forward K1 kernels' shared-memory tiles against their register layouts: no bank conflicts on any store or
load, by Gluon's own count (``gl.bank_conflicts``), compiled for sm_90 on the CPU (no GPU, no kernel run)."""

import pytest

gl = pytest.importorskip("triton.experimental.gluon.language")
if not hasattr(gl, "bank_conflicts"):
    pytest.skip("this Triton's Gluon has no bank_conflicts", allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from flashkda.fwd.v2 import prepare32_kernel as k32  # noqa: E402
from flashkda.fwd.v2 import prepare_kernel as k16  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


@gluon.jit
def _no_conflicts(name: gl.constexpr, t, s):
    gl.static_assert(gl.bank_conflicts(t.type, s.type) == 0, name)


@gluon.jit
def _chunk32_accesses(TILE: gl.constexpr, TILE3: gl.constexpr):
    """Every shared-memory store and load of ``kda_fwd_v2_prepare32_kernel``, on zero tensors of its layouts."""
    E3: gl.constexpr = k32.E3
    x = gl.zeros([2, k32.HALF, k32.HEAD_DIM], gl.bfloat16, E3)
    # (the kernel stores through slices of one [4, 16, 128] buffer; Gluon counts whole buffers of the same layout)
    _no_conflicts("operands: store of two halves", x,
                  gl.allocate_shared_memory(gl.bfloat16, [2, k32.HALF, k32.HEAD_DIM], k32.SMEM_TOK3))
    _, x_b = gl.split(gl.permute(x, [1, 2, 0]))
    _no_conflicts("operands: store of one half", x_b,
                  gl.allocate_shared_memory(gl.bfloat16, [k32.HALF, k32.HEAD_DIM], k32.SMEM_TOK))
    ops = gl.allocate_shared_memory(gl.bfloat16, [4, k32.HALF, k32.HEAD_DIM], k32.SMEM_TOK3)
    _no_conflicts("left operands: load", gl.zeros([4, k32.HALF, k32.HEAD_DIM], gl.bfloat16, k32.DOT_A3), ops)
    _no_conflicts("right operands: transposed load",
                  gl.zeros([4, k32.HEAD_DIM, k32.HALF], gl.bfloat16, k32.DOT_B3), ops.permute([0, 2, 1]))
    t3 = gl.allocate_shared_memory(gl.float16, [4, k32.HALF, k32.HALF], TILE3)
    _no_conflicts("inverse tiles: store", gl.zeros([4, k32.HALF, k32.HALF], gl.float16, k32.MMA3), t3)
    _no_conflicts("inverse tiles: load a", gl.zeros([4, k32.HALF, k32.HALF], gl.float16, k32.DOT_A3), t3)
    _no_conflicts("inverse tiles: load b", gl.zeros([4, k32.HALF, k32.HALF], gl.float16, k32.DOT_B3), t3)
    f3 = gl.allocate_shared_memory(gl.float32, [4, k32.HALF, k32.HALF], k32.SMEM_F32_3)
    _no_conflicts("fp32 tiles: store", gl.zeros([4, k32.HALF, k32.HALF], gl.float32, k32.MMA3), f3)
    f2 = gl.allocate_shared_memory(gl.float32, [k32.HALF, k32.HALF], k32.SMEM_F32)
    _no_conflicts("fp32 tiles: load", gl.zeros([k32.HALF, k32.HALF], gl.float32, k32.MMA), f2)
    t2 = gl.allocate_shared_memory(gl.float16, [k32.HALF, k32.HALF], TILE)
    _no_conflicts("lower block: store", gl.zeros([k32.HALF, k32.HALF], gl.float16, k32.MMA), t2)
    _no_conflicts("lower block: load a", gl.zeros([k32.HALF, k32.HALF], gl.float16, k32.DOT_A), t2)
    _no_conflicts("lower block: load b", gl.zeros([k32.HALF, k32.HALF], gl.float16, k32.DOT_B), t2)


@gluon.jit
def _chunk16_accesses(K: gl.constexpr, TILE3: gl.constexpr):
    """The conflict-free stores and loads of ``kda_fwd_v2_prepare_batched_kernel`` (its ``[16, K]`` stores from
    `col_layout` are 2-way and not checked)."""
    C: gl.constexpr = k16.CHUNK
    x = gl.zeros([C, K], gl.bfloat16, k16.col_layout(K))
    _no_conflicts("ki^T: store", gl.permute(x, [1, 0]), gl.allocate_shared_memory(gl.bfloat16, [K, C], k16.SMEM_KT))
    kt = gl.allocate_shared_memory(gl.bfloat16, [k16.CB, K, C], k16.SMEM_KT3)
    _no_conflicts("ki^T: load", gl.zeros([k16.CB, K, C], gl.bfloat16, k16.DOT_B3), kt)
    tok = gl.allocate_shared_memory(gl.bfloat16, [k16.CB, C, K], k16.SMEM_TOK3)
    _no_conflicts("kd, qd: load", gl.zeros([k16.CB, C, K], gl.bfloat16, k16.DOT_A3), tok)
    t3 = gl.allocate_shared_memory(gl.float16, [k16.CB, C, C], TILE3)
    _no_conflicts("inverse tiles: store", gl.zeros([k16.CB, C, C], gl.float16, k16.MMA3), t3)
    _no_conflicts("inverse tiles: load a", gl.zeros([k16.CB, C, C], gl.float16, k16.DOT_A3), t3)
    _no_conflicts("inverse tiles: load b", gl.zeros([k16.CB, C, C], gl.float16, k16.DOT_B3), t3)


def _compile(fn, **constexprs):
    src = GluonASTSource(fn, {n: "constexpr" for n in constexprs}, constexprs, {})
    triton.compile(src, target=HOPPER, options=dict(num_warps=int(k32.NUM_WARPS)))


def test_chunk32_k1_shared_memory_has_no_bank_conflicts():
    _compile(_chunk32_accesses, TILE=k32.SMEM_TILE, TILE3=k32.SMEM_TILE3)


@pytest.mark.parametrize("K", [128, 64])
def test_chunk16_k1_shared_memory_has_no_bank_conflicts(K):
    _compile(_chunk16_accesses, K=K, TILE3=k16.SMEM_TILE3)


def test_the_check_finds_the_two_way_conflicts_of_an_unswizzled_phase():
    # a tile swizzle whose 16-byte phase changes every row over two phases: 2-way on the 8x8 matrices of 32-byte
    # rows
    old = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=2, order=[2, 1, 0])
    with pytest.raises(triton.CompilationError, match="inverse tiles: store"):
        _compile(_chunk16_accesses, K=128, TILE3=old)
