"""B3 (the chunk-local gradients, Triton) against the emulation's B1 + B3 stages and fp64 autograd, on CPU under
Triton's interpreter (fp32-held bf16 operands, rounded to nearest as on the GPU)."""

import pytest
import torch

from benchmarks.kda.v2_bwd_precision import K, autograd_grads, make_case
from flashkda.bwd.v2 import local_grad
from flashkda.bwd.v2.checkpoints import checkpoint_bound, checkpoint_offsets, emulate_recurrence_train
from flashkda.bwd.v2.emulate import emulate_backward, emulate_state_grads
from flashkda.bwd.v2.local_grad import local_grads_bwd, segment_table
from flashkda.bwd.v2.tail import zero_rows_past_end
from flashkda.fwd.v2.emulate import emulate_prepare
from flashkda.fwd.v2.emulate32 import emulate_prepare32
from flashkda.fwd.v2.workspace import build_chunk_layout
from flashkda.fwd.v2.workspace32 import build_chunk_layout32

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias")
# Same algebra and roundings as the emulation: what remains is fp32 summation order and the rare bf16 rounding it
# flips (measured: dv and dbeta equal bit for bit; the others <= 5.5e-5 at chunk 16 and <= 2.6e-4 at chunk 32, there
# from single elements one bf16 ulp apart at the reference token 15). The emulation itself errs 3e-3 against fp64;
# an algebra slip (e.g. the Glast term scaled by 0.9) errs far above the bar.
MATCH_BAR = 1e-3
KERNEL_BAR, DA_LOG_BAR = 8e-3, 3e-2  # as tests/flashkda/test_bwd_v2_emulate.py


def case_inputs(kw, seed=7, device="cpu"):
    """`make_case` of a CASES entry (its ``dt=False`` drops ``dt_bias``)."""
    kw = dict(kw)
    c = make_case(**{n: x for n, x in kw.items() if n != "dt"}, seed=seed, device=device)
    if not kw.get("dt", True):
        c["dt_bias"] = None
    return c


def scale_of(c):
    return c["q"].shape[-1] ** -0.5


def inputs(c, lower_bound, every, chunk=16):
    B, T = c["q"].shape[:2]
    layout = (build_chunk_layout if chunk == 16 else build_chunk_layout32)(B, T, c["cu"], c["q"].device)
    ws = (emulate_prepare if chunk == 16 else emulate_prepare32)(
        c["q"], c["k"], c["g"], c["beta"], scale_of(c), layout, lower_bound, c["A_log"], c["dt_bias"])
    _, _, ck = emulate_recurrence_train(ws, c["v"], c["h0"], every)
    ds, dh0 = emulate_state_grads(ws, c["do"], c["dht"])
    pad = checkpoint_bound(layout, every) - ck.shape[0]
    ck_padded = torch.cat([ck, ck.new_full((pad, *ck.shape[1:]), float("nan"))])  # rows no segment may read
    return layout, ws, ck, ck_padded, ds, dh0


#: B3's launch forms under test, `local_grads_bwd` options by id: all segments in one group, or groups within a
#: 0.25 MiB scratch (one or two segments per group here).
FORMS = {"one-group": {}, "grouped": dict(scratch_mb=0.25)}
forms = pytest.mark.parametrize("form", list(FORMS), ids=str)


def run_both(c, lower_bound, every, chunk=16, form="one-group"):
    layout, ws, ck, ck_padded, ds, _ = inputs(c, lower_bound, every, chunk)
    ref = emulate_backward(c["q"], c["k"], c["v"], c["g"], c["beta"], scale_of(c), layout, lower_bound, c["do"],
                           A_log=c["A_log"], dt_bias=c["dt_bias"], initial_state=c["h0"], dht=c["dht"], ws=ws,
                           checkpoints=ck, every=every, chunk=chunk)
    got = local_grads_bwd(c["q"], c["k"], c["v"], c["g"], c["beta"], scale_of(c), lower_bound, c["do"], ws, ck_padded,
                          ds.bfloat16(), every, A_log=c["A_log"], dt_bias=c["dt_bias"],
                          **FORMS[form])
    return got, ref


