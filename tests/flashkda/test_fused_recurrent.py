"""fused_recurrent_kda (decode) and flashkda.fwd (MoonshotAI signature) against the fp64 oracle."""

import pytest
import torch

import flashkda
from flashkda import reference
from tests.flashkda.kda_cases import TOL, KDACase, assert_close, make_call

CASES = [
    KDACase(B=3, T=1, H=2, HV=4, K=64, V=32, dtype=torch.bfloat16, gate="bounded", beta_logits=True),
    KDACase(B=2, T=5, H=1, HV=1, K=64, V=64, dtype=torch.float32, gate="softplus", v_first=True),
    KDACase(T=9, H=1, HV=2, K=32, V=64, dtype=torch.float32, gate="pre", lengths=(4, 0, 5)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_fused_recurrent_matches_fp64_reference(case, device):
    args, kw = make_call(case, device)
    kw.pop("safe_gate", None)
    o, s = flashkda.fused_recurrent_kda(*args, **kw)
    ro, rs = reference.chunk_kda_reference(*args, **kw)
    assert_close("o", ro, o, TOL[case.dtype])
    assert_close("final_state", rs, s, TOL[case.dtype])


def test_decode_continues_a_prefill(device):
    """Prefill with chunk_kda, then decode two tokens: same as one pass over all tokens."""
    case = KDACase(B=2, T=66, H=1, HV=2, K=64, V=64, dtype=torch.float32, gate="bounded", beta_logits=True)
    args, kw = make_call(case, device)
    o_all, s_all = flashkda.chunk_kda(*args, **kw)
    o_pre, s_pre = flashkda.chunk_kda(*(x[:, :64] for x in args), **kw)
    dec_kw = {k: v for k, v in kw.items() if k not in ("safe_gate", "initial_state")}
    o_dec, s_dec = flashkda.fused_recurrent_kda(*(x[:, 64:] for x in args), initial_state=s_pre, **dec_kw)
    torch.testing.assert_close(torch.cat([o_pre, o_dec], 1), o_all, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_dec, s_all, rtol=1e-4, atol=1e-5)


def test_fwd_writes_caller_buffers_in_v_first_layout(device):
    case = KDACase(T=70, H=1, HV=2, K=64, V=64, dtype=torch.float32, gate="bounded", beta_logits=True,
                   lengths=(30, 40), v_first=True)
    args, kw = make_call(case, device)
    out = torch.empty_like(args[2])
    final = torch.empty_like(kw["initial_state"])
    ret = flashkda.fwd(*args, None, out, kw["A_log"], kw["dt_bias"].view(2, 64), -5.0,
                       initial_state=kw["initial_state"], final_state=final, cu_seqlens=kw["cu_seqlens"])
    assert ret is out
    ro, rs = reference.chunk_kda_reference(*args, **kw)
    assert_close("out", ro, out, 1e-5)
    assert_close("final_state", rs, final, 1e-5)
