"""`PhaseClock`: the spans between marks, on the CPU's clock and on a GPU's timeline."""

import time

import pytest
import torch

from k3infra.train.metrics import PhaseClock


def test_cpu_spans_follow_the_marks():
    clock = PhaseClock(torch.device("cpu"))
    clock.mark()
    time.sleep(0.02)
    clock.mark()
    clock.mark()
    first, second = clock.spans_ms()
    assert 20 <= first < 1000 and 0 <= second < first


@pytest.mark.gpu
def test_cuda_spans_time_the_device_not_the_host():
    clock = PhaseClock(torch.device("cuda"))
    clock.mark()
    torch.cuda._sleep(200_000_000)  # queued: the host returns at once, the GPU spins for tens of milliseconds
    clock.mark()
    clock.mark()
    busy, idle = clock.spans_ms()
    assert busy > 10 and idle < 1