def rel_rms(x, ref):
    return float((x.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt())


CASES = {  # (inputs, every, lower_bound, chunk)
    "fixed": (dict(B=2, T=40, H=1), 2, -5.0, 16),
    "varlen": (dict(B=1, T=70, H=1, cu=[0, 33, 34, 34, 70]), 2, -5.0, 16),
    "varlen_tail": (dict(B=1, T=60, H=1, cu=[0, 21, 22, 45]), 2, -5.0, 16),  # rows 45.. in no sequence
    "gva_no_alog_no_h0": (dict(B=1, T=48, H=1, HV=2, a_log=False, init=False), 3, -0.1, 16),
    "every1": (dict(B=1, T=35, H=2), 1, -1.0, 16),
    "c32_fixed": (dict(B=1, T=80, H=1), 2, -5.0, 32),
    "c32_varlen_gva": (dict(B=1, T=90, H=1, HV=2, cu=[0, 40, 41, 41, 90]), 1, -0.1, 32),
    "c32_no_gate_params": (dict(B=1, T=70, H=1, cu=[0, 30, 62], a_log=False, dt=False), 2, -5.0, 32),
    "k64_varlen_gva": (dict(B=1, T=70, H=1, HV=2, cu=[0, 33, 34, 34, 62], K=64), 2, -5.0, 16),
    "k64_fixed": (dict(B=2, T=40, H=2, K=64), 3, -0.1, 16),
    "k64_c32": (dict(B=1, T=80, H=1, K=64), 2, -5.0, 32),
}


@forms
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_local_grads_match_emulation(case, form):
    kw, every, lb, chunk = CASES[case]
    got, ref = run_both(case_inputs(kw), lb, every, chunk, form)
    errs = {}
    for n in NAMES:
        r, x = getattr(ref, n), getattr(got, n)
        if r is None:
            assert x is None, n
            continue
        assert x.shape == r.shape and x.dtype == r.dtype, (n, x.shape, r.shape, x.dtype, r.dtype)
        assert torch.isfinite(x).all(), n
        errs[n] = rel_rms(x, r)
    assert max(errs.values()) < MATCH_BAR, errs


@forms
@pytest.mark.parametrize("head_dim", [128, 64])
def test_local_grads_against_fp64_autograd(form, head_dim):
    """B3's gradients (B2's ``dh0`` aside) within the emulation's bars against autograd through the reference."""
    c = make_case(B=1, T=70, H=1, HV=2, cu=[0, 37, 38, 70], seed=11, K=head_dim)
    got, _ = run_both(c, -5.0, 2, form=form)
    ref = autograd_grads(c, -5.0)
    errs = {n: rel_rms(getattr(got, n), ref[n]) for n in NAMES}
    assert all(e < (DA_LOG_BAR if n == "dA_log" else KERNEL_BAR) for n, e in errs.items()), errs


@forms
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", ["fixed", "varlen", "varlen_tail", "gva_no_alog_no_h0", "every1", "c32_fixed",
                                  "c32_no_gate_params", "k64_varlen_gva"], ids=str)
