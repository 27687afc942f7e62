"""Bad input raises ValueError naming the argument, before any kernel runs."""

import pytest
import torch

import flashkda
from flashkda.env import env_choice, env_flag

B, T, H, K, V = 1, 8, 2, 16, 16


def _good():
    return dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V),
                g=-torch.rand(B, T, H, K), beta=torch.rand(B, T, H))


BAD = [
    ("q", dict(q=torch.randn(B, T, H)), "`q`"),
    ("k", dict(k=torch.randn(B, T, H, K + 1)), "`k`"),
    ("v-shape", dict(v=torch.randn(B, T + 1, H, V)), "`v`"),
    ("v-heads", dict(v=torch.randn(B, T, 3, V)), "`v`"),
    ("v-dtype", dict(v=torch.randn(B, T, H, V, dtype=torch.float64)), "`v`"),
    ("q-int", dict(q=torch.ones(B, T, H, K, dtype=torch.int32)), "`q`"),
    ("g", dict(g=torch.randn(B, T, H, K - 1)), "`g`"),
    ("beta", dict(beta=torch.rand(B, T)), "`beta`"),
    ("head-dim", dict(q=torch.randn(B, T, H, 512), k=torch.randn(B, T, H, 512), g=torch.randn(B, T, H, 512)), "`q`"),
    ("initial_state-shape", dict(initial_state=torch.zeros(B, H, K, V + 1)), "`initial_state`"),
    ("initial_state-dtype", dict(initial_state=torch.zeros(B, H, K, V, dtype=torch.bfloat16)), "`initial_state`"),
    ("state_v_first-layout", dict(initial_state=torch.zeros(B, H, K, 8), state_v_first=True), "`initial_state`"),
    ("cu_seqlens-batch", dict(q=torch.randn(2, T, H, K), k=torch.randn(2, T, H, K), v=torch.randn(2, T, H, V),
                              g=-torch.rand(2, T, H, K), beta=torch.rand(2, T, H), cu_seqlens=torch.tensor([0, 8])),
     "`cu_seqlens`"),
    ("cu_seqlens-end", dict(cu_seqlens=torch.tensor([0, 3, 9])), "`cu_seqlens`"),
    ("cu_seqlens-order", dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), "`cu_seqlens`"),
    ("cu_seqlens-dtype", dict(cu_seqlens=torch.tensor([0.0, 8.0])), "`cu_seqlens`"),
    ("cu_seqlens_cpu-shape", dict(cu_seqlens=torch.tensor([0, 8]), cu_seqlens_cpu=torch.tensor([0, 4, 8])),
     "`cu_seqlens_cpu`"),
    ("cu_seqlens_cpu-alone", dict(cu_seqlens_cpu=torch.tensor([0, 8])), "`cu_seqlens_cpu`"),
    ("A_log-missing", dict(use_gate_in_kernel=True), "`A_log`"),
    ("A_log-size", dict(use_gate_in_kernel=True, A_log=torch.zeros(H + 1)), "`A_log`"),
    ("dt_bias-size", dict(use_gate_in_kernel=True, A_log=torch.zeros(H), dt_bias=torch.zeros(H)), "`dt_bias`"),
    ("lower_bound-safe", dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0), "`lower_bound`"),
    ("lower_bound-missing", dict(use_gate_in_kernel=True, safe_gate=True, A_log=torch.zeros(H)), "`lower_bound`"),
    ("allow_neg_eigval", dict(allow_neg_eigval=True), "`allow_neg_eigval=True` requires"),
    ("scale", dict(scale="x"), "`scale`"),
    ("chunk_size", dict(chunk_size=16), "`chunk_size`"),
    ("cp_context", dict(cp_context=object()), "`cp_context`"),
    ("return_intermediate_states", dict(return_intermediate_states=True), "`return_intermediate_states`"),
]


@pytest.mark.parametrize("name,override,match", BAD, ids=[b[0] for b in BAD])
def test_chunk_kda_rejects_bad_argument(name, override, match):
    kw = {**_good(), **override}
    with pytest.raises(ValueError, match=match):
        flashkda.chunk_kda(**kw)


@pytest.mark.parametrize("name,override,match", BAD[:12] + BAD[13:20], ids=[b[0] for b in BAD[:12] + BAD[13:20]])
def test_fused_recurrent_kda_rejects_bad_argument(name, override, match):
    kw = {**_good(), **override}
    with pytest.raises(ValueError, match=match):
        flashkda.fused_recurrent_kda(**kw)


def test_fwd_rejects_a_wrong_out_buffer():
    kw = _good()
    with pytest.raises(ValueError, match="`out`"):
        flashkda.fwd(*kw.values(), None, torch.empty(1), torch.zeros(H), None, -5.0)


