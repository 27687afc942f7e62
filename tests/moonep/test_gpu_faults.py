"""Device tests (``-m gpu``, two CUDA devices, NCCL): a peer that dies or stalls mid-dispatch or mid-combine
makes the survivor raise `CommError` within the buffer's timeout (the transport's watchdog aborts the
process group), and the survivor's stream drains after the abort. Same faults as the gloo tests in
`test_faults.py`; on NCCL the calls return before their collectives finish, so the survivor polls
`Buffer.check_comm` (as a training loop would once per step)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3infra.testing import run_ranks
from tests.moonep.test_faults import check_survivors, fault_rank

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]

# Longer than the gloo tests' 1 s: NCCL connects peers lazily during the first collectives.
NCCL_TIMEOUT_S = 5.0


@pytest.mark.parametrize("where", ["dispatch", "combine"])
@pytest.mark.parametrize("fault", ["die", "stall"])
def test_nccl_peer_fault_raises_comm_error(fault: str, where: str, tmp_path: Path, monkeypatch) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    # NCCL errors it detects itself (a dead peer's connection) must not make ProcessGroupNCCL's own watchdog
    # take the process down: 2 = abort the communicators, keep the process (our CommError then reports it).
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    results = run_ranks(
        fault_rank, 2, fault, where, str(tmp_path), "cuda", NCCL_TIMEOUT_S,
        backend="nccl", timeout_s=120, pg_timeout_s=60, allow_failures=True,
    )  # fmt: skip
    check_survivors(results, fault, NCCL_TIMEOUT_S)
