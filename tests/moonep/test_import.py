"""`import moonep` stays light: torch only (no triton, no device probes), and the public names exist."""

from __future__ import annotations

import subprocess
import sys


def test_import_moonep_does_not_import_triton_or_touch_cuda() -> None:
    code = (
        "import sys, moonep; "
        "assert 'triton' not in sys.modules, 'triton imported'; "
        "assert 'moonep.kernels' not in sys.modules; "
        "import torch; assert not torch.cuda.is_initialized(); "
        "missing = [n for n in moonep.__all__ if not hasattr(moonep, n)]; assert not missing, missing"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
