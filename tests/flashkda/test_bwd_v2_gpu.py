"""FlashKDA backward v2 kernels on the device against their torch emulation, on the same emulated workspace:
F2 (K2 with the training checkpoint stores) and B2 (the state-gradient chain), chunks of 16 and 32 tokens (Hopper
GPUs only). On the CPU: the launchers' checks, the checkpoint count bound, and that importing loads no kernel."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from benchmarks.kda.v2_bwd_precision import K, make_case
from flashkda.bwd.v2.checkpoints import checkpoint_bound, checkpoint_offsets, emulate_recurrence_train
from flashkda.bwd.v2.emulate import emulate_state_grads
from flashkda.fwd.v2.emulate import emulate_prepare
from flashkda.fwd.v2.emulate32 import emulate_prepare32
from flashkda.fwd.v2.workspace import build_chunk_layout
from flashkda.fwd.v2.workspace32 import build_chunk_layout32
from tests.flashkda.kda_cases import assert_close

#: Kernel vs emulation on the same workspace: only the fp32 summation order differs (it can flip a bf16 rounding
#: of the state operand, which the following chunks carry on), as K2's tests.
TOL_EMULATE = 3e-3
#: Few shapes, so that the device run compiles few kernel variants (H == 1 would be one more specialisation).
CASES = [
    dict(B=2, T=100, H=3, lengths=None),
    dict(B=1, T=1 + 32 + 0 + 47 + 300 + 5, H=2, lengths=(1, 32, 0, 47, 300, 5)),
    dict(B=1, T=700, H=4, lengths=(700,), init=False),
]
VARLEN = CASES[1]


def _cases(main, extra):
    """``main`` configurations on every case, ``extra`` ones on the varlen case only."""
    return [(case, *m) for case in CASES for m in main] + [(VARLEN, *e) for e in extra]


def _id(x):
    return f"B{x['B']}-T{x['T']}-H{x['H']}-{x['lengths']}" if isinstance(x, dict) else str(x)


def _case(B, T, H, lengths, chunk, seed=0, init=True, extra_rows=0, lower_bound=-5.0, device="cuda", head_dim=K):
    """Inputs, ``do``, ``dht`` and the emulated workspace of ``chunk``-token chunks."""
    cu = None if lengths is None else [0, *torch.tensor(lengths).cumsum(0).tolist()]
    c = make_case(B, T + extra_rows, H, cu=cu, seed=seed, init=init, device=device, K=head_dim)
    layout = (build_chunk_layout if chunk == 16 else build_chunk_layout32)(B, T + extra_rows, c["cu"],
                                                                           torch.device(device))
    ws = (emulate_prepare if chunk == 16 else emulate_prepare32)(
        c["q"], c["k"], c["g"], c["beta"], head_dim**-0.5, layout, lower_bound, c["A_log"], c["dt_bias"])
    return c, ws


def test_import_loads_no_kernel():
    code = ("import sys, flashkda.bwd.v2.recurrence_train, flashkda.bwd.v2.state_grad; "
            "sys.exit(any(m.endswith('_kernel') or m.startswith('triton.experimental.gluon') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("lengths", [None, (5, 0, 300, 17, 16, 1)], ids=str)
@pytest.mark.parametrize("every", [1, 3, 4, 8])
@pytest.mark.parametrize("chunk", [16, 32])
def test_checkpoint_bound_holds(lengths, every, chunk):
    B, T = (3, 200) if lengths is None else (1, sum(lengths))
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = build_chunk_layout(B, T, cu, torch.device("cpu"), chunk)
    n = int(checkpoint_offsets(layout, every)[-1])
    assert n <= checkpoint_bound(layout, every)
    if lengths is None:
        assert n == checkpoint_bound(layout, every)
    with pytest.raises(ValueError, match="every"):
        checkpoint_bound(layout, 0)


def test_launchers_reject_bad_arguments():
    from flashkda.bwd.v2.recurrence_train import recurrence_train
    from flashkda.bwd.v2.state_grad import state_grad_bwd

    c, ws = _case(1, 32, 1, None, 16, device="cpu")
    with pytest.raises(ValueError, match="do must be a CUDA tensor"):
        state_grad_bwd(ws, c["do"])
    with pytest.raises(ValueError, match="CUDA"):
        recurrence_train(ws, c["v"])
    with pytest.raises(ValueError, match="every"):
        recurrence_train(ws, c["v"], every=0)


@pytest.mark.parametrize("chunk", [16, 32])
def test_state_grads_oracle_is_the_backward_emulations_b2(chunk):
    """``emulate_state_grads`` (B2's oracle) is the B2 stage of ``emulate_backward``: the same ``dh0``, bit for bit."""
    from flashkda.bwd.v2.emulate import emulate_backward

    c, ws = _case(1, 100, 2, (37, 0, 63), chunk, device="cpu")
    _, _, ck = emulate_recurrence_train(ws, c["v"], c["h0"], 2)
    grads = emulate_backward(c["q"], c["k"], c["v"], c["g"], c["beta"], K**-0.5, ws.layout, -5.0, c["do"],
                             c["A_log"], c["dt_bias"], c["h0"], c["dht"], ws=ws, checkpoints=ck, every=2, chunk=chunk)
    ds, dh0 = emulate_state_grads(ws, c["do"], c["dht"])
    assert torch.equal(dh0, grads.dh0)
    assert ds.shape == (ws.layout.num_chunks, 2, K, K) and torch.equal(ds, ds.bfloat16().float())


def _prefix(ws, tokens):
    """The workspace of one sequence cut to its first ``tokens`` tokens (a chunk multiple: the same chunks)."""
    lay = ws.layout
    dev = lay.cu_seqlens.device
    chunks = tokens // ws.inv.shape[-1]
    layout = dataclasses.replace(lay, cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
                                 seq_chunks=torch.tensor([0, chunks], dtype=torch.int32, device=dev))
    return dataclasses.replace(ws, layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("case,chunk,every", _cases([(16, 8), (32, 4)], [(16, 3), (32, 1)]), ids=_id)
def test_f2_matches_k2_and_emulation(case, chunk, every):
    """F2's o and final state are K2's bit for bit; its checkpoints are the emulation's to K2's tolerance."""
    from flashkda.bwd.v2.recurrence_train import recurrence_train
    from flashkda.fwd.v2.recurrence import recurrence_fwd
    from flashkda.fwd.v2.recurrence32 import recurrence32_fwd

    c, ws = _case(case["B"], case["T"], case["H"], case["lengths"], chunk, init=case.get("init", True))
    k2 = recurrence_fwd if chunk == 16 else recurrence32_fwd
    with torch.inference_mode():
        o, s, ck, offs = recurrence_train(ws, c["v"], c["h0"], True, every)
        o2, s2 = k2(ws, c["v"], c["h0"], True)
        ro, rs, rck = emulate_recurrence_train(ws, c["v"], c["h0"], every)
    torch.cuda.synchronize()
    assert torch.equal(o, o2) and torch.equal(s, s2)
    want = checkpoint_offsets(ws.layout, every)
    assert offs.cpu().tolist() == want.tolist()
    n = int(want[-1])
    assert_close("checkpoints", rck.float(), ck[:n].float(), TOL_EMULATE)
    assert_close("o", ro.float(), o.float(), TOL_EMULATE)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk,every", [(16, 8), (32, 4)])
def test_f2_checkpoint_is_the_prefix_state_bit_for_bit(chunk, every):
    """Checkpoint i is bf16 of K2's own final state over the sequence's first ``i * every`` chunks."""
    from flashkda.bwd.v2.recurrence_train import recurrence_train
    from flashkda.fwd.v2.recurrence import recurrence_fwd
    from flashkda.fwd.v2.recurrence32 import recurrence32_fwd

    c, ws = _case(1, 700, 2, None, chunk, seed=4)
    k2 = recurrence_fwd if chunk == 16 else recurrence32_fwd
    with torch.inference_mode():
        _, _, ck, _ = recurrence_train(ws, c["v"], c["h0"], False, every)
        assert torch.equal(ck[0], c["h0"][0].bfloat16())
        for i in (1, 2, (700 // chunk) // every):
            _, s = k2(_prefix(ws, i * every * chunk), c["v"], c["h0"], True)
            assert torch.equal(ck[i], s[0].bfloat16()), f"checkpoint {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("case,chunk,stages", _cases([(16, 2), (32, 2)], [(16, 3), (32, 3)]), ids=_id)
def test_b2_matches_emulation(case, chunk, stages):
    from flashkda.bwd.v2.state_grad import state_grad_bwd

    c, ws = _case(case["B"], case["T"], case["H"], case["lengths"], chunk, seed=1)
    dht = c["dht"] if case.get("init", True) else None
    with torch.inference_mode():
        ds, dh0 = state_grad_bwd(ws, c["do"], dht, True, stages=stages)
        rds, rdh0 = emulate_state_grads(ws, c["do"], dht)
    torch.cuda.synchronize()
    used = int(ws.layout.seq_chunks[-1])
    assert_close("ds", rds[:used], ds[:used].float(), TOL_EMULATE)
    assert_close("dh0", rdh0, dh0, TOL_EMULATE)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [16, 32])
def test_b2_without_dh0_and_gate_sweep(chunk):
    from flashkda.bwd.v2.state_grad import state_grad_bwd

    for lower_bound in (-5.0, -1.0, -0.1):
        c, ws = _case(1, 2048, 2, (1500, 548), chunk, seed=7, lower_bound=lower_bound)
        with torch.inference_mode():
            ds, dh0 = state_grad_bwd(ws, c["do"], c["dht"], False)
            rds, _ = emulate_state_grads(ws, c["do"], c["dht"])
        assert dh0 is None
        used = int(ws.layout.seq_chunks[-1])
        assert_close(f"ds lb={lower_bound}", rds[:used], ds[:used].float(), TOL_EMULATE)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [16, 32])
def test_b2_and_f2_ignore_rows_past_the_last_sequence(chunk):
    """Token rows after ``cu_seqlens[-1]`` are never written by K1; NaN there must not reach ds, dh0 or checkpoints."""
    from flashkda.bwd.v2.recurrence_train import recurrence_train
    from flashkda.bwd.v2.state_grad import state_grad_bwd

    lengths = (37, 0, 300, 5)
    end = sum(lengths)
    c, ws = _case(1, end, 2, lengths, chunk, seed=5, extra_rows=9)
    for t in (ws.kd, ws.qd, ws.kr, ws.beta):
        t[end:] = float("nan")
    c["do"][:, end:] = float("nan")
    c["v"][:, end:] = float("nan")
    with torch.inference_mode():
        ds, dh0 = state_grad_bwd(ws, c["do"], c["dht"], True)
        rds, rdh0 = emulate_state_grads(ws, c["do"], c["dht"])
        every = {16: 8, 32: 4}[chunk]
        _, _, ck, _ = recurrence_train(ws, c["v"], c["h0"], False, every)
        _, _, rck = emulate_recurrence_train(ws, c["v"], c["h0"], every)
    used = int(ws.layout.seq_chunks[-1])
    assert_close("ds", rds[:used], ds[:used].float(), TOL_EMULATE)
    assert_close("dh0", rdh0, dh0, TOL_EMULATE)
    assert_close("checkpoints", rck.float(), ck[:rck.shape[0]].float(), TOL_EMULATE)



@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_head_width_64_stages_match_emulation(case):
    """K = V = 64 at 16-token chunks: K1's workspace, F2's output, final state and checkpoints, and B2's state
    gradients against their emulation, with the K = 128 bars."""
    from flashkda.bwd.v2.recurrence_train import recurrence_train
    from flashkda.bwd.v2.state_grad import state_grad_bwd
    from flashkda.fwd.v2.prepare import prepare_fwd
    from flashkda.fwd.v2.recurrence import recurrence_fwd
    from tests.flashkda.test_fwd_v2 import assert_workspace_close

    init = case.get("init", True)
    c, ws = _case(case["B"], case["T"], case["H"], case["lengths"], 16, seed=2, init=init, head_dim=64)
    with torch.inference_mode():
        got_ws = prepare_fwd(c["q"], c["k"], c["g"], c["beta"], 64**-0.5, ws.layout, -5.0, c["A_log"],
                             c["dt_bias"])
        o, s, ck, _ = recurrence_train(ws, c["v"], c["h0"], True, 8)
        o2, s2 = recurrence_fwd(ws, c["v"], c["h0"], True)
        ro, rs, rck = emulate_recurrence_train(ws, c["v"], c["h0"], 8)
        dht = c["dht"] if init else None
        ds, dh0 = state_grad_bwd(ws, c["do"], dht, True)
        rds, rdh0 = emulate_state_grads(ws, c["do"], dht)
    torch.cuda.synchronize()
    assert_workspace_close(got_ws, ws)
    assert o.shape == (case["B"], case["T"], case["H"], 64) and ck.shape[1:] == (case["H"], 64, 64)
    assert torch.equal(o, o2) and torch.equal(s, s2)
    n = int(checkpoint_offsets(ws.layout, 8)[-1])
    assert_close("checkpoints", rck.float(), ck[:n].float(), TOL_EMULATE)
    assert_close("o", ro.float(), o.float(), TOL_EMULATE)
    assert_close("final state", rs.float(), s.float(), TOL_EMULATE)
    used = int(ws.layout.seq_chunks[-1])
    assert_close("ds", rds[:used], ds[:used].float(), TOL_EMULATE)
    assert_close("dh0", rdh0, dh0, TOL_EMULATE)