def test_outputs_need_no_zero_fill(case, device, form, monkeypatch):
    """The outputs are not zero-filled first (a varlen layout's partial sums aside): with NaN in every element
    before the kernels run, the gradients equal those of zero-filled outputs bit for bit; every element is written,
    by the kernels or, for the rows past the last sequence, by `tail.zero_rows_past_end` (on the device this covers
    the Gluon B3b)."""
    kw, every, lb, chunk = CASES[case]
    c = case_inputs(kw, seed=9, device=device)
    layout, ws, _, ck, ds, _ = inputs(c, lb, every, chunk)
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], scale_of(c), lb, c["do"], ws, ck, ds.bfloat16(), every)
    monkeypatch.setattr(local_grad, "_unfilled",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))
    poisoned = local_grads_bwd(*args, A_log=c["A_log"], dt_bias=c["dt_bias"], **FORMS[form])
    monkeypatch.setattr(local_grad, "_unfilled", torch.zeros)
    zeroed = local_grads_bwd(*args, A_log=c["A_log"], dt_bias=c["dt_bias"], **FORMS[form])
    for n in NAMES:
        if getattr(zeroed, n) is not None:
            assert torch.equal(getattr(poisoned, n), getattr(zeroed, n)), n


def test_tables_kept_with_the_layout_give_the_same_gradients():
    """A second call on the same layout (a model's next KDA layer) reads the segment table and the split's group
    bounds kept with the layout: bit-equal gradients, tables built once."""
    c = make_case(B=1, T=70, H=1, HV=2, cu=[0, 37, 38, 70], seed=5)
    layout, ws, _, ck, ds, _ = inputs(c, -5.0, 2)
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], K**-0.5, -5.0, c["do"], ws, ck, ds.bfloat16(), 2)
    first = local_grads_bwd(*args, A_log=c["A_log"], dt_bias=c["dt_bias"], scratch_mb=0.25)
    kept = dict(layout._derived)
    assert any(key[0] == "B3 segments" for key in kept) and any(key[0] == "B3 group bounds" for key in kept)
    again = local_grads_bwd(*args, A_log=c["A_log"], dt_bias=c["dt_bias"], scratch_mb=0.25)
    assert all(layout._derived[key] is value for key, value in kept.items())
    for n in NAMES:
        if getattr(first, n) is not None:
            assert torch.equal(getattr(again, n), getattr(first, n)), n


@pytest.mark.parametrize("cu", [None, [0, 33, 34, 34, 70, 200]], ids=["fixed", "varlen"])
def test_segment_table(cu):
    T = 70 if cu is None else 200
    layout = build_chunk_layout(2 if cu is None else 1, T, None if cu is None else torch.tensor(cu), "cpu")
    for every in (1, 2, 3):
        seg = segment_table(layout, every)
        ck = checkpoint_offsets(layout, every)
        assert seg.shape == (checkpoint_bound(layout, every), 2)
        assert seg[int(ck[-1]):].eq(0).all()
        seq_chunks = layout.seq_chunks.long()
        covered = []
        for n in range(layout.num_seqs):
            for i in range(int(ck[n]), int(ck[n + 1])):
                first, cnt = seg[i].tolist()
                assert first == int(seq_chunks[n]) + (i - int(ck[n])) * every and 1 <= cnt <= every
                covered += range(first, first + cnt)
        assert covered == list(range(int(seq_chunks[-1])))


def test_bad_arguments():
    c = make_case(B=1, T=32, H=1, seed=1)
    layout, ws, _, ck, ds, _ = inputs(c, -5.0, 2)
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], K**-0.5, -5.0, c["do"], ws, ck, ds)
    with pytest.raises(ValueError, match="every"):
        local_grads_bwd(*args, 0)
    with pytest.raises(ValueError, match="checkpoints"):
        local_grads_bwd(*args[:9], ck[:, :, :64], ds, 2)
    with pytest.raises(ValueError, match="ds must be"):
        local_grads_bwd(*args[:10], ds[:1], 2)
    with pytest.raises(ValueError, match="do must be"):
        local_grads_bwd(*args[:7], c["do"][..., :64], *args[8:], 2)
    with pytest.raises(ValueError, match="scratch_mb"):
        local_grads_bwd(*args, 2, scratch_mb=0)
    with pytest.raises(ValueError, match="ws has kd"):
        local_grads_bwd(*args[:8], inputs(make_case(B=1, T=32, H=1, HV=2), -5.0, 2)[1], ck, ds, 2)
    wide = make_case(B=1, T=32, H=1, seed=1, K=96)
    _, ws96, _, ck96, ds96, _ = inputs(wide, -5.0, 2)
    with pytest.raises(ValueError, match=r"K in \(64, 128\)"):
        local_grads_bwd(wide["q"], wide["k"], wide["v"], wide["g"], wide["beta"], 96**-0.5, -5.0, wide["do"], ws96,
                        ck96, ds96, 2)


