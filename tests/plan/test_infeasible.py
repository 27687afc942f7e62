"""Requests that cannot fit say which term overflows and by how much; bad inputs name the option."""

from __future__ import annotations

import pytest

from k3infra.plan import (
    Layout,
    SearchOptions,
    ServeWorkload,
    TrainWorkload,
    load_cluster,
    load_model,
    plan_serve,
    plan_train,
)  # fmt: skip


def test_k3_training_on_one_node_names_the_overflowing_term():
    result = plan_train(load_model("k3"), load_cluster("8xH200"), TrainWorkload(seq_len=4096),
                        SearchOptions(pp=(8,), vp=(1,), zero=(3,), recompute=("full",)))  # fmt: skip
    assert result.best is None
    reason = result.reason()
    assert "over by" in reason and "126.9 GB are usable" in reason
    assert "optimizer" in reason  # the largest term


def test_k3_serving_on_one_node_at_bf16_does_not_fit():
    result = plan_serve(load_model("k3"), load_cluster("8xH200"), ServeWorkload(context=4096))
    assert result.best is None and "weights" in result.reason()


def test_k3_mxfp4_serving_at_1m_fits_on_two_nodes():
    work = ServeWorkload(context=1 << 20, concurrency=8, weight_dtype="mxfp4")
    result = plan_serve(load_model("k3"), load_cluster("16xH200"), work)
    assert result.best is not None


def test_batch_that_does_not_split_is_reported():
    result = plan_train(load_model("k3-mini"), load_cluster("8xH200"),
                        TrainWorkload(seq_len=4096, global_batch_tokens=4096 * 3), SearchOptions(tp=(1,), cp=(1,)))
    assert result.best is None or all(p.layout.dp in (1,) for p in result.plans)
    assert any("do not split" in r for r in result.rejected)


@pytest.mark.parametrize(
    "make, option",
    [
        pytest.param(lambda: TrainWorkload(seq_len=0), "--seq-len", id="seq-len"),
        pytest.param(lambda: TrainWorkload(seq_len=4096, global_batch_tokens=1000), "--global-batch-tokens",
                     id="global-batch"),
        pytest.param(lambda: TrainWorkload(optimizer="sgd"), "--optimizer", id="optimizer"),
        pytest.param(lambda: TrainWorkload(precision="fp4"), "--precision", id="precision"),
        pytest.param(lambda: ServeWorkload(cache_dtype="int4"), "--cache-dtype", id="cache-dtype"),
        pytest.param(lambda: ServeWorkload(weight_dtype="fp16"), "--weight-dtype", id="weight-dtype"),
        pytest.param(lambda: ServeWorkload(concurrency=0), "--concurrency", id="concurrency"),
        pytest.param(lambda: Layout(tp=0), "--tp", id="tp"),
        pytest.param(lambda: Layout(ep=3, dp=4), "--ep", id="ep"),
        pytest.param(lambda: Layout(vp=2), "--vp", id="vp"),
        pytest.param(lambda: Layout(zero=4), "--zero", id="zero"),
        pytest.param(lambda: Layout(recompute="some"), "--recompute", id="recompute"),
        pytest.param(lambda: SearchOptions(reserve=1.0), "--reserve", id="reserve"),
        pytest.param(lambda: SearchOptions(efficiency=0), "--efficiency", id="efficiency"),
        pytest.param(lambda: load_model("nope"), "--model", id="model"),
        pytest.param(lambda: load_cluster("8xA999"), "--cluster", id="cluster-gpu"),
        pytest.param(lambda: load_cluster("12xH200"), "--cluster", id="cluster-partial-node"),
        pytest.param(lambda: load_cluster("missing.yaml"), "--cluster", id="cluster-file"),
    ],
)
def test_bad_input_names_the_option(make, option):
    with pytest.raises(ValueError, match=option):
        make()


def test_unsupported_model_type(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        load_model(str(path))


def test_missing_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "qwen3_moe", "hidden_size": 8}')
    with pytest.raises(ValueError, match="missing field 'num_attention_heads'"):
        load_model(str(path))