def test_mismatched_devices_are_named():
    meta = torch.randn(B, T, H, V, device="meta")
    with pytest.raises(ValueError, match="`v`"):
        flashkda.chunk_kda(**{**_good(), "v": meta})


@pytest.mark.parametrize("value, expected", [(None, True), ("", True), ("1", True), ("On", True), ("yes", True),
                                             ("0", False), ("false", False), (" OFF ", False)])
def test_environment_flags_take_the_usual_words(value, expected, monkeypatch):
    if value is None:
        monkeypatch.delenv("FLASHKDA_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("FLASHKDA_TEST_FLAG", value)
    assert env_flag("FLASHKDA_TEST_FLAG", True) is expected


def test_environment_choices_name_the_choices(monkeypatch):
    monkeypatch.setenv("FLASHKDA_TEST_CHOICE", "IEEE")
    assert env_choice("FLASHKDA_TEST_CHOICE", "tf32", ("tf32", "ieee")) == "ieee"
    monkeypatch.setenv("FLASHKDA_TEST_CHOICE", "fast")
    with pytest.raises(ValueError, match="FLASHKDA_TEST_CHOICE='fast': expected one of tf32, ieee"):
        env_choice("FLASHKDA_TEST_CHOICE", "tf32", ("tf32", "ieee"))


def _varlen():
    return {**_good(), "cu_seqlens": torch.tensor([0, 3, 8])}


@pytest.mark.parametrize("host", [[0, 5, 8], [0, 3, 3, 8]], ids=["other-lengths", "other-count"])
def test_a_cu_seqlens_cpu_that_disagrees_with_cu_seqlens_is_named(host):
    with pytest.raises(ValueError, match=r"`cu_seqlens_cpu` .* must equal `cu_seqlens`"):
        flashkda.chunk_kda(**_varlen(), cu_seqlens_cpu=torch.tensor(host))


def test_a_matching_cu_seqlens_cpu_is_accepted():
    with torch.no_grad():
        o, s = flashkda.chunk_kda(**_varlen(), cu_seqlens_cpu=torch.tensor([0, 3, 8], dtype=torch.int32),
                                  output_final_state=True)
    assert o.shape == (B, T, H, V) and s.shape == (2, H, K, V)


@pytest.mark.parametrize("name", ["output_final_sate", "initial_states", "A_logs", "dtbias"])
def test_an_unknown_keyword_is_a_type_error_naming_it(name):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
        flashkda.chunk_kda(**_good(), **{name: None})


def test_every_keyword_of_fla_chunk_kda_is_accepted():
    """fla-core 0.6.0's signature (and the keywords its body reads from ``**kwargs``) are ours, so that calls routed
    through fla's dispatcher keep working."""
    import inspect

    fla_kda = pytest.importorskip("fla.ops.kda")
    ours = inspect.signature(flashkda.chunk_kda).parameters
    theirs = [n for n, p in inspect.signature(fla_kda.chunk_kda).parameters.items() if p.kind != p.VAR_KEYWORD]
    assert [n for n in theirs if n not in ours] == []
    gate = dict(use_gate_in_kernel=True, A_log=torch.zeros(H), dt_bias=torch.zeros(H * K))
    with torch.no_grad(), pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        flashkda.chunk_kda(**_good(), **gate, chunk_size=32, use_graph=True, max_num_seqs=4,
                           transpose_state_layout=False)


@pytest.mark.parametrize("lower_bound", [2.0, 0.0])
def test_a_lower_bound_that_is_not_negative_is_named(lower_bound):
    with pytest.raises(ValueError, match=f"`lower_bound` must be negative .*, got {lower_bound}"):
        flashkda.chunk_kda(**_good(), use_gate_in_kernel=True, lower_bound=lower_bound, dt_bias=torch.zeros(H * K))


def test_no_environment_switch_but_the_user_facing_ones():
    """Only the user-facing switches are read (``FLASHKDA_DISABLE``, the dispatch policy's, and ``FLASHKDA_KERNELS``,
    the kernel generation, documented in docs/flashkda.md): the A/B switches whose defaults won are gone with their
    losing paths (docs/flashkda-performance.md)."""
    import re
    from pathlib import Path

    package = Path(flashkda.__file__).parent
    names = {n for path in package.rglob("*.py") for n in re.findall(r"FLASHKDA_[A-Z_]+", path.read_text())}
    assert names <= {"FLASHKDA_DISABLE", "FLASHKDA_DISPATCH", "FLASHKDA_CALIBRATION", "FLASHKDA_KERNELS"}, sorted(names)