@forms
def test_rows_past_the_last_sequence_are_not_read(form):
    """Varlen with tokens after the last sequence: NaN there (inputs and workspace rows, and the workspace's unused
    chunks) reaches no gradient, and those rows' gradients stay zero."""
    c = make_case(B=1, T=60, H=1, cu=[0, 21, 22, 45], seed=4)
    layout, ws, _, ck, ds, _ = inputs(c, -5.0, 2)
    clean = local_grads_bwd(c["q"], c["k"], c["v"], c["g"], c["beta"], K**-0.5, -5.0, c["do"], ws, ck, ds, 2,
                            A_log=c["A_log"], dt_bias=c["dt_bias"], **FORMS[form])
    bad = {n: c[n].clone() for n in ("q", "k", "v", "g", "beta", "do")}
    for x in bad.values():
        x[:, 45:] = float("nan")
    for x in (ws.kd, ws.qd, ws.kr, ws.beta):
        x[45:] = float("nan")
    used = int(layout.seq_chunks[-1])
    assert used < layout.num_chunks  # the varlen bound leaves unused chunks
    for x in (ws.inv, ws.mqk, ws.glast, ds):
        x[used:] = float("nan")
    got = local_grads_bwd(bad["q"], bad["k"], bad["v"], bad["g"], bad["beta"], K**-0.5, -5.0, bad["do"], ws, ck, ds, 2,
                          A_log=c["A_log"], dt_bias=c["dt_bias"], **FORMS[form])
    for n in NAMES:
        assert torch.equal(getattr(got, n), getattr(clean, n)), n
    for n in ("dq", "dk", "dv", "dg", "dbeta"):
        assert getattr(got, n)[:, 45:].eq(0).all(), n


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_local_grads_match_emulation_on_device(case):
    """The compiled kernels (bf16 tensor-core products; B3b in Gluon at chunk 16) against the emulation on the
    device, same bar."""
    kw, every, lb, chunk = CASES[case]
    got, ref = run_both(case_inputs(kw, device="cuda"), lb, every, chunk)
    errs = {n: rel_rms(getattr(got, n), getattr(ref, n)) for n in NAMES if getattr(ref, n) is not None}
    assert max(errs.values()) < MATCH_BAR, errs


def test_zero_rows_past_end_zeroes_only_the_tail():
    """Rows from ``cu_seqlens[-1]`` on, in every output of any 2+ byte dtype; nothing before; bad outputs named."""
    outs = [torch.full((37, 3, 5), float("nan"), dtype=torch.bfloat16), torch.full((37, 4), float("nan")),
            torch.full((37,), float("nan"), dtype=torch.float16)]
    zero_rows_past_end(outs, torch.tensor([0, 10, 20], dtype=torch.int32))
    for x in outs:
        assert x[:20].float().isnan().all() and x[20:].eq(0).all()
    full = torch.ones(37, 2)
    zero_rows_past_end([full], torch.tensor([0, 37]))
    assert full.eq(1).all()
    with pytest.raises(ValueError, match="outputs must hold 1 to"):
        zero_rows_past_end([], torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"outputs\[1\] must be contiguous with 37 rows"):
        zero_rows_past_end([full, torch.ones(36, 2)], torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"outputs\[0\] must be contiguous .* 2\+ bytes"):
        zero_rows_past_end([torch.ones(37, 2, dtype=torch.uint8)], torch.tensor([0, 3]))
