"""Both forward stages give the fp64 result in every launch configuration their autotuners may pick (intra: pass-2
slice width and warps; state: V tile, warps, pipeline stages), with a varlen tail chunk and an empty sequence."""

import pytest
import torch

from flashkda import reference
from flashkda.chunk_fwd import dot_precision_for, work_dtype_for
from flashkda.chunk_intra import CHUNK_SIZE, INTRA_CONFIGS, chunk_kda_fwd_intra
from flashkda.chunk_state import STATE_CONFIGS, chunk_kda_fwd_state_o
from flashkda.index import build_chunk_index
from tests.flashkda.kda_cases import TOL, KDACase, assert_close, make_call

CASES = [KDACase(T=150, H=1, HV=2, K=64, V=64, dtype=dtype, gate="bounded", beta_logits=True, lengths=(70, 0, 80))
         for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("config", STATE_CONFIGS,
                         ids=[f"BV{c[0]}-w{c[1]}-s{c[2]}" for c in STATE_CONFIGS])
@pytest.mark.parametrize("case", CASES, ids=[str(c.dtype)[6:] for c in CASES])
def test_state_stage_configs_match_fp64(config, case, device):
    block_v, num_warps, num_stages = config
    _check(case, device, {}, dict(block_v=min(block_v, case.V), num_warps=num_warps, num_stages=num_stages))


@pytest.mark.parametrize("config", INTRA_CONFIGS, ids=[f"BS{c[0]}-w{c[1]}" for c in INTRA_CONFIGS])
@pytest.mark.parametrize("case", CASES, ids=[str(c.dtype)[6:] for c in CASES])
def test_intra_stage_configs_match_fp64(config, case, device):
    solve_slice, num_warps = config
    _check(case, device, dict(solve_slice=solve_slice, num_warps=num_warps), dict(block_v=32))


def _check(case, device, intra_kw, state_kw):
    args, kw = make_call(case, device)
    q, k, v, g, beta = args
    index = build_chunk_index(1, case.T, kw["cu_seqlens"], CHUNK_SIZE)
    prec = dot_precision_for(q.dtype)
    with torch.no_grad():
        mid = chunk_kda_fwd_intra(q, k, v, g, beta, kw["A_log"], kw["dt_bias"], case.K ** -0.5, kw["lower_bound"],
                                  True, True, True, False, True, index, work_dtype_for(q.dtype), prec, **intra_kw)
        o, s, _ = chunk_kda_fwd_state_o(*mid, kw["initial_state"], True, False, index, q.dtype, prec, **state_kw)
    ro, rs = reference.chunk_kda_reference(*args, **kw)
    assert_close("o", ro, o, TOL[case.dtype])
    assert_close("final_state", rs, s, TOL[case.dtype])
