"""`ClusterSpec`: GPUs, nodes and the two link classes (NVLink inside a node or NVLink domain, network between).

Presets are spelled ``<count>x<GPU>`` (``8xH200``, ``2xH200``, ``64xH200`` = 8 nodes of 8, ``2048xH800``), a bare
GPU name (one node) or ``GB200 NVL72`` / ``GB300 NVL72`` (one 72-GPU NVLink domain). Per-GPU numbers are vendor
datasheet values (``docs/planner.md`` cites them): dense (not sparse) tensor-core peaks, NVLink bandwidth per
direction, network bandwidth per GPU per direction (one NIC per GPU). A ``cluster.yaml`` (or JSON) gives the same
fields by hand.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

__all__ = ["GPU", "GPUS", "ClusterSpec", "load_cluster"]

GB = 1e9


@dataclass(frozen=True)
class GPU:
    """One accelerator: memory in bytes, dense peaks in FLOP/s, bandwidths in bytes/s per direction."""

    name: str
    memory: float
    bf16_flops: float
    fp8_flops: float
    hbm_bw: float
    nvlink_bw: float
    network_bw: float
    per_node: int = 8
    """GPUs that share one NVLink domain (8 for HGX boards, 72 for NVL72 racks)."""


GPUS: dict[str, GPU] = {
    # H100/H200/H800/H20 HGX: NVLink 4 at 900 GB/s (H800: 400 GB/s) both directions; one 400 Gb/s NIC per GPU.
    "H100": GPU("H100", 80 * GB, 989e12, 1979e12, 3.35e12, 450 * GB, 50 * GB),
    "H200": GPU("H200", 141 * GB, 989e12, 1979e12, 4.8e12, 450 * GB, 50 * GB),
    "H800": GPU("H800", 80 * GB, 989e12, 1979e12, 3.35e12, 200 * GB, 50 * GB),
    "H20": GPU("H20", 96 * GB, 148e12, 296e12, 4.0e12, 450 * GB, 50 * GB),
    # Blackwell NVL72 racks: NVLink 5 at 1.8 TB/s both directions per GPU; GB300 with 800 Gb/s ConnectX-8.
    "GB200": GPU("GB200", 186 * GB, 2.5e15, 5e15, 8e12, 900 * GB, 50 * GB, per_node=72),
    "GB300": GPU("GB300", 288 * GB, 2.5e15, 5e15, 8e12, 900 * GB, 100 * GB, per_node=72),
}


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` × ``gpu.per_node`` GPUs (or fewer, ``gpus`` < ``per_node``, for a partial node)."""

    name: str
    gpu: GPU
    gpus: int

    @property
    def per_node(self) -> int:
        return min(self.gpu.per_node, self.gpus)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpu.per_node)


_PRESET = re.compile(r"^\s*(?:(\d+)\s*[xX×]\s*)?([A-Za-z]+\d+)(?:\s*NVL(\d+))?\s*$")


def _gpu(name: str, option: str) -> GPU:
    for key, gpu in GPUS.items():
        if key.lower() == name.lower():
            return gpu
    raise ValueError(f"{option}: unknown GPU {name!r}; expected one of {tuple(GPUS)} or a cluster.yaml")


def _from_file(path: Path) -> ClusterSpec:
    text = path.read_text()
    try:
        import yaml

        raw = yaml.safe_load(text)
    except ImportError:
        raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError(f"--cluster {path}: expected a mapping, got {type(raw).__name__}")
    known = {f.name for f in fields(GPU)} | {"gpu", "gpus", "nodes"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--cluster {path}: unknown fields {unknown}; expected some of {sorted(known)}")
    base = _gpu(raw["gpu"], f"--cluster {path}") if isinstance(raw.get("gpu"), str) else None
    values = {}
    for f in fields(GPU):
        if f.name == "name" or f.name not in raw:
            continue
        value = raw[f.name]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"--cluster {path}: field {f.name!r} must be a positive number, got {value!r}")
        # Sizes are written in GB, FLOP rates in TFLOP/s, bandwidths in GB/s.
        scale = 1e12 if f.name.endswith("flops") else 1 if f.name == "per_node" else GB
        values[f.name] = int(value) if f.name == "per_node" else float(value) * scale
    if base is None:
        missing = [f.name for f in fields(GPU) if f.name not in ("name", "per_node") and f.name not in values]
        if missing:
            raise ValueError(f"--cluster {path}: give 'gpu' (a known GPU) or every field; missing {missing}")
        base = GPU(name="custom", **values)
    gpu = replace(base, **values)
    if "gpus" in raw and "nodes" in raw:
        raise ValueError(f"--cluster {path}: give 'gpus' or 'nodes', not both")
    count = raw.get("gpus", raw.get("nodes", 1) * gpu.per_node)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"--cluster {path}: 'gpus'/'nodes' must be a positive int, got {count!r}")
    return ClusterSpec(str(raw.get("name", path.stem)), gpu, count)


def load_cluster(spec: str) -> ClusterSpec:
    """A preset (``8xH200``, ``64xH200``, ``H20``, ``GB200 NVL72``, ``2048xH800``) or a cluster.yaml/json path.

    Raises:
        ValueError: unknown GPU, malformed name or file; the message names ``--cluster``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--cluster must be a preset like 8xH200 or a cluster.yaml path, got {spec!r}")
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise ValueError(f"--cluster {spec!r}: file not found")
        return _from_file(path)
    match = _PRESET.match(spec)
    if not match:
        raise ValueError(f"--cluster {spec!r}: expected '<count>x<GPU>' (e.g. 8xH200), 'GB200 NVL72' or a .yaml file")
    count, name, nvl = match.groups()
    gpu = _gpu(name, f"--cluster {spec!r}")
    gpus = int(count) if count else int(nvl) if nvl else gpu.per_node
    if gpus < 1:
        raise ValueError(f"--cluster {spec!r}: GPU count must be >= 1")
    if gpus > gpu.per_node and gpus % gpu.per_node:
        raise ValueError(f"--cluster {spec!r}: {gpus} GPUs is not whole nodes of {gpu.per_node}")
    return ClusterSpec(spec.strip(), gpu, gpus)
