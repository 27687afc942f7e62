"""chunk_kda against the fp64 oracle on CPU (Triton interpreter): one case per feature path."""

import pytest
import torch

import flashkda
from flashkda import reference
from tests.flashkda.kda_cases import TOL, KDACase, assert_close, make_call

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CASES = [
    KDACase(B=2, T=63, H=2, HV=2, K=64, V=64, dtype=FP32, gate="pre"),
    KDACase(T=100, H=1, HV=2, K=64, V=128, dtype=BF, gate="softplus", beta_logits=True),
    KDACase(T=130, H=2, HV=2, K=64, V=64, dtype=BF, gate="bounded-noA", lengths=(15, 0, 65, 50), v_first=True),
    KDACase(T=70, H=1, HV=1, K=128, V=64, dtype=FP16, gate="bounded", beta_logits=True, neg_eig=True),
    KDACase(T=20, H=1, HV=1, K=256, V=256, dtype=FP32, gate="softplus", h0=False),
    KDACase(T=64, H=1, HV=3, K=64, V=64, dtype=FP32, gate="bounded", l2norm=False, final=False, h0=False),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_chunk_matches_fp64_reference(case, device):
    args, kw = make_call(case, device)
    with torch.no_grad():
        o, s = flashkda.chunk_kda(*args, **kw)
    ro, rs = reference.chunk_kda_reference(*args, **kw)
    assert o.dtype == case.dtype and o.shape == args[2].shape
    assert_close("o", ro, o, TOL[case.dtype])
    if case.final:
        assert s.dtype == torch.float32
        assert_close("final_state", rs, s, TOL[case.dtype])
    else:
        assert s is None


def test_non_contiguous_inputs_give_the_same_result(device):
    case = KDACase(T=40, H=2, HV=2, K=64, V=64, dtype=FP32, gate="softplus")
    args, kw = make_call(case, device)
    o, s = flashkda.chunk_kda(*args, **kw)
    # Same values, transposed storage: [B, H, T, D] memory viewed as [B, T, H, D].
    nc = tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in args)
    assert not nc[0].is_contiguous()
    o2, s2 = flashkda.chunk_kda(*nc, **kw)
    torch.testing.assert_close(o2, o)
    torch.testing.assert_close(s2, s)


def test_varlen_equals_separate_calls(device):
    lengths = (70, 1, 33)
    case = KDACase(T=sum(lengths), H=1, HV=1, K=64, V=64, dtype=FP32, gate="softplus", lengths=lengths)
    args, kw = make_call(case, device)
    o, s = flashkda.chunk_kda(*args, **kw)
    start = 0
    for n, L in enumerate(lengths):
        part = tuple(x[:, start:start + L] for x in args)
        kw_n = {**kw, "initial_state": kw["initial_state"][n:n + 1]}
        for key in ("cu_seqlens", "cu_seqlens_cpu"):
            kw_n.pop(key)
        on, sn = flashkda.chunk_kda(*part, **kw_n)
        torch.testing.assert_close(o[:, start:start + L], on, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s[n:n + 1], sn, rtol=1e-5, atol=1e-5)
        start += L


def test_grad_inputs_route_to_the_autograd_path(device):
    case = KDACase(T=32, H=1, HV=1, K=64, V=64, dtype=FP32, gate="pre")
    args, kw = make_call(case, device)
    q = args[0].clone().requires_grad_(True)
    o, _ = flashkda.chunk_kda(q, *args[1:], **kw)
    assert o.requires_grad and "ChunkKDAFunction" in o.grad_fn.name()
