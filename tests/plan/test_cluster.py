"""Cluster presets and files."""

from __future__ import annotations

import pytest

from k3infra.plan import load_cluster


@pytest.mark.parametrize(
    "spec, gpus, per_node, nodes, memory_gb",
    [
        pytest.param("8xH200", 8, 8, 1, 141, id="8xH200"),
        pytest.param("2xH200", 2, 2, 1, 141, id="2xH200"),
        pytest.param("64xH200", 64, 8, 8, 141, id="64xH200"),
        pytest.param("H20", 8, 8, 1, 96, id="H20"),
        pytest.param("2048xH800", 2048, 8, 256, 80, id="2048xH800"),
        pytest.param("GB200 NVL72", 72, 72, 1, 186, id="GB200-NVL72"),
        pytest.param("144xGB300", 144, 72, 2, 288, id="144xGB300"),
    ],
)
def test_presets(spec, gpus, per_node, nodes, memory_gb):
    c = load_cluster(spec)
    assert (c.gpus, c.per_node, c.nodes, round(c.gpu.memory / 1e9)) == (gpus, per_node, nodes, memory_gb)


def test_custom_gpu_needs_every_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("memory: 100\nnodes: 1\n")
    with pytest.raises(ValueError, match="missing"):
        load_cluster(str(path))
    path.write_text("memory: 100\nbf16_flops: 500\nfp8_flops: 1000\nhbm_bw: 3000\nnvlink_bw: 300\n"
                    "network_bw: 25\nper_node: 4\nnodes: 3\n")  # fmt: skip
    c = load_cluster(str(path))
    assert (c.gpus, c.per_node, c.gpu.bf16_flops, c.gpu.network_bw) == (12, 4, 500e12, 25e9)


@pytest.mark.parametrize(
    "text, match",
    [
        pytest.param("gpu: H200\nmemory: -1\n", "'memory' must be a positive number", id="negative"),
        pytest.param("gpu: H200\ncolour: red\n", "unknown fields", id="unknown-field"),
        pytest.param("gpu: H200\ngpus: 8\nnodes: 1\n", "not both", id="gpus-and-nodes"),
        pytest.param("- 1\n", "expected a mapping", id="not-a-mapping"),
    ],
)
def test_bad_files(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_cluster(str(path))
